"""Authenticated message channel between the driver and the Spark tasks of a run.

Wire format. On accept the server sends a fresh 16-byte nonce. After that each frame is::

    4-byte big-endian payload length | 32-byte HMAC-SHA256 tag | payload (UTF-8 JSON)

The tag covers a direction byte, the connection's nonce, a per-direction sequence number and the
payload, so a frame cannot be forged without the run's secret, replayed, reordered or reflected
back to its sender. Payloads are JSON, never pickle, and are parsed only after the tag checks out.

A client's first frame authenticates its connection; :func:`connect` sends a tiny one at once.
The driver's side, which accepts connections, is :mod:`sparkdl._internal.wire.server`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import math
import select
import socket
import struct
import threading
import time
from typing import Any

NONCE_BYTES = 16
TAG_BYTES = 32
MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
# The first frame of a connection, read before it is authenticated. sparkdl's own first frame is
# the handshake (21 bytes); a client that starts with a task's Hello (a task's first message
# before the handshake frame existed: 355 bytes with a 253-character host and 64-bit ids) fits.
MAX_UNAUTHENTICATED_BYTES = 4 * 1024
_HEADER = struct.Struct(">I")
# The first frame connect() sends, to authenticate its connection at once.
HANDSHAKE: dict[str, Any] = {"channel": "sparkdl"}
# The server's answer to a connection it closed to make room (ChannelServer's cap on connections
# in the handshake), before it read the client's handshake: authenticated, so that only a client
# holding the secret believes it, and retries.
RETRY: dict[str, Any] = {"channel": "sparkdl", "retry": True}

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

    def stop_reading(self) -> None:
        """Wakes the thread blocked reading the connection, which may still write (a last frame)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RD)

    def abort(self) -> None:
        """Ends the connection under a thread blocked reading it; that thread closes the socket."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.abort()
        self._sock.close()


def connect(address: tuple[str, int], secret: bytes, timeout: float) -> FramedConnection:
    """Connects to a :class:`~sparkdl._internal.wire.server.ChannelServer` and authenticates; ChannelError if not in ``timeout``.

    The server acknowledges the handshake. A server that closed this connection to make room
    (a flood of connections in the handshake) says so, and the client connects again, backing
    off, until ``timeout``; one that closes it without a word refused the secret."""
    deadline = time.monotonic() + timeout
    where = f"the sparkdl driver at {address[0]}:{address[1]}"
    backoff, tries = 0.05, 0
    while True:
        tries += 1
        conn = _connect_once(address, secret, deadline, where)
        try:
            answer = conn.recv(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError as exc:
            conn.close()
            raise ChannelError(f"{where} did not acknowledge the handshake within {timeout} s") from exc
        except (OSError, ChannelError) as exc:
            conn.close()
            raise ChannelError(f"{where} dropped the connection in the handshake ({exc})") from exc
        if answer == HANDSHAKE:
            return conn
        conn.close()
        if answer != RETRY:
            raise ChannelError(f"{where} closed the connection instead of acknowledging the handshake: it does "
                               "not hold this run's secret (another run's driver at the same address?)")
        if time.monotonic() + backoff >= deadline:
            raise ChannelError(f"{where} had no room for this connection in {tries} tries within {timeout} s "
                               "(a flood of connections that never authenticate?); raise RunConfig.connect_timeout_s")
        time.sleep(backoff)
        backoff = min(backoff * 2, 1.0)


def _connect_once(address: tuple[str, int], secret: bytes, deadline: float, where: str) -> FramedConnection:
    try:
        sock = socket.create_connection(address, timeout=max(0.001, deadline - time.monotonic()))
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
        conn.send(HANDSHAKE)
    except TimeoutError as exc:
        sock.close()
        raise ChannelError(f"{where} sent no handshake before the deadline") from exc
    except (OSError, ChannelError):
        sock.close()
        raise
    return conn
