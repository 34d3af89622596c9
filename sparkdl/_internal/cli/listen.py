"""A listener that the doctor's probe tasks connect to: whether the executors reach the address
at which ``sparkdl.run``'s channel to the driver (or to the Spark Connect client) listens.

It binds where the channel would (:meth:`sparkdl._internal.spark.spark_api.SparkApi.channel_host`), at a free
port, accepts each connection and closes it at once: nothing is read from a peer, so nothing
needs authenticating.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType


class Listener:
    """``with Listener(host) as where:`` a TCP listener on ``host`` at a free port; ``where`` is
    ``(host, port)``; :attr:`accepted` counts the connections it took."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.accepted = 0
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> tuple[str, int]:
        family = socket.getaddrinfo(self.host, 0, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((self.host, 0))
            sock.listen(64)
            sock.settimeout(0.2)  # the accept loop checks for the end this often
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._thread = threading.Thread(target=self._accept, args=(sock,), name="sparkdl-doctor-listener", daemon=True)
        self._thread.start()
        return self.host, int(sock.getsockname()[1])

    def _accept(self, sock: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:  # closed under us
                return
            conn.close()
            self.accepted += 1

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
