"""Starting a rank's process: forked from a warm zygote (:mod:`sparkdl._internal.task.zygote`), the
executor's or, for ranks on the driver (``HorovodRunner(np<0)``, ``TorchDistributor(local_mode=True)``),
the driver's own; or as a fresh interpreter (``python -m sparkdl._internal.rank``) when the zygote
cannot be had or is not wanted (``RunConfig.prewarm=False``).

Both give an object with ``pid``, ``stdout``, ``stderr``, ``wait(timeout=None)`` and
``returncode``, as :class:`subprocess.Popen` does; the rank leads its own process group either way.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any, ClassVar, Protocol

from sparkdl._internal.common import proctree
from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.common.net import peer_credentials
from sparkdl._internal.fs.private import secret_file, user_dir
from sparkdl._internal.wire.rankspec import fd_env
from sparkdl._version import __version__

log = logging.getLogger(__name__)
# The package's own directory: part of the zygote's address, so two installs never share one.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The descriptors a spawn request carries, in this order; the rank's environment names the
# numbers that the last four end up with in the rank.
fd_names = ("stdout", "stderr", "lifeline", "control", "metrics", "store")
MAX_MESSAGE = 1 << 20
# The handshake's messages are small; a larger packet before it ends is refused unread.
MAX_HANDSHAKE_MESSAGE = 512
NONCE_BYTES = 32
# How many times a task starts a zygote that finds its address taken before it gives up on it.
_MAX_STARTS = 3
# The longest a thread waiting for a rank's exit reads the zygote's socket before another may.
_READ_TURN_S = 0.2


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


def proof(key: bytes, side: bytes, first: bytes, second: bytes) -> bytes:
    """What one side of the zygote handshake sends to show it holds the executor's key: an HMAC
    over both sides' fresh nonces, tagged with the sender's side so neither can be replayed."""
    return hmac.new(key, side + b"\0" + first + second, hashlib.sha256).digest()


class Zygote:
    """A Python worker's connection to its executor's zygote. One task runs at a time in a worker.

    Nothing is sent on it until the other end has shown it is this executor's zygote: it runs as
    this user (``SO_PEERCRED``) and proves it holds the executor's key (:func:`executor_key`).
    The zygote checks the same of the task before it acts on any request.
    """

    _current: ClassVar[Zygote | None] = None
    # The driver's zygote (ranks on the driver), and the key only this driver process holds.
    _driver: ClassVar[Zygote | None] = None
    _driver_key: ClassVar[tuple[int, bytes] | None] = None
    # Zygotes this worker started: polled so that one that exits is reaped, not left a zombie.
    _started: ClassVar[list[subprocess.Popen[bytes]]] = []

    def __init__(self, sock: socket.socket, key: bytes, timeout_s: float) -> None:
        self.sock = sock
        # The ranks of one task (RunConfig.processes_per_task) are waited for from threads of
        # their own: one reads the socket at a time, keeping the exit codes it reads for the others.
        self._read_lock = threading.Lock()
        self._exits: dict[int, int] = {}
        self.pid, uid = peer_credentials(sock)
        if uid != os.getuid():
            sock.close()
            raise ZygoteError(
                f"the zygote's address is held by another user (uid {uid}, pid {self.pid}), who may be "
                "trying to capture sparkdl's ranks; nothing was sent to it, and this rank starts as a "
                "fresh interpreter (tell the host's administrator)"
            )
        try:
            self._handshake(key, timeout_s)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            sock.close()
            raise ZygoteError(
                f"the process at the zygote's address (pid {self.pid}) did not prove it is this "
                f"executor's zygote ({type(exc).__name__}: {exc}); nothing was sent to it"
            ) from exc

    def _handshake(self, key: bytes, timeout_s: float) -> None:
        mine = secrets.token_bytes(NONCE_BYTES)
        self.sock.settimeout(timeout_s)
        self.sock.send(json.dumps({"hello": mine.hex()}).encode())
        reply = json.loads(self.sock.recv(MAX_HANDSHAKE_MESSAGE))
        theirs = bytes.fromhex(reply["nonce"])
        if len(theirs) != NONCE_BYTES or not hmac.compare_digest(
            bytes.fromhex(reply["proof"]), proof(key, b"zygote", mine, theirs)
        ):
            raise ValueError("wrong proof of the executor's key")
        self.sock.send(json.dumps({"proof": proof(key, b"task", theirs, mine).hex()}).encode())

    @classmethod
    def get(cls, timeout_s: float, *, on_driver: bool = False) -> Zygote:
        """This executor's zygote, or with ``on_driver`` this driver's (it ends with this process;
        its key is drawn here and kept in memory): connected on first use, started if none runs,
        again if lost."""
        cls._started = [proc for proc in cls._started if proc.poll() is None]
        if on_driver and (cls._driver_key is None or cls._driver_key[0] != os.getpid()):
            # First use, or a forked child of the driver: never its parent's connection or key.
            cls._driver, cls._driver_key = None, (os.getpid(), secrets.token_bytes(32))
        current = cls._driver if on_driver else cls._current
        if current is not None and current.alive():
            return current
        if current is not None:
            current.close()
        key = cls._driver_key[1] if on_driver and cls._driver_key else executor_key()
        sock = _connect(zygote_address(key), key, timeout_s, cls._started, os.getpid() if on_driver else os.getppid())
        current = Zygote(sock, key, timeout_s)
        setattr(cls, "_driver" if on_driver else "_current", current)
        return current

    @classmethod
    def started_pids(cls) -> set[int]:
        """The zygotes this worker started: children of the worker, not orphans to end."""
        return {proc.pid for proc in cls._started}

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
        with self._read_lock:
            try:
                socket.send_fds(self.sock, [data], order)
            except OSError as exc:
                raise ZygoteError(f"could not reach the zygote: {exc}") from exc
            while True:
                reply = self._recv(timeout_s)
                if "pid" in reply:
                    pid = int(reply["pid"])
                    if proctree.parent_of(pid) not in (self.pid, None):
                        # Never signal a pid the zygote merely named: it must be the zygote's child.
                        raise ZygoteError(f"the zygote answered with pid {pid}, which is not its child")
                    # An exit kept for an earlier rank of this pid: that rank was reaped before.
                    self._exits.pop(pid, None)
                    return pid
                if "error" in reply:
                    raise ZygoteError(f"the zygote could not fork: {reply['error']}")
                self._keep_exit(reply)  # a rank of this task, or one whose task stopped waiting

    def wait_exit(self, pid: int, timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._read_lock:
                if pid in self._exits:
                    return self._exits.pop(pid)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise ZygoteTimeout(f"the zygote did not report rank pid {pid}'s exit within {timeout} s")
                try:
                    # A short read, so that another waiting thread gets its turn at the socket.
                    self._keep_exit(self._recv(_READ_TURN_S if left is None else min(left, _READ_TURN_S)))
                except ZygoteTimeout:
                    continue

    def _keep_exit(self, reply: dict[str, Any]) -> None:
        if "exit" in reply:
            self._exits[int(reply["exit"])] = int(reply["code"])

    def close(self, *, kill: bool = False) -> None:
        """Drops this connection; ``kill`` also ends a zygote that stopped answering in time."""
        self.sock.close()
        if kill:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signal.SIGKILL)
        if Zygote._current is self:
            Zygote._current = None
        if Zygote._driver is self:
            Zygote._driver = None


def _parent_identity() -> tuple[int, str]:
    """This worker's parent (the PySpark daemon, or the executor JVM) and its start time, so that
    a reused pid never names an old zygote."""
    parent = os.getppid()
    fields = proctree.stat_fields(parent)
    return parent, fields[19].decode() if fields is not None and len(fields) > 19 else ""


def executor_key() -> bytes:
    """A secret that only this executor's processes hold: the zygote's name and its handshake
    come from it.

    Spark gives every Python worker of an executor the secret its PySpark daemon authenticates
    the JVM with (``PYTHON_WORKER_FACTORY_SECRET``); the key is derived from it and from the
    daemon's identity. Another user cannot read it, so can neither predict the zygote's address
    nor pass its handshake. Where Spark gives no such secret, the key is random, kept in a 0600
    file in this user's private directory (:mod:`sparkdl._internal.fs.private`), one per daemon.
    """
    parent, started = _parent_identity()
    factory = os.environ.get("PYTHON_WORKER_FACTORY_SECRET")
    if factory:
        return hashlib.sha256(f"sparkdl-zygote\0{factory}\0{parent}\0{started}".encode()).digest()
    try:
        return secret_file(user_dir("zygote", setting="RunConfig(prewarm=False)") / f"{parent}-{started or 0}.key")
    except (ConfigError, OSError) as exc:
        raise ZygoteError(f"no key for the zygote: {exc}") from exc


def zygote_address(key: bytes) -> str:
    """The abstract socket name of this executor's zygote: unpredictable without the key.

    It also names what the zygote must share with its ranks: the interpreter and this sparkdl.
    """
    what = "\0".join([os.path.realpath(sys.executable), _PACKAGE_DIR, __version__])
    return f"sparkdl-zygote-{hmac.new(key, what.encode(), hashlib.sha256).hexdigest()[:32]}"


def _connect(
    address: str, key: bytes, timeout_s: float, started: list[subprocess.Popen[bytes]], watched: int
) -> socket.socket:
    """Connects to the zygote at ``address``, starting it first if none listens there; a zygote
    started here ends when process ``watched`` does."""
    deadline = time.monotonic() + timeout_s
    proc: subprocess.Popen[bytes] | None = None
    starts = 0
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
            if starts == _MAX_STARTS:
                raise ZygoteError(
                    f"the zygote's address is taken, but nothing accepts connections there after {starts} starts"
                )
            starts += 1
            proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "sparkdl._internal.task.zygote", address, str(watched)],
                stdin=subprocess.PIPE,
                start_new_session=True,
            )
            started.append(proc)
            assert proc.stdin is not None
            with contextlib.suppress(OSError):  # the key goes down a pipe: never on a command line
                proc.stdin.write(key.hex().encode() + b"\n")
                proc.stdin.close()
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
    on_driver: bool = False,
) -> ProcessHandle:
    """Starts one rank with ``fds`` (lifeline, control, metrics and, on rank 0, store) passed on.

    With ``prewarm`` the rank is forked from the zygote (the driver's with ``on_driver``), which
    has torch imported already; if the zygote cannot be had, or without ``prewarm``, it is a fresh
    ``python -m sparkdl._internal.rank``.
    """
    if prewarm and hasattr(socket, "send_fds") and hasattr(os, "fork"):
        try:
            return _fork_rank(workdir, env, fds, name=name, timeout_s=timeout_s, on_driver=on_driver)
        except ZygoteError as exc:
            log.warning("sparkdl: starting %s as a fresh interpreter: %s", name, exc)
    child_env = {**env, **fd_env(fds)}
    return subprocess.Popen(
        [sys.executable, "-u", "-m", "sparkdl._internal.rank", workdir],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env,
        pass_fds=list(fds.values()),
        start_new_session=True,
    )


def _fork_rank(
    workdir: str, env: dict[str, str], fds: dict[str, int], *, name: str, timeout_s: float, on_driver: bool
) -> ForkedRank:
    zygote = Zygote.get(timeout_s, on_driver=on_driver)
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
