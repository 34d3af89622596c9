"""A warm parent for rank processes, one per Spark executor: ``python -m sparkdl.task.zygote ADDRESS PID``.

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
and serves only connections from its own user. A second zygote started for the same address
finds it taken and exits at once, so two tasks that race to start one share the winner.

Protocol, one JSON message per packet, on each connection:

* task -> zygote: ``{"workdir", "env", "cwd", "sys_path", "name"}`` with the rank's descriptors
  attached (``SCM_RIGHTS``) in the order given by ``fd_names`` in :mod:`sparkdl.task.spawn`;
* zygote -> task: ``{"pid": N}`` once forked (or ``{"error": "..."}``), later ``{"exit": N,
  "code": C}`` with ``C`` as ``subprocess.Popen.returncode`` gives it (negative: a signal).

Each rank keeps its own lifeline to its Spark task, so a rank never outlives its task, whatever
happens to the zygote or to the connection that asked for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
from typing import Any

from sparkdl.rankspec import fd_env
from sparkdl.task.spawn import MAX_MESSAGE, fd_names

# How often the zygote checks that its executor lives where the kernel cannot tell it (no pidfd).
_POLL_S = 1.0


def _preload() -> None:
    # What every rank imports; torch.distributed is the one that counts.
    for module in ("cloudpickle", "sparkdl", "sparkdl.rank.main", "sparkdl.backends", "torch.distributed"):
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
        sys.argv[:] = ["sparkdl.rank", request["workdir"]]
        _set_process_name(request["name"])
        # A fresh interpreter would have drawn fresh seeds: so does each forked rank.
        import random

        random.seed()
        if "numpy.random" in sys.modules:
            sys.modules["numpy.random"].seed()
        from sparkdl.rank.main import main as rank_main

        code = rank_main()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


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


def serve(listener: socket.socket, watch: _Watch) -> None:
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    clients: dict[int, socket.socket] = {}
    owners: dict[int, socket.socket | None] = {}  # rank pid -> the connection that asked for it
    timeout = None if watch.fd is not None else _POLL_S
    while True:
        waits = [listener.fileno(), wakeup_r, *clients]
        if watch.fd is not None:
            waits.append(watch.fd)
        ready, _, _ = select.select(waits, [], [], timeout)
        if wakeup_r in ready:
            os.read(wakeup_r, 4096)
        _reap(owners)
        if not watch.alive():
            return  # the executor is gone: nothing will ask for a rank again
        if listener.fileno() in ready:
            _accept(listener, clients)
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
                inherited = [listener.fileno(), wakeup_r, wakeup_w, *clients]
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


def _accept(listener: socket.socket, clients: dict[int, socket.socket]) -> None:
    try:
        conn, _ = listener.accept()
    except OSError:
        return
    if _peer_uid(conn) != os.getuid():
        conn.close()  # forking a rank runs code as this user: only this user may ask
        return
    clients[conn.fileno()] = conn


def _reap(owners: dict[int, socket.socket | None]) -> None:
    while owners:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        owner = owners.pop(pid, None)
        if owner is not None:
            _send(owner, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the task is gone; it no longer waits for this
        conn.send(json.dumps(message).encode())


def main() -> int:
    address, watched = sys.argv[1], int(sys.argv[2])
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
    _set_process_name("sparkdl-zygote")
    # The address is taken before the imports: a task that connects meanwhile waits for its
    # first reply, not for a zygote of its own.
    _preload()
    serve(listener, watch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
