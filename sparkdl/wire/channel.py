"""Authenticated message channel between the driver and the Spark tasks of a run.

Wire format. On accept the server sends a fresh 16-byte nonce. After that each frame is::

    4-byte big-endian payload length | 32-byte HMAC-SHA256 tag | payload (UTF-8 JSON)

The tag covers a direction byte, the connection's nonce, a per-direction sequence number and the
payload, so a frame cannot be forged without the run's secret, replayed, reordered or reflected
back to its sender. Payloads are JSON, never pickle, and are parsed only after the tag checks out.

A client's first frame authenticates its connection; :func:`connect` sends a tiny one at once.
Until then the server holds the connection to tight limits, so that a flood of idle, trickling or
oversized connections cannot keep genuine tasks out: one deadline for the whole handshake, a first
frame of at most :data:`MAX_UNAUTHENTICATED_BYTES` (its length is checked before its payload is
read), and at most ``max_unauthenticated`` such connections at once. The accept loop outlives a
lack of descriptors or buffers (EMFILE, ENFILE, ENOBUFS): it backs off and tries again.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import math
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

NONCE_BYTES = 16
TAG_BYTES = 32
MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
# The first frame of a connection, read before it is authenticated. sparkdl's own first frame is
# the handshake (21 bytes); a client that starts with a task's Hello (a task's first message
# before the handshake frame existed: 355 bytes with a 253-character host and 64-bit ids) fits.
MAX_UNAUTHENTICATED_BYTES = 4 * 1024
# Connections allowed in the handshake at once. A genuine task is there for one round trip (it
# authenticates inside connect()), so even a large gang that connects at once holds few places.
MAX_UNAUTHENTICATED_CONNECTIONS = 128
_HEADER = struct.Struct(">I")
_HANDSHAKE: dict[str, Any] = {"channel": "sparkdl"}
# accept() errors that concern one connection only (it was reset while queued): try again at once.
_ACCEPT_RETRY_AT_ONCE = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN})
_ACCEPT_BACKOFF_MIN_S = 0.01

Message = dict[str, Any]


class ChannelError(Exception):
    """A channel broke, timed out, or received a frame that failed authentication."""


def _wait_readable(sock: socket.socket, deadline: float) -> None:
    """Blocks until ``sock`` has data (or EOF) or raises TimeoutError at ``deadline``.

    A socket timeout restarts with every piece, which a peer that trickles bytes never lets
    expire. poll, not select (it fails on descriptors past 1024) nor epoll (it needs a descriptor
    of its own, which a server out of descriptors lacks).
    """
    left = deadline - time.monotonic()
    if left > 0:
        fd = sock.fileno()
        if fd < 0:
            raise OSError(errno.EBADF, "the connection was closed")
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if poller.poll(math.ceil(left * 1000)):
            return
    raise TimeoutError


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes | None:
    """``n`` bytes, or None at a clean EOF before the first; ``deadline`` bounds them all."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            _wait_readable(sock, deadline)
        k = sock.recv_into(view[got:])
        if not k:
            if got:
                raise ChannelError("connection closed in the middle of a frame")
            return None
        got += k
    return bytes(buf)


