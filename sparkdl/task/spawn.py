"""Starting a rank's process: forked from the executor's warm zygote (:mod:`sparkdl.task.zygote`),
or as a fresh interpreter (``python -m sparkdl.rank``) when the zygote cannot be had or is not
wanted (``RunConfig.prewarm=False``, and ranks on the driver).

Both give an object with ``pid``, ``stdout``, ``stderr``, ``wait(timeout=None)`` and
``returncode``, as :class:`subprocess.Popen` does; the rank leads its own process group either way.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, ClassVar, Protocol

from sparkdl._version import __version__
from sparkdl.rankspec import fd_env

log = logging.getLogger(__name__)
# The package's own directory: part of the zygote's address, so two installs never share one.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The descriptors a spawn request carries, in this order; the rank's environment names the
# numbers that the last four end up with in the rank.
fd_names = ("stdout", "stderr", "lifeline", "control", "metrics", "store")
MAX_MESSAGE = 1 << 20


class ProcessHandle(Protocol):
    """A started rank as its launcher holds it: a ``subprocess.Popen``, or a rank forked by the zygote."""

    pid: int
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    @property
    def returncode(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class ZygoteError(RuntimeError):
    """The zygote could not start, fork, or report on a rank; the caller falls back."""


class ZygoteTimeout(ZygoteError):
    """The zygote did not answer in time."""


class Zygote:
    """A Python worker's connection to its executor's zygote. One task runs at a time in a worker."""

    _current: ClassVar[Zygote | None] = None
    # Zygotes this worker started: polled so that one that exits is reaped, not left a zombie.
    _started: ClassVar[list[subprocess.Popen[bytes]]] = []

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        self.pid = int(struct.unpack("3i", creds)[0])

    @classmethod
    def get(cls, timeout_s: float) -> Zygote:
        """This executor's zygote: connected on first use, started if none runs, again if lost."""
        cls._started = [proc for proc in cls._started if proc.poll() is None]
        current = cls._current
        if current is not None and current.alive():
            return current
        if current is not None:
            current.close()
        cls._current = current = Zygote(_connect(zygote_address(), timeout_s, cls._started))
        return current

    def alive(self) -> bool:
        """False once the zygote has closed this connection (read ahead, without consuming)."""
        try:
            self.sock.setblocking(False)
            try:
                return self.sock.recv(MAX_MESSAGE, socket.MSG_PEEK) != b""
            finally:
                self.sock.setblocking(True)
        except BlockingIOError:
            return True
        except OSError:
            return False

    def _recv(self, timeout: float | None) -> dict[str, Any]:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(MAX_MESSAGE)
        except TimeoutError as exc:
            raise ZygoteTimeout(f"the zygote did not answer within {timeout} s") from exc
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

    def close(self, *, kill: bool = False) -> None:
        """Drops this connection; ``kill`` also ends a zygote that stopped answering in time."""
        self.sock.close()
        if kill:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signal.SIGKILL)
        if Zygote._current is self:
            Zygote._current = None


def zygote_address() -> str:
    """The abstract socket name of this executor's zygote.

    It names what the zygote must share with its ranks: the user, the interpreter, this sparkdl,
    and the process the zygote's life is tied to (this worker's parent: the PySpark daemon, or
    the executor JVM), with its start time so that a reused pid never names an old zygote.
    """
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/stat", "rb") as stat:
            started = stat.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        started = ""
    key = "\0".join(
        [str(os.getuid()), os.path.realpath(sys.executable), _PACKAGE_DIR, __version__, str(parent), started]
    )
    return f"sparkdl-zygote-{parent}-{hashlib.sha256(key.encode()).hexdigest()[:24]}"


def _connect(address: str, timeout_s: float, started: list[subprocess.Popen[bytes]]) -> socket.socket:
    """Connects to the zygote at ``address``, starting it first if none listens there."""
    deadline = time.monotonic() + timeout_s
    proc: subprocess.Popen[bytes] | None = None
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect("\0" + address)
            return sock
        except OSError as exc:
            sock.close()
            if not isinstance(exc, (ConnectionRefusedError, FileNotFoundError)):
                raise ZygoteError(f"could not reach the zygote: {exc}") from exc
        if proc is None or (proc.poll() is not None and proc.returncode == 0):
            # None listens (or the one started lost a race to a zygote that has since gone).
            proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "sparkdl.task.zygote", address, str(os.getppid())],
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            started.append(proc)
        elif proc.returncode is not None:
            raise ZygoteError(f"the zygote exited with code {proc.returncode} before it listened")
        if time.monotonic() > deadline:
            raise ZygoteError(f"the zygote did not listen within {timeout_s} s")
        time.sleep(0.01)


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
            except ZygoteTimeout as exc:
                raise subprocess.TimeoutExpired(f"sparkdl rank pid {self.pid}", timeout or 0) from exc
            except ZygoteError:
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
) -> ProcessHandle:
    """Starts one rank with ``fds`` (lifeline, control, metrics and, on rank 0, store) passed on.

    With ``prewarm`` the rank is forked from the zygote, which has torch imported already; if the
    zygote cannot be had, or without ``prewarm``, it is a fresh ``python -m sparkdl.rank``.
    """
    if prewarm and hasattr(socket, "send_fds") and hasattr(os, "fork"):
        try:
            return _fork_rank(workdir, env, fds, name=name, timeout_s=timeout_s)
        except ZygoteError as exc:
            log.warning("sparkdl: starting %s as a fresh interpreter: %s", name, exc)
    child_env = {**env, **fd_env(fds)}
    return subprocess.Popen(
        [sys.executable, "-u", "-m", "sparkdl.rank", workdir],
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
    except ZygoteError as exc:
        for fd in (out_r, err_r):
            os.close(fd)
        # One that stopped answering is ended, so that the next task starts a fresh one.
        zygote.close(kill=isinstance(exc, ZygoteTimeout))
        raise
    finally:
        os.close(out_w)
        os.close(err_w)
    return ForkedRank(zygote, pid, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))


def kill_group(pgid: int) -> None:
    """SIGKILLs the process group of a rank (the rank leads it): the rank and all it started."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def read_error(workdir: Path) -> tuple[str | None, str | None]:
    """The error and traceback a failed rank recorded in its workdir, if it could."""
    try:
        info = json.loads((workdir / "error.json").read_text())
        return info.get("error"), info.get("traceback")
    except (OSError, ValueError):
        return None, None
