"""A warm parent for rank processes: ``python -m sparkdl._zygote FD``.

Importing torch is the longest step of a launch on a warm executor (1.5 to 2.5 s, longer than
Spark's own scheduling). A Spark Python worker starts one zygote the first time it runs a rank;
the zygote imports torch once and then forks each later rank of that worker, so a rank starts
with torch already loaded. The zygote runs nothing but imports and forks: no torch operation, no
CUDA, no thread pool, no second thread, which is what makes forking it safe.

Protocol, over the ``SOCK_SEQPACKET`` Unix socket FD (one message per packet, JSON):

* task -> zygote: ``{"workdir", "env", "cwd", "sys_path", "name"}`` with the rank's descriptors
  attached (``SCM_RIGHTS``) in the order given by ``fd_names`` below;
* zygote -> task: ``{"pid": N}`` once forked (or ``{"error": "..."}``), later ``{"exit": N,
  "code": C}`` with ``C`` as ``subprocess.Popen.returncode`` gives it (negative: a signal).

The zygote ends when its Python worker closes the socket or dies. Each rank keeps its own
lifeline to its Spark task, so a rank never outlives its task, whatever happens to the zygote.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
from typing import Any

from sparkdl._spawn import MAX_MESSAGE, fd_names


def _preload() -> None:
    # What every rank imports; torch.distributed is the one that counts.
    for module in ("cloudpickle", "sparkdl", "sparkdl._rank", "sparkdl.backends", "torch.distributed"):
        with contextlib.suppress(ImportError):  # a rank that needs it reports the error itself
            importlib.import_module(module)


def _set_process_name(name: str) -> None:
    """The name ``ps`` and ``psutil.Process.name()`` show (Linux ``prctl(PR_SET_NAME)``)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _become_rank(request: dict[str, Any], fds: list[int], sock: socket.socket, wakeup: tuple[int, int]) -> None:
    """In the forked child: turn this copy of the zygote into the rank, then run it. Never returns."""
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
        sock.close()
        for fd in wakeup:
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
        env = os.environ
        env["SPARKDL_LIFELINE_FD"] = str(named["lifeline"])
        env["SPARKDL_CONTROL_FD"] = str(named["control"])
        env["SPARKDL_METRICS_FD"] = str(named["metrics"])
        if "store" in named:
            env["SPARKDL_STORE_FD"] = str(named["store"])
        sys.path[:] = request["sys_path"]
        sys.argv[:] = ["sparkdl._rank", request["workdir"]]
        _set_process_name(request["name"])
        # A fresh interpreter would have drawn fresh seeds: so does each forked rank.
        import random

        random.seed()
        if "numpy.random" in sys.modules:
            sys.modules["numpy.random"].seed()
        from sparkdl import _rank

        code = _rank.main()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve(sock: socket.socket) -> None:
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([sock.fileno(), wakeup_r], [], [])
        if wakeup_r in ready:
            os.read(wakeup_r, 4096)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if sock.fileno() not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, len(fd_names))
        except OSError:
            return
        if not data:
            return  # the Python worker closed its end or died
        try:
            request = json.loads(data)
            pid = os.fork()
        except Exception as exc:
            for fd in fds:
                os.close(fd)
            _send(sock, {"error": f"{type(exc).__name__}: {exc}"})
            continue
        if pid == 0:
            _become_rank(request, fds, sock, (wakeup_r, wakeup_w))
        for fd in fds:
            os.close(fd)
        children.add(pid)
        _send(sock, {"pid": pid})


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the task is gone; its next spawn finds the socket closed
        sock.send(json.dumps(message).encode())


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    _set_process_name("sparkdl-zygote")
    _preload()
    _send(sock, {"ready": os.getpid()})
    serve(sock)


if __name__ == "__main__":
    main()
