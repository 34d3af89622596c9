"""The driver's side of the channel (:mod:`sparkdl._internal.wire.channel`): it accepts the tasks'
connections and hands each authenticated message to a handler.

A client's first frame authenticates its connection. Until then the server holds the connection
to tight limits, so that a flood of idle, trickling or oversized connections cannot keep genuine
tasks out: one deadline for the whole handshake, a first frame of at most
:data:`~sparkdl._internal.wire.channel.MAX_UNAUTHENTICATED_BYTES` (its length is checked before its payload
is read), and at most ``max_unauthenticated`` such connections at once. The accept loop outlives a
lack of descriptors or buffers (EMFILE, ENFILE, ENOBUFS): it backs off and tries again.
"""

from __future__ import annotations

import contextlib
import errno
import secrets
import socket
import threading
import time
from collections.abc import Callable

from sparkdl._internal.wire.channel import (
    HANDSHAKE,
    MAX_UNAUTHENTICATED_BYTES,
    NONCE_BYTES,
    RETRY,
    ChannelError,
    FramedConnection,
    Message,
)

# Connections allowed in the handshake at once. A genuine task is there for one round trip (it
# authenticates inside connect()), so even a large gang that connects at once holds few places.
MAX_UNAUTHENTICATED_CONNECTIONS = 128
LISTEN_BACKLOG = 4096
# accept() errors that concern one connection only (it was reset while queued): try again at once.
_ACCEPT_RETRY_AT_ONCE = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN})
_ACCEPT_BACKOFF_MIN_S = 0.01

Handler = Callable[[FramedConnection, Message], None]
CloseHandler = Callable[[FramedConnection, str | None], None]


