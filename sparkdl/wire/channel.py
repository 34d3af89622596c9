"""Authenticated message channel between the driver and the Spark tasks of a run.

Wire format. On accept the server sends a fresh 16-byte nonce. After that each frame is::

    4-byte big-endian payload length | 32-byte HMAC-SHA256 tag | payload (UTF-8 JSON)

The tag covers a direction byte, the connection's nonce, a per-direction sequence number and the
payload, so a frame cannot be forged without the run's secret, replayed, reordered or reflected
back to its sender. Payloads are JSON, never pickle, and are parsed only after the tag checks out.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

NONCE_BYTES = 16
TAG_BYTES = 32
MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
_HEADER = struct.Struct(">I")

Message = dict[str, Any]


class ChannelError(Exception):
    """A channel broke, timed out, or received a frame that failed authentication."""


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            if buf:
                raise ChannelError("connection closed in the middle of a frame")
            return None
        buf += chunk
    return bytes(buf)


class FramedConnection:
    """One authenticated, bidirectional connection. ``send`` is thread-safe."""

    def __init__(self, sock: socket.socket, secret: bytes, nonce: bytes, *, is_server: bool) -> None:
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
        """The next message, or None when the peer closed the connection cleanly."""
        self._sock.settimeout(timeout)
        try:
            header = _recv_exact(self._sock, _HEADER.size + TAG_BYTES)
            if header is None:
                return None
            (length,) = _HEADER.unpack(header[: _HEADER.size])
            if length > MAX_PAYLOAD_BYTES:
                raise ChannelError(f"frame of {length} bytes exceeds {MAX_PAYLOAD_BYTES}")
            payload = _recv_exact(self._sock, length) if length else b""
        except TimeoutError as exc:
            raise ChannelError(f"no message within {timeout} s") from exc
        if payload is None:
            raise ChannelError("connection closed in the middle of a frame")
        expected = self._tag(self._recv_dir, self._recv_seq, payload)
        if not hmac.compare_digest(expected, header[_HEADER.size :]):
            raise ChannelError("frame failed authentication (wrong run secret?)")
        self._recv_seq += 1
        message = json.loads(payload)
        if not isinstance(message, dict):
            raise ChannelError("frame does not hold a JSON object")
        return message

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def connect(address: tuple[str, int], secret: bytes, timeout: float) -> FramedConnection:
    """Connects to a :class:`ChannelServer`; raises ChannelError when it cannot within ``timeout``."""
    try:
        sock = socket.create_connection(address, timeout=timeout)
    except OSError as exc:
        raise ChannelError(f"cannot connect to the sparkdl driver at {address[0]}:{address[1]}: {exc}") from exc
    try:
        sock.settimeout(timeout)
        nonce = _recv_exact(sock, NONCE_BYTES)
        if nonce is None:
            raise ChannelError("the driver closed the connection before the handshake")
    except (OSError, ChannelError):
        sock.close()
        raise
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return FramedConnection(sock, secret, nonce, is_server=False)


Handler = Callable[[FramedConnection, Message], None]
CloseHandler = Callable[[FramedConnection, str | None], None]


class ChannelServer:
    """Accepts authenticated connections on one address and hands each message to ``on_message``.

    It binds to exactly the given host (loopback in local mode, the driver's own address on a
    cluster), never to every interface. Connections that fail authentication are dropped and
    counted in ``rejected``.
    """

    def __init__(
        self,
        host: str,
        secret: bytes,
        on_message: Handler,
        on_close: CloseHandler,
        handshake_timeout_s: float,
    ) -> None:
        self._secret = secret
        self._on_message = on_message
        self._on_close = on_close
        self._handshake_timeout_s = handshake_timeout_s
        self._listener = socket.create_server((host, 0), backlog=128)
        # accept() polls so that close() never waits on a blocked accept.
        self._listener.settimeout(0.2)
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[FramedConnection] = set()
        self._threads: list[threading.Thread] = []
        self.rejected = 0
        self._accept_thread = threading.Thread(target=self._accept_loop, name="sparkdl-channel-accept", daemon=True)

    def __enter__(self) -> ChannelServer:
        self._accept_thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        import secrets

        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            sock.settimeout(None)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                nonce = secrets.token_bytes(NONCE_BYTES)
                sock.sendall(nonce)
                conn = FramedConnection(sock, self._secret, nonce, is_server=True)
            except OSError:
                sock.close()
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), name="sparkdl-channel-conn", daemon=True)
            with self._lock:
                if self._closed.is_set():
                    conn.close()
                    return
                self._conns.add(conn)
                self._threads.append(thread)
            thread.start()

    def _serve(self, conn: FramedConnection) -> None:
        reason: str | None = None
        first = True
        try:
            while True:
                # An unauthenticated peer gets a short time to prove itself, then is dropped.
                message = conn.recv(timeout=self._handshake_timeout_s if first else None)
                if message is None:
                    break
                first = False
                self._on_message(conn, message)
        except ChannelError as exc:
            reason = str(exc)
            if first:
                with self._lock:
                    self.rejected += 1
        except OSError as exc:
            reason = f"connection error: {exc}"
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            if not first:
                self._on_close(conn, reason)

    def close(self) -> None:
        """Stops listening, closes every connection and joins the threads (bounded)."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
            threads = list(self._threads)
        for conn in conns:
            conn.close()
        if self._accept_thread.is_alive():
            self._accept_thread.join(timeout=5)
        for thread in threads:
            thread.join(timeout=5)
