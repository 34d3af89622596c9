"""Process trees on Linux: what a rank started ends with it, even what left its process group.

Killing a rank's process group misses descendants that called ``setsid`` (daemons, some
launchers). A rank is therefore a *child subreaper*: a descendant orphaned by its parent is
re-parented to the rank instead of to init, so the rank's tree, read from ``/proc``, holds every
process it started for as long as the rank lives. When the rank has died first, its orphans go
to the nearest subreaper above it (the zygote, or the Spark task), which ends them.

A leaf: standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def set_subreaper(on: bool = True) -> bool:
    """Makes this process adopt its orphaned descendants (Linux); False where that is not possible."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1 if on else 0, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent() -> bool:
    """This process gets SIGKILL when its parent ends (Linux); False where that is not possible."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, ppid, ...; the start
    time is index 19), or None once the process has ended."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def started_at(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (tells a reused pid apart), or None once it has ended."""
    fields = stat_fields(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def still_running(pid: int, started: int | None) -> bool:
    """Whether the process ``pid`` that started at ``started`` (see :func:`started_at`; None: any)
    runs on this host; a process of another user counts too."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return started is None or started_at(pid) == started


def parent_of(pid: int) -> int | None:
    """The parent of ``pid``, or None once it has ended."""
    fields = stat_fields(pid)
    return int(fields[1]) if fields is not None else None


def _parents() -> dict[int, int]:
    """Every live process's parent."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if name.isdigit() and (parent := parent_of(int(name))) is not None:
            found[int(name)] = parent
    return found


def children(pid: int) -> list[int]:
    """The direct children of ``pid``."""
    return [child for child, parent in _parents().items() if parent == pid]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, parents before their children."""
    below: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        below.setdefault(parent, []).append(child)
    out: list[int] = []
    todo = list(below.get(pid, []))
    while todo:
        current = todo.pop(0)
        out.append(current)
        todo.extend(below.get(current, []))
    return out


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def kill_descendants(pid: int, rounds: int = 5) -> None:
    """SIGKILLs every process below ``pid``, again while new ones appear (a fork in flight, or an
    orphan re-parented to ``pid`` as its parent died); bounded by ``rounds`` scans."""
    for _ in range(rounds):
        found = descendants(pid)
        if not found:
            return
        for child in found:
            _kill(child)
        time.sleep(0.01)


def kill_adopted(parent: int, keep: set[int]) -> list[int]:
    """SIGKILLs the children of ``parent`` (a subreaper) that are not in ``keep``, with their
    trees: the orphans of a rank that died before it could end them. Returns the ones found."""
    adopted = [child for child in children(parent) if child not in keep]
    for child in adopted:
        kill_descendants(child)
        _kill(child)
    if parent == os.getpid():
        _reap(adopted, deadline=time.monotonic() + 2.0)
    return adopted


def _reap(pids: list[int], deadline: float) -> None:
    """Collects the exit status of killed children, so none is left a zombie (bounded wait)."""
    left = set(pids)
    while left and time.monotonic() < deadline:
        for pid in list(left):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                left.discard(pid)
        if left:
            time.sleep(0.01)


def kill_group(pgid: int) -> None:
    """SIGKILLs the process group that ``pgid`` leads (a rank leads its own): it and all it started."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