class ChannelServer:
    """Accepts authenticated connections on one address and hands each message to ``on_message``.

    It binds to exactly the given host (loopback in local mode, the driver's own address on a
    cluster), never to every interface. Until a connection's first frame authenticates it has
    ``handshake_timeout_s`` in all, a first frame of at most :data:`MAX_UNAUTHENTICATED_BYTES`,
    and a place among at most ``max_unauthenticated`` such connections. Connections that fail
    authentication (or time out, or send too large a first frame) are dropped and counted in
    ``rejected``; those closed to make room for newer ones, in ``evicted``.
    """

    def __init__(
        self,
        host: str,
        secret: bytes,
        on_message: Handler,
        on_close: CloseHandler,
        handshake_timeout_s: float,
        *,
        max_unauthenticated: int = MAX_UNAUTHENTICATED_CONNECTIONS,
        accept_backoff_max_s: float = 0.5,
    ) -> None:
        if max_unauthenticated < 1:
            raise ValueError(f"max_unauthenticated must be at least 1, got {max_unauthenticated}")
        self._secret = secret
        self._on_message = on_message
        self._on_close = on_close
        self._handshake_timeout_s = handshake_timeout_s
        self._max_unauthenticated = max_unauthenticated
        self._backoff_max_s = max(accept_backoff_max_s, _ACCEPT_BACKOFF_MIN_S)
        # Every task of a gang connects within moments of the others: a queue shorter than the gang
        # drops connections the tasks take as made, and they wait for a nonce that never comes
        # (seen at 1,024 tasks with 128). The kernel caps it at net.core.somaxconn.
        self._listener = socket.create_server((host, 0), backlog=LISTEN_BACKLOG)
        # accept() polls so that close() never waits on a blocked accept.
        self._listener.settimeout(0.2)
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self._closed = threading.Event()
        self._lock = threading.Lock()
        # Connections in the handshake, oldest first (dicts keep insertion order).
        self._pending: dict[FramedConnection, None] = {}
        self._conns: set[FramedConnection] = set()
        self._threads: dict[FramedConnection, threading.Thread] = {}
        self.rejected = 0
        self.evicted = 0
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="sparkdl-channel-accept", daemon=True
        )

    def __enter__(self) -> ChannelServer:
        self._accept_thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        backoff = _ACCEPT_BACKOFF_MIN_S
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
                admitted = self._admit(sock, time.monotonic())
            except TimeoutError:
                continue
            except OSError as exc:
                if self._closed.is_set():
                    return
                if exc.errno in _ACCEPT_RETRY_AT_ONCE:
                    continue
                admitted = False
            if admitted:
                backoff = _ACCEPT_BACKOFF_MIN_S
            else:
                # Out of descriptors, buffers, memory or threads (EMFILE, ENFILE, ENOBUFS, ...):
                # the connection stays queued while some are freed. Wait, longer each time, never
                # spin; close() ends the wait at once.
                self._closed.wait(backoff)
                backoff = min(backoff * 2, self._backoff_max_s)

    def _admit(self, sock: socket.socket, accepted_at: float) -> bool:
        """Starts the handshake of a new connection; False when out of resources to serve it.

        Over the cap, the *oldest* connection in the handshake is closed, not the new one. A
        genuine task authenticates within a round trip of connecting, so the oldest is the one
        least likely to be genuine, and a new task is never turned away: a flood only shortens
        how long each connection may stay unauthenticated (to ``max_unauthenticated`` arrivals),
        which costs a flooder its connections and a genuine task nothing. Refusing the newest
        instead would let a flood that keeps the cap full lock every task out.
        """
        try:
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = FramedConnection(
                sock, self._secret, secrets.token_bytes(NONCE_BYTES), is_server=True
            )
        except OSError:  # reset while queued
            sock.close()
            return True
        thread = threading.Thread(
            target=self._serve, args=(conn, accepted_at), name="sparkdl-channel-conn", daemon=True
        )
        with self._lock:
            if self._closed.is_set():
                conn.close()
                return True
            self._pending[conn] = None
            self._threads[conn] = thread
            victims = []
            while len(self._pending) > self._max_unauthenticated:
                victim = next(iter(self._pending))
                del self._pending[victim]
                victims.append(victim)
            self.evicted += len(victims)
        for victim in victims:
            victim.stop_reading()  # its thread tells a genuine client to retry, then closes it
        try:
            thread.start()
        except RuntimeError:  # can't start new thread
            self._forget(conn)
            conn.close()
            return False
        return True

    def _forget(self, conn: FramedConnection) -> None:
        with self._lock:
            self._pending.pop(conn, None)
            self._conns.discard(conn)
            self._threads.pop(conn, None)

    def _handshake(self, conn: FramedConnection, accepted_at: float) -> Message | None:
        """The connection's first frame, authenticated under the handshake's limits, or None."""
        conn.send_nonce()
        deadline = accepted_at + self._handshake_timeout_s
        try:
            first = conn._read(deadline, MAX_UNAUTHENTICATED_BYTES)
        except TimeoutError as exc:
            raise ChannelError(
                f"no authenticated frame within handshake_timeout_s={self._handshake_timeout_s}"
            ) from exc
        except (ChannelError, OSError):
            if self._was_evicted(conn):
                return None
            raise
        if self._was_evicted(conn):
            return None
        if first is None:
            return None
        with self._lock:
            if conn not in self._pending:  # the server is closing
                return None
            del self._pending[conn]
            self._conns.add(conn)
        return first

    def _was_evicted(self, conn: FramedConnection) -> bool:
        """Whether ``conn`` was closed to make room; if so, a genuine client is told to retry."""
        with self._lock:
            evicted = conn not in self._pending and not self._closed.is_set()
        if evicted:
            with contextlib.suppress(OSError, ChannelError):
                conn.send(RETRY)
        return evicted

    def _serve(self, conn: FramedConnection, accepted_at: float) -> None:
        reason: str | None = None
        authenticated = False
        try:
            first = self._handshake(conn, accepted_at)
            if first is None:
                return
            authenticated = True
            if first == HANDSHAKE:
                conn.send(HANDSHAKE)  # the client's connect() waits for this
            else:
                self._on_message(conn, first)
            while (message := conn.recv()) is not None:
                self._on_message(conn, message)
        except ChannelError as exc:
            reason = str(exc)
            with self._lock:
                # An evicted connection that breaks off mid-frame was not rejected.
                if not authenticated and conn in self._pending:
                    self.rejected += 1
        except OSError as exc:
            reason = f"connection error: {exc}"
        finally:
            self._forget(conn)
            conn.close()
            if authenticated:
                self._on_close(conn, reason)

    def _stop_listening(self) -> None:
        """Takes no more connections, at once: shutting the listener down wakes the accept
        thread's ``accept()`` (on Linux), which would otherwise wait out its poll."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()

    def drain(self, timeout_s: float) -> int:
        """Stops taking connections, then waits up to ``timeout_s`` for the authenticated ones to be
        read to their end (a task closes its connection once it sent everything): what they sent
        is handled before :meth:`close` cuts them. Returns how many were still open."""
        self._stop_listening()
        with self._lock:
            threads = [self._threads[conn] for conn in self._conns if conn in self._threads]
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return sum(thread.is_alive() for thread in threads)

    def close(self) -> None:
        """Stops listening, closes every connection and joins the threads (bounded)."""
        self._stop_listening()
        if self._accept_thread.is_alive():
            self._accept_thread.join(timeout=5)
        with self._lock:
            conns = [*self._pending, *self._conns]
            threads = list(self._threads.values())
        for conn in conns:
            conn.abort()
        deadline = time.monotonic() + 5
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        for conn in conns:
            conn.close()
