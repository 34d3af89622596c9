"""A warm parent for rank processes, one per Spark executor: ``python -m sparkdl._internal.task.zygote ADDRESS PID``.

Importing torch is the longest step of a launch on a warm executor (1.5 to 2.5 s, longer than
Spark's own scheduling). The first task on an executor that starts a rank also starts a zygote;
the zygote imports torch once and then forks every later rank of that executor, so a rank starts
with torch already loaded. The zygote runs nothing but imports and forks: no torch operation, no
CUDA, no thread pool, no second thread, which is what makes forking it safe.

It belongs to the executor, not to the Python worker that started it. Spark ends Python workers
often: one idle for a minute, and one whose task did not read all its input (as
TorchDistributor's tasks do) is not reused. The zygote outlives them and ends when ``PID`` ends:
the PySpark daemon (or, without the daemon, the executor JVM), which ends with the executor.

It listens on the abstract Unix socket ``ADDRESS`` (``SOCK_SEQPACKET``; no file to leave behind)
and serves only connections from its own user that prove they hold the executor's key, which
the task that starts it writes to its stdin (:func:`sparkdl._internal.task.spawn.executor_key`). A second
zygote started for the same address finds it taken and exits at once, so two tasks that race to
start one share the winner.

Protocol, one JSON message per packet, on each connection:

* the handshake, before anything else: task -> zygote ``{"hello": NONCE_T}``; zygote -> task
  ``{"nonce": NONCE_Z, "proof": P_Z}``; task -> zygote ``{"proof": P_T}``, each proof an HMAC
  under the key over both nonces (:func:`sparkdl._internal.task.spawn.proof`). A connection that has not
  finished it within a few seconds, sends anything else, or sends descriptors is closed;
* task -> zygote: ``{"workdir", "env", "cwd", "sys_path", "name"}`` with the rank's descriptors
  attached (``SCM_RIGHTS``) in the order given by ``fd_names`` in :mod:`sparkdl._internal.task.spawn`;
* zygote -> task: ``{"pid": N}`` once forked (or ``{"error": "..."}``), later ``{"exit": N,
  "code": C}`` with ``C`` as ``subprocess.Popen.returncode`` gives it (negative: a signal).

Each rank keeps its own lifeline to its Spark task, so a rank never outlives its task, whatever
happens to the zygote or to the connection that asked for it. The zygote is a child subreaper:
what a rank started and left behind when it died comes to the zygote, which ends it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import hmac
import importlib
import json
import os
import secrets
import select
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from sparkdl._internal.common import proctree
from sparkdl._internal.common.net import peer_credentials
from sparkdl._internal.task.spawn import (
    MAX_HANDSHAKE_MESSAGE,
    MAX_MESSAGE,
    NONCE_BYTES,
    fd_names,
    proof,
)
from sparkdl._internal.wire.rankspec import fd_env

# How often the zygote checks that its executor lives where the kernel cannot tell it (no pidfd).
_POLL_S = 1.0
# A connection must finish the handshake this soon; at most this many may be at it at once.
_HANDSHAKE_S = 5.0
_MAX_PENDING = 16


def _preload() -> None:
    # What every rank imports; torch.distributed is the one that counts.
    for module in ("cloudpickle", "sparkdl", "sparkdl._internal.rank.main", "sparkdl._internal.backends", "torch.distributed"):
        with contextlib.suppress(ImportError):  # a rank that needs it reports the error itself
            importlib.import_module(module)


def _set_process_name(name: str) -> None:
    """The name ``ps`` and ``psutil.Process.name()`` show (Linux ``prctl(PR_SET_NAME)``)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _become_rank(request: dict[str, Any], fds: list[int], inherited: list[int]) -> None:
    """In the forked child: turn this copy of the zygote into the rank, then run it. Never returns.

    ``inherited`` are the zygote's own descriptors (listener, connections, wakeup pipe, pidfd):
    the rank closes them, so no task waits on a connection that a rank of another task holds.
    """
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # Whatever the zygote had not yet collected stays uncollected here: a finalizer of an old
        # object must not close a descriptor number that the rank reuses.
        gc.freeze()
        os.setsid()
        for fd in inherited:
            with contextlib.suppress(OSError):
                os.close(fd)
        named = dict(zip(fd_names, fds, strict=False))
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(named["stdout"], 1)
        os.dup2(named["stderr"], 2)
        os.close(named["stdout"])
        os.close(named["stderr"])
        keep = {named[k] for k in ("lifeline", "control", "metrics", "store") if k in named}
        for fd in keep:
            os.set_inheritable(fd, True)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update(fd_env({k: named[k] for k in ("lifeline", "control", "metrics", "store") if k in named}))
        sys.path[:] = request["sys_path"]
        sys.argv[:] = ["sparkdl._internal.rank", request["workdir"]]
        _set_process_name(request["name"])
        # A fresh interpreter would have drawn fresh seeds: so does each forked rank.
        import random

        random.seed()
        if "numpy.random" in sys.modules:
            sys.modules["numpy.random"].seed()
        from sparkdl._internal.rank.main import main as rank_main

        code = rank_main()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


@dataclass
class _Pending:
    """A connection still in its handshake."""

    conn: socket.socket
    since: float = field(default_factory=time.monotonic)
    nonce: bytes | None = None  # the zygote's, once the task said hello
    hello: bytes | None = None  # the task's
    proven: bool = False


