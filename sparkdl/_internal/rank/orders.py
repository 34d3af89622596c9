"""The rank's end of its control pipe: first the gang (one JSON line, written by its lane once
the gang formed), then, in a trial of ``sparkdl.tune``, the driver's decision on each report
(:func:`sparkdl._internal.wire.trial.decision_line`).

The rank process opens it once (:func:`open_pipe`, from :mod:`sparkdl._internal.rank.main`);
``context().report`` waits here for its step's decision. One reader per rank process: it is the
rank's own pipe, and this module is where the rank keeps it.
"""

from __future__ import annotations

import json
import os
import select
import threading
import time
from typing import Any


class ControlPipe:
    """Lines from the rank's lane; thread-safe."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buf = b""
        self._eof = False
        self._lock = threading.Lock()
        self.decisions: dict[int, bool] = {}
        self.off: str | None = None  # why no decision will come, once told
        self.last_prune = False

    def first_line(self) -> str:
        """The gang, as the lane wrote it; "" when the lane closed the pipe first (it gave up)."""
        with self._lock:
            while b"\n" not in self._buf and not self._eof:
                self._read(None)
            line, _, self._buf = self._buf.partition(b"\n")
            return line.decode()

    def decision(self, step: int, timeout_s: float) -> bool | None:
        """The driver's decision for ``step`` (True: prune); None when none will come (the lane
        said so, or closed the pipe), TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._take_lines()  # what came with the gang, or with an earlier decision
            while step not in self.decisions:
                if self.off is not None or self._eof:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(step)
                self._read(left)
                self._take_lines()
            prune = self.decisions[step]
            self.last_prune = self.last_prune or prune
            return prune

    def _read(self, timeout_s: float | None) -> None:
        if timeout_s is not None and not select.select([self._fd], [], [], timeout_s)[0]:
            return
        chunk = os.read(self._fd, 65536)
        if chunk:
            self._buf += chunk
        else:
            self._eof = True

    def _take_lines(self) -> None:
        while b"\n" in self._buf:
            line, _, self._buf = self._buf.partition(b"\n")
            try:
                body: dict[str, Any] = json.loads(line)
            except ValueError:
                continue
            if "off" in body:
                self.off = str(body["off"])
            elif isinstance(body.get("step"), int):
                self.decisions[body["step"]] = bool(body.get("prune"))


_pipe: ControlPipe | None = None


def open_pipe(fd: int) -> ControlPipe:
    """The rank's control pipe, read from here on (once, by the rank's main)."""
    global _pipe
    _pipe = ControlPipe(fd)
    return _pipe


def pipe() -> ControlPipe | None:
    """The rank's control pipe; None outside a rank process (or before its main opened it)."""
    return _pipe
