"""One live run per checkpoint directory: the driver's lease (sparkdl._internal.ckpt.fence.RunLease).

A second run given a directory that a live run holds is refused before it starts, naming both
runs; a run whose driver died is taken over: at once when that driver ran on this host (its
process is gone), after ``checkpoint_lease_s`` without a renewal when it ran elsewhere (clocks
of two hosts are never compared). Two real driver processes play the two runs where a process
must die; the run that ends lets go of the directory. The same refusal through ``sparkdl.run``
is in tests/integration/test_faults.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import sparkdl
from sparkdl._internal.ckpt.fence import RUN_FILE, RunLease

_HOLDER = """
import sys, time
from sparkdl._internal.ckpt.fence import RunLease
lease = RunLease(sys.argv[1], "aaaa01", 0.6).acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_a_second_run_on_a_live_runs_directory_is_refused_naming_both(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, url], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(sparkdl.SparkDLError) as info:
            RunLease(url, "bbbb02", 0.6).acquire()
        message = str(info.value)
        assert "in use by run aaaa01" in message and f"pid {holder.pid}" in message
        assert "run bbbb02 did not start" in message and "checkpoint_dir" in message
        # Its driver dies without letting go (SIGKILL), a save of its half-written: the next run
        # takes the directory at once, and removes what that run left, nothing else.
        holder.kill()
        holder.wait(timeout=30)
        theirs = [f".tmp-ckpt-00000003-aaaa01-2-{'0' * 32}", "shards-00000003-aaaa01-2-ab12"]
        others = [f".tmp-ckpt-00000003-ffff09-0-{'1' * 32}", "shards-00000003-ffff09-0-cd34"]
        for name in theirs + others:
            (tmp_path / name).mkdir() if name.startswith("shards") else (tmp_path / name).write_bytes(b"x")
        started = time.monotonic()
        lease = RunLease(url, "bbbb02", 0.6).acquire()
        try:
            assert lease.took_over == "aaaa01" and time.monotonic() - started < 0.5
            assert json.loads((tmp_path / RUN_FILE).read_text())["run"] == "bbbb02"
            assert sparkdl.CheckpointStore(url).remove_leftovers_of("aaaa01") == sorted(theirs)
            assert sorted(p.name for p in tmp_path.iterdir() if p.name != RUN_FILE) == sorted(others)
        finally:
            lease.release()
        assert not (tmp_path / RUN_FILE).exists(), "a run that ended kept its lease"
    finally:
        holder.kill()
        holder.wait(timeout=30)


def _other_host(path: Path, run: str, beat: int) -> None:
    path.write_text(json.dumps({"run": run, "host": "elsewhere.invalid", "pid": 1, "lease_s": 0.6, "beat": beat}))


def test_a_lease_held_on_another_host_counts_while_it_is_renewed(tmp_path: Path) -> None:
    url, path = f"file://{tmp_path}", tmp_path / RUN_FILE
    stop = threading.Event()

    def renew() -> None:
        beat = 0
        while not stop.wait(0.2):
            beat += 1
            _other_host(path, "cccc03", beat)

    _other_host(path, "cccc03", 0)
    beating = threading.Thread(target=renew)
    beating.start()
    try:
        with pytest.raises(sparkdl.SparkDLError, match=r"in use by run cccc03 \(driver pid 1 on elsewhere.invalid\)"):
            RunLease(url, "dddd04", 0.6).acquire()
    finally:
        stop.set()
        beating.join()
    # Renewals stopped (that driver died): taken over once a lease's time passed without one.
    started = time.monotonic()
    lease = RunLease(url, "dddd04", 0.6).acquire()
    lease.release()
    assert lease.took_over == "cccc03" and 0.55 < time.monotonic() - started < 5


def test_the_lease_is_renewed_while_the_run_lasts(tmp_path: Path) -> None:
    with RunLease(f"file://{tmp_path}", "eeee05", 0.3):
        first = json.loads((tmp_path / RUN_FILE).read_text())["beat"]
        time.sleep(0.5)
        assert json.loads((tmp_path / RUN_FILE).read_text())["beat"] > first