class _Watch:
    """Tells when the process that the zygote's life is tied to has ended."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd: int | None = None
        with contextlib.suppress(AttributeError, OSError):
            self.fd = os.pidfd_open(pid)
        if self.fd is None and not self.alive():
            raise ProcessLookupError(pid)

    def alive(self) -> bool:
        if self.fd is not None:
            return not select.select([self.fd], [], [], 0)[0]
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def serve(listener: socket.socket, watch: _Watch, key: bytes) -> None:
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    clients: dict[int, socket.socket] = {}  # authenticated connections
    pending: dict[int, _Pending] = {}
    owners: dict[int, socket.socket | None] = {}  # rank pid -> the connection that asked for it
    while True:
        waits = [listener.fileno(), wakeup_r, *clients, *pending]
        if watch.fd is not None:
            waits.append(watch.fd)
        timeout = None if watch.fd is not None else _POLL_S
        if pending:
            first = min(p.since for p in pending.values()) + _HANDSHAKE_S - time.monotonic()
            timeout = max(0.0, first if timeout is None else min(timeout, first))
        ready, _, _ = select.select(waits, [], [], timeout)
        if wakeup_r in ready:
            os.read(wakeup_r, 4096)
        _reap(owners)
        if not watch.alive():
            return  # the executor is gone: nothing will ask for a rank again
        if listener.fileno() in ready:
            _accept(listener, pending)
        for fd in [fd for fd in ready if fd in pending]:
            if not _handshake_step(pending[fd], key):
                pending.pop(fd).conn.close()
            elif pending[fd].proven:
                clients[fd] = pending.pop(fd).conn  # proven: requests are served from now on
        now = time.monotonic()
        for fd in [fd for fd, p in pending.items() if now - p.since > _HANDSHAKE_S]:
            pending.pop(fd).conn.close()
        for fd in [fd for fd in ready if fd in clients]:
            conn = clients[fd]
            try:
                data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, len(fd_names))
            except OSError:
                data, fds = b"", []
            if not data:  # the task's Python worker closed its end or died
                del clients[fd]
                for pid, owner in owners.items():
                    if owner is conn:
                        owners[pid] = None
                conn.close()
                continue
            try:
                request = json.loads(data)
                inherited = [listener.fileno(), wakeup_r, wakeup_w, *clients, *pending]
                if watch.fd is not None:
                    inherited.append(watch.fd)
                pid = os.fork()
            except Exception as exc:
                for received in fds:
                    os.close(received)
                _send(conn, {"error": f"{type(exc).__name__}: {exc}"})
                continue
            if pid == 0:
                _become_rank(request, fds, inherited)
            for received in fds:
                os.close(received)
            owners[pid] = conn
            _send(conn, {"pid": pid})


def _accept(listener: socket.socket, pending: dict[int, _Pending]) -> None:
    try:
        conn, _ = listener.accept()
    except OSError:
        return
    if peer_credentials(conn)[1] != os.getuid():
        conn.close()  # forking a rank runs code as this user: only this user may ask
        return
    if len(pending) >= _MAX_PENDING:  # make room: the oldest has had the longest to prove itself
        oldest = min(pending, key=lambda fd: pending[fd].since)
        pending.pop(oldest).conn.close()
    pending[conn.fileno()] = _Pending(conn)


def _handshake_step(state: _Pending, key: bytes) -> bool:
    """Takes the next handshake message of a connection; False when it is to be closed."""
    try:
        data, fds, _, _ = socket.recv_fds(state.conn, MAX_HANDSHAKE_MESSAGE, 1)
    except OSError:
        return False
    for received in fds:  # descriptors before the handshake ends are never kept
        os.close(received)
    if not data or fds:
        return False
    try:
        message = json.loads(data)
        if state.nonce is None:
            hello = bytes.fromhex(message["hello"])
            if len(hello) != NONCE_BYTES:
                return False
            state.hello, state.nonce = hello, secrets.token_bytes(NONCE_BYTES)
            _send(state.conn, {"nonce": state.nonce.hex(), "proof": proof(key, b"zygote", hello, state.nonce).hex()})
            return True
        assert state.hello is not None
        if not hmac.compare_digest(bytes.fromhex(message["proof"]), proof(key, b"task", state.nonce, state.hello)):
            return False
    except (ValueError, KeyError, TypeError):
        return False
    state.proven = True
    return True


def _reap(owners: dict[int, socket.socket | None]) -> None:
    ended = False
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        owner = owners.pop(pid, None)
        ended = True
        if owner is not None:
            _send(owner, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
    if ended:
        # Orphans that a dead rank left come to the zygote (a subreaper): they end with it.
        proctree.kill_adopted(os.getpid(), keep=set(owners))


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the task is gone; it no longer waits for this
        conn.send(json.dumps(message).encode())


def main() -> int:
    address, watched = sys.argv[1], int(sys.argv[2])
    try:
        key = bytes.fromhex(sys.stdin.readline().strip())
    except ValueError:
        key = b""
    if len(key) != 32:
        return 4  # started by hand: without the executor's key it would serve no one
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind("\0" + address)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return 0  # another task started this executor's zygote first: it serves
        raise
    try:
        watch = _Watch(watched)
    except ProcessLookupError:
        return 3  # the executor is already gone
    listener.listen(64)
    proctree.set_subreaper()
    _set_process_name("sparkdl-zygote")
    # The address is taken before the imports: a task that connects meanwhile waits for its
    # first reply, not for a zygote of its own.
    _preload()
    serve(listener, watch, key)
    return 0


if __name__ == "__main__":
    sys.exit(main())
