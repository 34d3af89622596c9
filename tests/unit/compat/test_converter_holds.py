"""The converter's cache is shared: the same DataFrame written twice (two notebooks, two jobs on one
cluster) is one entry, so one process's converter.delete() or exit must not delete the files
another still reads. Two real processes hold one entry; no Spark is needed for the holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import sparkdl.compat.petastorm as converter_module
from sparkdl._internal.data.writing.cache import hold

_OTHER = """
import sys, time
from sparkdl._internal.data.writing.cache import hold
hold(sys.argv[1])
print("holding", flush=True)
time.sleep(60)
"""


def test_an_entry_another_live_process_reads_is_kept_and_deleted_once_the_last_holder_goes(tmp_path: Path) -> None:
    entry = tmp_path / "cache" / "entry-1"
    entry.mkdir(parents=True)
    (entry / "part-0.parquet").write_bytes(b"rows")
    url = f"file://{entry}"
    other = subprocess.Popen([sys.executable, "-c", _OTHER, url], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "holding"
        converter_module._HELD[url] = hold(url)
        converter_module._delete_at_exit()  # this process exits: the other still reads the entry
        assert (entry / "part-0.parquet").read_bytes() == b"rows"
        assert url not in converter_module._HELD
        other.kill()
        other.wait(timeout=30)
        # The other process died without letting go: its mark is stale, so the next release deletes.
        converter_module._HELD[url] = hold(url)
        converter_module._let_go(url)
        assert not entry.exists()
    finally:
        other.kill()
        other.wait(timeout=30)
        converter_module._HELD.pop(url, None)
