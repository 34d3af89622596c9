"""Starting a rank's process from a Spark task: forked from the Python worker's warm zygote
(:mod:`sparkdl._zygote`), or as a fresh interpreter when the zygote cannot be had.

Both give an object with ``pid``, ``stdout``, ``stderr``, ``wait(timeout=None)`` and
``returncode``, as :class:`subprocess.Popen` does; the rank leads its own process group either way.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from typing import IO, Any, ClassVar, Protocol

# The descriptors a spawn request carries, in this order; the rank's environment names the
# numbers that the last four end up with in the rank.
fd_names = ("stdout", "stderr", "lifeline", "control", "metrics", "store")
MAX_MESSAGE = 1 << 20


class RankProcess(Protocol):
    pid: int
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    @property
    def returncode(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class ZygoteError(RuntimeError):
    """The zygote could not start, fork, or report on a rank; the caller falls back."""


class Zygote:
    """The task side of one Python worker's zygote. One task runs at a time in a Python worker."""

    _current: ClassVar[Zygote | None] = None

    def __init__(self, ready_timeout_s: float) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "sparkdl._zygote", str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                pass_fds=[theirs.fileno()],
                start_new_session=True,
            )
        finally:
            theirs.close()
        self.sock = ours
        try:
            ready = self._recv(ready_timeout_s)
        except ZygoteError:
            self.close()
            raise
        if "ready" not in ready:
            self.close()
            raise ZygoteError(f"unexpected first message from the zygote: {ready!r}")

    @classmethod
    def get(cls, ready_timeout_s: float) -> Zygote:
        """This Python worker's zygote, started on first use and again after it was lost."""
        current = cls._current
        if current is None or current.proc.poll() is not None:
            if current is not None:
                current.close()
            cls._current = None
            current = cls._current = Zygote(ready_timeout_s)
        return current

    def _recv(self, timeout: float | None) -> dict[str, Any]:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(MAX_MESSAGE)
        except TimeoutError as exc:
            raise ZygoteError(f"the zygote did not answer within {timeout} s") from exc
        except OSError as exc:
            raise ZygoteError(f"the zygote's socket failed: {exc}") from exc
        if not data:
            raise ZygoteError("the zygote exited")
        message: dict[str, Any] = json.loads(data)
        return message

    def spawn(self, request: dict[str, Any], fds: dict[str, int], timeout_s: float) -> int:
        data = json.dumps(request).encode()
        if len(data) > MAX_MESSAGE // 2:
            raise ZygoteError(f"the rank's environment is too large to send ({len(data)} bytes)")
        order = [fds[name] for name in fd_names if name in fds]
        try:
            socket.send_fds(self.sock, [data], order)
        except OSError as exc:
            raise ZygoteError(f"could not reach the zygote: {exc}") from exc
        while True:
            reply = self._recv(timeout_s)
            if "pid" in reply:
                return int(reply["pid"])
            if "error" in reply:
                raise ZygoteError(f"the zygote could not fork: {reply['error']}")
            # An exit report of an earlier rank whose task stopped waiting for it.

    def wait_exit(self, pid: int, timeout: float | None) -> int:
        while True:
            reply = self._recv(timeout)
            if reply.get("exit") == pid:
                return int(reply["code"])

    def close(self) -> None:
        self.sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if Zygote._current is self:
            Zygote._current = None


class ForkedRank:
    """A rank forked by the zygote; ``wait`` learns its exit code from the zygote, which reaps it."""

    def __init__(self, zygote: Zygote, pid: int, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self._zygote = zygote
        self.pid = pid
        self.stdout: IO[bytes] | None = stdout
        self.stderr: IO[bytes] | None = stderr
        self._code: int | None = None

    @property
    def returncode(self) -> int | None:
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        if self._code is None:
            try:
                self._code = self._zygote.wait_exit(self.pid, timeout)
            except ZygoteError as exc:
                if timeout is not None and "did not answer" in str(exc):
                    raise subprocess.TimeoutExpired(f"sparkdl rank pid {self.pid}", timeout) from exc
                # The zygote is gone and took the exit code with it: make sure the rank is too.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.pid, 9)
                self._zygote.close()
                self._code = -9
        return self._code


def start_rank(
    workdir: str,
    env: dict[str, str],
    fds: dict[str, int],
    *,
    name: str,
    prewarm: bool,
    timeout_s: float,
) -> RankProcess:
    """Starts one rank with ``fds`` (lifeline, control, metrics and, on rank 0, store) passed on.

    With ``prewarm`` the rank is forked from the zygote, which has torch imported already; if the
    zygote cannot be had, or without ``prewarm``, it is a fresh ``python -m sparkdl._rank``.
    """
    if prewarm and hasattr(socket, "send_fds") and hasattr(os, "fork"):
        try:
            return _fork_rank(workdir, env, fds, name=name, timeout_s=timeout_s)
        except ZygoteError as exc:
            sys.stderr.write(f"sparkdl: starting {name} as a fresh interpreter: {exc}\n")
    child_env = dict(env)
    for key, fd in fds.items():
        child_env[f"SPARKDL_{key.upper()}_FD"] = str(fd)
    return subprocess.Popen(
        [sys.executable, "-u", "-m", "sparkdl._rank", workdir],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env,
        pass_fds=list(fds.values()),
        start_new_session=True,
    )


def _fork_rank(workdir: str, env: dict[str, str], fds: dict[str, int], *, name: str, timeout_s: float) -> ForkedRank:
    zygote = Zygote.get(timeout_s)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    request = {"workdir": workdir, "env": env, "cwd": os.getcwd(), "sys_path": list(sys.path), "name": name}
    try:
        pid = zygote.spawn(request, {"stdout": out_w, "stderr": err_w, **fds}, timeout_s)
    except ZygoteError:
        for fd in (out_r, err_r):
            os.close(fd)
        zygote.close()
        raise
    finally:
        os.close(out_w)
        os.close(err_w)
    return ForkedRank(zygote, pid, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))
