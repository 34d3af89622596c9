"""A checkpoint write killed midway: ``CheckpointStore.save`` writes to a temporary file and
commits by rename, so a process killed with SIGKILL while its bytes are going out leaves the
previous checkpoint the latest; the next save commits after it, and the partial file is removed
by the next attempt of the same run only, never by another writer (it may be one still writing).
A real writer process, no Spark; the runs that crash mid-save and resume are in
tests/integration/test_faults.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

import sparkdl
from sparkdl._internal.ckpt.fence import Writer

pytestmark = pytest.mark.fault


_WRITER = """
import sys, torch
from sparkdl._internal.ckpt.fence import Writer
from sparkdl._internal.ckpt.store import CheckpointStore
store = CheckpointStore(sys.argv[1], writer=Writer("a1b2c3", 0))
store.save({"global_step": 1, "w": torch.zeros(10)})
print("first", flush=True)
store.save({"global_step": 2, "w": torch.randn(int(sys.argv[2]))})
"""


def test_sigkill_while_the_file_is_being_written_leaves_the_previous_checkpoint(tmp_path) -> None:
    """The same guarantee at the file level: a real process killed while its bytes are going out."""
    ckpt = tmp_path / "ckpt"
    for size in (50_000_000, 150_000_000, 300_000_000):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(ckpt), str(size)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "first"
            deadline = time.monotonic() + 60
            caught = False
            while proc.poll() is None and time.monotonic() < deadline:
                tmps = list(ckpt.glob(".tmp-ckpt-*"))
                if tmps and tmps[0].stat().st_size > 0:
                    proc.send_signal(signal.SIGKILL)
                    caught = True
                    break
                time.sleep(0.001)
        finally:
            proc.kill()
            proc.wait(timeout=30)
        store = sparkdl.CheckpointStore(str(ckpt))
        if caught:
            assert store.sequence_numbers() == [1]
            assert store.load()["global_step"] == 1
            assert list(ckpt.glob(".tmp-ckpt-*")), "expected the partial file of the killed write"
            store.save({"global_step": 2})
            assert store.sequence_numbers() == [1, 2]
            assert list(ckpt.glob(".tmp-ckpt-*")), "a writer outside the run removed the run's file"
            rerun = sparkdl.CheckpointStore(str(ckpt), writer=Writer("a1b2c3", 1))
            rerun.save({"global_step": 3})
            assert rerun.sequence_numbers() == [1, 2, 3] and not list(ckpt.glob(".tmp-ckpt-*"))
            return
        for path in ckpt.iterdir():
            path.unlink()
    pytest.fail("the write always finished before it could be killed; raise the sizes")


_STALE = """
import sys, time
from sparkdl._internal.ckpt.fence import StaleWriterError, Writer
from sparkdl._internal.ckpt.store import CheckpointStore
store = CheckpointStore(sys.argv[1], keep=100, writer=Writer("e5e5", 0))
i = 0
try:
    while True:
        i += 1
        store.save({"by": "attempt 0", "i": i})
        if i == 3:
            print("saving", flush=True)
except StaleWriterError as exc:
    print("refused after", i, exc, flush=True)
"""


def test_an_earlier_attempt_still_saving_is_fenced_off_once_the_next_attempt_claims_the_directory(tmp_path) -> None:
    """Rank 0 of attempt 0 on a cut-off executor goes on saving, as fast as it can, in a process
    of its own, while attempt 1 restores and saves: from attempt 1's claim on, attempt 0's
    commits are refused, and whatever raced the claim never passes for attempt 1's state."""
    ckpt = tmp_path / "ckpt"
    stale = subprocess.Popen([sys.executable, "-c", _STALE, str(ckpt)], stdout=subprocess.PIPE, text=True)
    try:
        assert stale.stdout is not None and stale.stdout.readline().strip() == "saving"
        new = sparkdl.CheckpointStore(str(ckpt), keep=100, writer=Writer("e5e5", 1))
        restored, _ = new.newest_good()  # the claim
        assert restored is not None and new.load(restored)["by"] == "attempt 0"
        out, _ = stale.communicate(timeout=60)
        assert out.startswith("refused after") and "attempt 0 of run e5e5 is stale" in out, out
        mine = [new.save({"by": "attempt 1", "k": k}) for k in range(3)]
    finally:
        stale.kill()
        stale.wait(timeout=30)
    # Attempt 0 committed nothing after attempt 1's first save; everything attempt 1 wrote is good
    # and newest; a commit of attempt 0 that raced the claim is either whole or skipped as torn.
    good, skipped = new.newest_good()
    assert good == mine[-1] and not skipped
    for seq in new.sequence_numbers():
        if new.verify(seq) is None:
            who = new.load(seq)["by"]
            assert who == ("attempt 1" if seq >= mine[0] else "attempt 0"), (seq, who)
