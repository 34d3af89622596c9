"""A machine for a Spark Connect client that the executors cannot reach (a laptop, a notebook service).

    with IsolatedClient(server_port) as box:            # tests/e2e/test_connect_relay.py
        subprocess.run([*box.enter(), python, "client.py", box.url])

The client runs in a network namespace of its own that has only a loopback: whatever it listens
on (sparkdl's channel, on its route to the server: 127.0.0.1 there) no process outside reaches.
Its one way out is a TCP forwarder, listening on the namespace's 127.0.0.1 and connecting, from
the machine's own namespace, to the Connect server on the machine's 127.0.0.1: the gRPC traffic
goes client -> server only, as through a NAT. No address but the two loopbacks is used. stop()
ends the forwarder and removes the namespace (and its processes); a namespace left by a test that
was killed (its owner pid gone) is removed by the next start().
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path
from types import TracebackType

PREFIX = "sdlc-"
_CLONE_NEWNET = 0x40000000


def available() -> str | None:
    """Why no isolated client can run here (a reason for pytest.skip), or None."""
    if os.geteuid() != 0:
        return "a network namespace for the client needs root (the test runs as a user)"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    return None


def _ip(*argv: str, check: bool = True) -> None:
    subprocess.run(["ip", *argv], check=check, capture_output=True, timeout=30)


def _setns(path: str) -> None:
    """Moves this thread into the network namespace at ``path``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({path})")
    finally:
        os.close(fd)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


class IsolatedClient:
    def __init__(self, server_port: int, server_host: str = "127.0.0.1") -> None:
        self.server = (server_host, server_port)
        self.name = f"{PREFIX}{os.getpid()}-{id(self) % 10000}"
        self.port = 0
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    def enter(self) -> list[str]:
        """The argv prefix that runs a command in the client's namespace."""
        return ["ip", "netns", "exec", self.name]

    def start(self) -> IsolatedClient:
        if reason := available():
            raise RuntimeError(reason)
        sweep_stale()
        _ip("netns", "add", self.name)
        try:
            _ip("-n", self.name, "link", "set", "lo", "up")
            self._listener = self._listen_inside()
            self.port = self._listener.getsockname()[1]
            threading.Thread(target=self._accept, name="isolated-client-forwarder", daemon=True).start()
        except BaseException:
            self.stop()
            raise
        return self

    def _listen_inside(self) -> socket.socket:
        # A socket keeps the namespace it was made in: made by a thread that moved there.
        out: list[socket.socket | BaseException] = []

        def make() -> None:
            try:
                _setns(f"/run/netns/{self.name}")
                out.append(socket.create_server(("127.0.0.1", 0)))
            except BaseException as exc:  # handed to the caller
                out.append(exc)

        thread = threading.Thread(target=make)
        thread.start()
        thread.join()
        if isinstance(out[0], BaseException):
            raise out[0]
        listener = out[0]
        listener.settimeout(0.2)
        return listener

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                inner, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                outer = socket.create_connection(self.server, timeout=10)
            except OSError:
                inner.close()
                continue
            inner.settimeout(None)
            outer.settimeout(None)
            self._socks += [inner, outer]
            for src, dst in ((inner, outer), (outer, inner)):
                threading.Thread(target=_pump, args=(src, dst), daemon=True).start()

    def stop(self) -> None:
        self._closed.set()
        for sock in [*self._socks, *([self._listener] if self._listener else [])]:
            with contextlib.suppress(OSError):
                sock.close()
        _kill_inside(self.name)
        _ip("netns", "del", self.name, check=False)

    def __enter__(self) -> IsolatedClient:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _kill_inside(name: str) -> None:
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30)
    for pid in out.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), 9)


def sweep_stale() -> None:
    """Removes the namespaces of isolated clients whose test process is gone."""
    root = Path("/run/netns")
    for path in root.glob(f"{PREFIX}*") if root.is_dir() else []:
        owner = path.name[len(PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            _kill_inside(path.name)
            _ip("netns", "del", path.name, check=False)
