"""Rank workdirs: a SIGKILLed task's is swept by the next task on that disk, a running task's never."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from sparkdl._internal.task.workdir import Workdir, sweep

HOLDER = """
import sys, time
from sparkdl._internal.task.workdir import Workdir
own = Workdir(sys.argv[1], 0, root=sys.argv[2])
(own.path / "payload.pkl").write_bytes(b"x" * 100)
print(own.path, flush=True)
time.sleep(120)
"""


def _task(root: Path, run_id: str) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, run_id, str(root)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def _age(path: Path, seconds: float) -> None:
    st = path.stat()
    os.utime(path, (st.st_atime - seconds, st.st_mtime - seconds))


def test_a_killed_tasks_workdir_is_swept_and_a_running_ones_is_kept(tmp_path: Path) -> None:
    killed, killed_dir = _task(tmp_path, "aaaa")
    running, running_dir = _task(tmp_path, "bbbb")
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        for path in (killed_dir, running_dir):
            _age(path, 120)
        assert killed_dir.is_dir() and (killed_dir / "payload.pkl").is_file()  # nobody cleaned up after it

        own = Workdir("cccc", 1, root=str(tmp_path))
        assert not killed_dir.exists()
        assert (running_dir / "payload.pkl").is_file()  # its task still runs
        assert own.path.is_dir() and own.path.name.startswith("sparkdl-cccc-r1-")
        assert sweep(tmp_path, grace_s=0) == []  # this task's own, locked, is not swept either
        own.remove()
        assert not own.path.exists()
    finally:
        running.kill()
        running.wait(10)
    # Once its task is gone, the other goes with the next sweep.
    _age(running_dir, 120)
    assert sweep(tmp_path) == [running_dir] and not running_dir.exists()


def test_a_young_workdir_and_what_is_not_a_workdir_stay(tmp_path: Path) -> None:
    killed, young = _task(tmp_path, "dddd")
    killed.kill()
    killed.wait(10)
    unlocked = tmp_path / "sparkdl-eeee-r0-abc"  # a workdir of an earlier sparkdl: no lock file
    unlocked.mkdir()
    _age(unlocked, 120)
    link = tmp_path / "sparkdl-ffff-r0-link"
    link.symlink_to(young)
    assert sweep(tmp_path) == []  # younger than the grace: its task may be about to lock it
    assert young.is_dir() and unlocked.is_dir() and link.is_symlink()
    _age(young, 120)
    assert sweep(tmp_path) == [young] and unlocked.is_dir()