class FramedConnection:
    """One authenticated, bidirectional connection. ``send`` is thread-safe."""

    def __init__(
        self, sock: socket.socket, secret: bytes, nonce: bytes, *, is_server: bool
    ) -> None:
        self._sock = sock
        self._secret = secret
        self._nonce = nonce
        self._send_dir = b"S" if is_server else b"C"
        self._recv_dir = b"C" if is_server else b"S"
        self._send_seq = 0
        self._recv_seq = 0
        self._send_lock = threading.Lock()
        self.peer = sock.getpeername()

    def _tag(self, direction: bytes, seq: int, payload: bytes) -> bytes:
        mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        mac.update(direction + self._nonce + seq.to_bytes(8, "big"))
        mac.update(payload)
        return mac.digest()

    def send(self, message: Message) -> None:
        payload = json.dumps(message, separators=(",", ":")).encode()
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise ChannelError(f"message of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
        with self._send_lock:
            tag = self._tag(self._send_dir, self._send_seq, payload)
            self._sock.sendall(_HEADER.pack(len(payload)) + tag + payload)
            self._send_seq += 1

    def recv(self, timeout: float | None = None) -> Message | None:
        """The next message, or None when the peer closed the connection cleanly.

        ``timeout`` bounds the whole message, not each piece of it.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        # Sends on this socket keep the caller's last timeout as their bound, as they always have.
        self._sock.settimeout(timeout)
        try:
            return self._read(deadline, MAX_PAYLOAD_BYTES)
        except TimeoutError as exc:
            raise ChannelError(f"no message within {timeout} s") from exc

    def readable(self, timeout: float) -> bool:
        """Whether a frame or EOF waits within ``timeout`` s (the socket's timeout untouched)."""
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)  # ValueError once closed
        return bool(poller.poll(math.ceil(timeout * 1000)))

    def _read(self, deadline: float | None, limit: int) -> Message | None:
        """One frame, authenticated then parsed; its length is checked before its payload is read."""
        header = _recv_exact(self._sock, _HEADER.size + TAG_BYTES, deadline)
        if header is None:
            return None
        (length,) = _HEADER.unpack(header[: _HEADER.size])
        if length > limit:
            raise ChannelError(f"frame of {length} bytes exceeds {limit}")
        payload = _recv_exact(self._sock, length, deadline) if length else b""
        if payload is None:
            raise ChannelError("connection closed in the middle of a frame")
        expected = self._tag(self._recv_dir, self._recv_seq, payload)
        if not hmac.compare_digest(expected, header[_HEADER.size :]):
            raise ChannelError("frame failed authentication (wrong run secret?)")
        self._recv_seq += 1
        try:
            message = json.loads(payload)
        except ValueError as exc:
            raise ChannelError(f"frame does not hold JSON: {exc}") from exc
        if not isinstance(message, dict):
            raise ChannelError("frame does not hold a JSON object")
        return message

    def send_nonce(self) -> None:
        """The server's side of the handshake: the nonce that every tag of this connection covers."""
        self._sock.sendall(self._nonce)

    def abort(self) -> None:
        """Ends the connection under a thread blocked reading it; that thread closes the socket."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.abort()
        self._sock.close()


def connect(address: tuple[str, int], secret: bytes, timeout: float) -> FramedConnection:
    """Connects to a :class:`ChannelServer` and authenticates; ChannelError if not in ``timeout``."""
    deadline = time.monotonic() + timeout
    where = f"the sparkdl driver at {address[0]}:{address[1]}"
    try:
        sock = socket.create_connection(address, timeout=timeout)
    except OSError as exc:
        raise ChannelError(f"cannot connect to {where}: {exc}") from exc
    try:
        sock.settimeout(None)
        nonce = _recv_exact(sock, NONCE_BYTES, deadline)
        if nonce is None:
            raise ChannelError(f"{where} closed the connection before the handshake")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = FramedConnection(sock, secret, nonce, is_server=False)
        # The driver drops a connection that is slow to authenticate; the caller's first message
        # may be seconds away (a task starts its rank first), so authenticate now.
        conn.send(_HANDSHAKE)
    except TimeoutError as exc:
        sock.close()
        raise ChannelError(f"{where} sent no handshake within {timeout} s") from exc
    except (OSError, ChannelError):
        sock.close()
        raise
    return conn


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
        self._listener = socket.create_server((host, 0), backlog=128)
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
            victim.abort()
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
        if first is None:
            return None
        with self._lock:
            if conn not in self._pending:  # evicted, or the server is closing
                return None
            del self._pending[conn]
            self._conns.add(conn)
        return first

    def _serve(self, conn: FramedConnection, accepted_at: float) -> None:
        reason: str | None = None
        authenticated = False
        try:
            first = self._handshake(conn, accepted_at)
            if first is None:
                return
            authenticated = True
            if first != _HANDSHAKE:
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

    def close(self) -> None:
        """Stops listening, closes every connection and joins the threads (bounded)."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
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
