"""A rank's working directory on its executor's disk, and the sweep of those a killed task left.

A task removes its workdir (the pickled function, the result, the rank's stacks) when it ends. A
task that is SIGKILLed (a lost executor, Spark killing the Python worker of a cancelled stage, the
OOM killer) cannot: its directory would stay for good. Each task therefore holds an exclusive
``flock`` on a file in its workdir for as long as it runs, and before making its own, sweeps the
workdirs whose lock nobody holds. The kernel drops a lock with the process that held it, however it
ended; a lock says more than a pid would (pids are reused, and executors in containers sharing a
disk do not see each other's). A directory younger than :data:`GRACE_S` is never swept: its task
may be between making it and locking it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

LOCK = ".task-lock"
GRACE_S = 60.0


class Workdir:
    """A fresh workdir of ``run_id``'s rank ``rank``, locked by this process until :meth:`remove`."""

    def __init__(self, run_id: str, rank: int, root: str | None = None, grace_s: float = GRACE_S) -> None:
        parent = Path(root or tempfile.gettempdir())
        sweep(parent, grace_s)
        self.path = Path(tempfile.mkdtemp(prefix=f"sparkdl-{run_id}-r{rank}-", dir=parent))
        # Not inherited by the rank or anything else this task starts: the lock ends with the task.
        self._fd: int | None = os.open(self.path / LOCK, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def sweep(root: Path, grace_s: float = GRACE_S) -> list[Path]:
    """Removes this user's workdirs under ``root`` whose task is gone; returns them."""
    removed = []
    now, uid = time.time(), os.getuid()
    for path in root.glob("sparkdl-*-r*-*"):
        with contextlib.suppress(OSError):
            st = path.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or now - st.st_mtime < grace_s:
                continue
            fd = os.open(path / LOCK, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: its task runs
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            finally:
                os.close(fd)
    return removed
