"""Who may write a checkpoint directory: one live run, and within it the newest attempt.

Two writers on one directory happen: rank 0 of an earlier attempt still running on an executor
the driver cut off, two runs given the same ``checkpoint_dir``, CrossValidator fits sharing one.
Two files in the directory keep them apart, each small JSON, never a pickle:

- ``.sparkdl-run.json``, the run's lease, written by the driver (:class:`RunLease`) and renewed
  every third of ``RunConfig.checkpoint_lease_s``. A second run that finds another run's lease
  still renewed (or its driver process alive on this host) is refused before it starts, with a
  message naming both runs. A lease nobody renews within ``checkpoint_lease_s`` (its driver died)
  is taken over, and what that run left half-written is removed.
- ``.sparkdl-attempt.json``, the attempt fence, claimed by rank 0 of each attempt before it
  first reads a checkpoint and again before every write and right before every commit
  (:func:`claim`): an attempt older than the one named there is stale, and its commit is
  refused, not merged; an attempt that saves before it ever restores moves the fence on from
  the attempt before it.

Clocks are never compared across hosts: a lease is alive while its renewal counter moves (or,
on the same host, while its process lives).
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from sparkdl._internal.common.errors import SparkDLError
from sparkdl._internal.common.proctree import started_at, still_running
from sparkdl._internal.fs.storage import filesystem, make_dirs, redact

RUN_FILE = ".sparkdl-run.json"
ATTEMPT_FILE = ".sparkdl-attempt.json"


class StaleWriterError(SparkDLError):
    """A checkpoint write by a writer that no longer owns the directory: an earlier attempt of
    the run (a newer one has started) or another run (it took the directory over)."""


@dataclass(frozen=True)
class Writer:
    """The run and attempt a rank writes checkpoints for; plain and picklable."""

    run: str
    attempt: int

    @property
    def tag(self) -> str:
        """In the names of what this writer makes (temporary files, shard directories)."""
        return f"{self.run}-{self.attempt}"

    def made(self, tag: str | None) -> bool:
        """Whether a file tagged ``tag`` was made by this run at this attempt or an earlier one:
        those this writer may remove (an earlier attempt of its own run is over, or fenced)."""
        attempt = (tag or "").rpartition("-")[2]
        return run_of(tag) == self.run and attempt.isdigit() and int(attempt) <= self.attempt


def run_of(tag: str | None) -> str | None:
    """The run of a :attr:`Writer.tag` (``<run>-<attempt>``) in a file's name; None for an untagged one."""
    if tag is None or "-" not in tag:
        return None
    return tag.rpartition("-")[0]


def _read(fs: Any, path: str) -> dict[str, Any] | None:
    try:
        with fs.open_input_stream(path) as f:
            raw = f.read(4096)
    except (FileNotFoundError, OSError):
        return None
    try:
        found = json.loads(raw)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def _write(fs: Any, path: str, value: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"
    with fs.open_output_stream(tmp) as out:
        out.write(json.dumps(value).encode())
    fs.move(tmp, path)


def _fenced_by(found: dict[str, Any] | None, writer: Writer) -> str | None:
    """Why ``writer`` may not write where the attempt fence holds ``found``; None when it may."""
    if found is None:
        return None
    run, attempt = found.get("run"), found.get("attempt")
    if run == writer.run and isinstance(attempt, int) and attempt > writer.attempt:
        return (f"attempt {writer.attempt} of run {writer.run} is stale: attempt {attempt} of the same run "
                "has started since and owns the checkpoints; this attempt's commit is refused")
    if run != writer.run and run is not None:
        return (f"run {run} has taken this checkpoint directory over from run {writer.run} (whose driver "
                f"stopped renewing its lease); run {writer.run}'s commit is refused")
    return None


def _fence(fs: Any, root: str, writer: Writer) -> dict[str, Any] | None:
    """The attempt fence as it bears on ``writer``: None where another run's fence is left from
    before the run the lease names now, ``writer``'s (or where no run holds a lease)."""
    found = _read(fs, posixpath.join(root, ATTEMPT_FILE))
    if found is not None and found.get("run") != writer.run:
        lease = _read(fs, posixpath.join(root, RUN_FILE))
        if lease is None or lease.get("run") == writer.run:
            return None
    return found


def claim(url: str, writer: Writer) -> None:
    """Marks ``writer``'s attempt as the directory's newest; StaleWriterError when a newer one
    already claimed it, or when the run's lease names another run."""
    fs, root = filesystem(url)
    make_dirs(fs, root)
    found = _fence(fs, root, writer)
    why = _fenced_by(found, writer)
    if why:
        raise StaleWriterError(f"checkpoint directory {redact(url)}: {why}")
    if found is None or found.get("attempt") != writer.attempt or found.get("run") != writer.run:
        _write(fs, posixpath.join(root, ATTEMPT_FILE), {"run": writer.run, "attempt": writer.attempt})


# -- the run's lease, held by the driver ----------------------------------------------------------


class RunLease:
    """The driver's claim on a checkpoint directory for the whole run; a context manager."""

    def __init__(self, url: str, run_id: str, lease_s: float) -> None:
        self.url = url
        self.run_id = run_id
        self.lease_s = lease_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat = 0
        self.took_over: str | None = None
        self._fs, root = filesystem(url)
        self._path = posixpath.join(root, RUN_FILE)
        self._me = {"run": run_id, "host": socket.gethostname(), "pid": os.getpid(),
                    "pid_started": started_at(os.getpid()), "lease_s": lease_s}

    def _holder_alive(self, found: dict[str, Any]) -> bool:
        if found.get("host") == self._me["host"] and isinstance(found.get("pid"), int):
            return still_running(found["pid"], found.get("pid_started"))
        # Another host: alive while its counter moves. Clocks of two hosts are never compared.
        deadline = time.monotonic() + float(found.get("lease_s") or self.lease_s)
        while time.monotonic() < deadline:
            time.sleep(min(0.2, self.lease_s / 10))
            now = _read(self._fs, self._path)
            if now is None or now.get("run") != found.get("run"):
                return False
            if now.get("beat") != found.get("beat"):
                return True
        return False

    def acquire(self) -> RunLease:
        make_dirs(self._fs, posixpath.dirname(self._path))
        found = _read(self._fs, self._path)
        if found is not None and found.get("run") not in (None, self.run_id):
            if self._holder_alive(found):
                raise SparkDLError(
                    f"checkpoint directory {redact(self.url)} is in use by run {found.get('run')} (driver "
                    f"pid {found.get('pid')} on {found.get('host')}), so run {self.run_id} did not start: two "
                    "runs writing one directory would destroy each other's checkpoints. Give this run its own "
                    "checkpoint_dir, or wait for that run to end; a run whose driver died is taken over after RunConfig.checkpoint_lease_s="
                    f"{found.get('lease_s')}"
                )
            self.took_over = str(found.get("run"))
        self._renew()
        self._thread = threading.Thread(target=self._loop, name="sparkdl-checkpoint-lease", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        self._beat += 1
        _write(self._fs, self._path, {**self._me, "beat": self._beat})

    def _loop(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            with contextlib.suppress(Exception):  # a store that hiccups: the next beat tries again
                self._renew()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.lease_s)
        found = _read(self._fs, self._path)
        if found is not None and found.get("run") == self.run_id:
            with contextlib.suppress(Exception):
                self._fs.delete_file(self._path)

    def __enter__(self) -> RunLease:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
