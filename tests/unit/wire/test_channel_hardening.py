"""The driver's channel under attack: real rogue clients on 127.0.0.1 against a real server.

Each test starts a :class:`ChannelServer` with short limits, sends what a hostile local user
could (a trickle, an oversized first frame, a flood of idle connections; a server out of file
descriptors), and shows that a genuine client still gets through and that its messages flow both
ways. Every wait is bounded; every socket, thread and process a test starts is ended by it.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import REPO

from sparkdl._internal.wire.channel import (
    HANDSHAKE,
    MAX_PAYLOAD_BYTES,
    MAX_UNAUTHENTICATED_BYTES,
    NONCE_BYTES,
    RETRY,
    TAG_BYTES,
    ChannelError,
    FramedConnection,
    connect,
)
from sparkdl._internal.wire.messages import Hello, encode
from sparkdl._internal.wire.server import ChannelServer

SECRET = b"hardening-secret" * 2


class _Echo:
    """A server that echoes every message and records what it received and who closed."""

    def __init__(self, **limits: Any) -> None:
        self.received: list[dict[str, Any]] = []
        self.closed: list[str | None] = []
        self.server = ChannelServer("127.0.0.1", SECRET, self._on_message, self._on_close, **limits)

    def _on_message(self, conn: FramedConnection, msg: dict[str, Any]) -> None:
        self.received.append(msg)
        conn.send({"echo": msg})

    def _on_close(self, conn: FramedConnection, reason: str | None) -> None:
        self.closed.append(reason)


def _channel_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("sparkdl-channel")]


def _wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.02)


@pytest.fixture
def echo() -> Iterator[Callable[..., _Echo]]:
    """Starts echo servers; closes them, and checks that none of their threads outlives them."""
    started: list[_Echo] = []

    def start(**limits: Any) -> _Echo:
        e = _Echo(**limits)
        e.server.__enter__()
        started.append(e)
        return e

    yield start
    for e in started:
        e.server.close()
    _wait_for(lambda: not _channel_threads(), "the channel's threads end with the server")


@pytest.fixture
def rogues() -> Iterator[Callable[[tuple[str, int]], socket.socket]]:
    """Raw TCP clients that follow no protocol; all closed at the end of the test."""
    socks: list[socket.socket] = []

    def open_one(address: tuple[str, int]) -> socket.socket:
        sock = socket.create_connection(address, timeout=5)
        socks.append(sock)
        return sock

    yield open_one
    for sock in socks:
        sock.close()


def _round_trip(address: tuple[str, int], n: int = 3) -> None:
    conn = connect(address, SECRET, timeout=5)
    try:
        for i in range(n):
            conn.send({"i": i})
            assert conn.recv(timeout=5) == {"echo": {"i": i}}
    finally:
        conn.close()


def _seconds_until_closed(sock: socket.socket, timeout_s: float) -> float:
    """How long until the server closes ``sock`` (EOF or reset); fails after ``timeout_s``."""
    start = time.monotonic()
    sock.settimeout(timeout_s)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {timeout_s} s")
    return time.monotonic() - start


@pytest.mark.parametrize("phase", ["header", "payload"])
def test_a_trickling_client_is_dropped_at_the_deadline_while_a_genuine_one_gets_in(
    echo: Callable[..., _Echo], rogues: Callable[..., socket.socket], phase: str
) -> None:
    e = echo(handshake_timeout_s=1.0)
    rogue = rogues(e.server.address)
    connected = time.monotonic()
    assert len(rogue.recv(NONCE_BYTES)) == NONCE_BYTES
    # A byte every 0.1 s: each read gets something long before any per-read timeout would fire.
    if phase == "payload":  # a whole, small header first, then the payload byte by byte
        rogue.sendall(struct.pack(">I", 100) + bytes(TAG_BYTES))
    sent, closed_after = 0, None
    genuine_done = False
    rogue.settimeout(0.1)
    while closed_after is None and time.monotonic() - connected < 5:
        try:
            if rogue.recv(1) == b"":
                closed_after = time.monotonic() - connected
        except ConnectionResetError:
            closed_after = time.monotonic() - connected
        except TimeoutError:
            rogue.sendall(b"\x00")
            sent += 1
        if not genuine_done and time.monotonic() - connected > 0.3:
            _round_trip(e.server.address)  # connects while the trickle goes on
            genuine_done = True
    assert genuine_done
    assert closed_after is not None, "the trickling client was never dropped"
    assert 0.9 <= closed_after < 3.0, closed_after
    assert sent >= 5  # it did trickle, and each byte reset no clock
    _wait_for(lambda: e.server.rejected == 1, "the trickler counted as rejected")
    assert e.received == [{"i": 0}, {"i": 1}, {"i": 2}]


@pytest.mark.parametrize("length", [MAX_UNAUTHENTICATED_BYTES + 1, MAX_PAYLOAD_BYTES, 2**32 - 1])
def test_an_oversized_unauthenticated_frame_is_refused_on_its_header_alone(
    echo: Callable[..., _Echo], rogues: Callable[..., socket.socket], length: int
) -> None:
    # A long deadline: a server that waited for the payload would hold the connection for 30 s.
    e = echo(handshake_timeout_s=30.0)
    rogue = rogues(e.server.address)
    assert len(rogue.recv(NONCE_BYTES)) == NONCE_BYTES
    rogue.sendall(struct.pack(">I", length) + bytes(TAG_BYTES))  # the header and nothing more
    assert _seconds_until_closed(rogue, timeout_s=5) < 2.0
    _wait_for(lambda: e.server.rejected == 1, "the oversized frame counted as rejected")
    # Nothing it sends afterwards is read: the connection is gone, whatever it writes.
    with pytest.raises(OSError):
        for _ in range(64):
            rogue.sendall(bytes(64 * 1024))
            time.sleep(0.005)
    _round_trip(e.server.address)


def test_the_largest_first_message_a_task_sends_fits_the_unauthenticated_cap(
    echo: Callable[..., _Echo], rogues: Callable[..., socket.socket]
) -> None:
    # A task's Hello at its largest: a 253-character host name (DNS's limit) and 64-bit ids.
    hello = encode(Hello("h" * 253, 2**63 - 1, 2**63 - 1), rank=2**31 - 1, attempt=-1)
    size = len(json.dumps(hello, separators=(",", ":")).encode())
    assert size * 4 < MAX_UNAUTHENTICATED_BYTES, size
    # Sent as the very first frame (no handshake frame before it), it is accepted and delivered.
    e = echo(handshake_timeout_s=5.0)
    raw = rogues(e.server.address)
    nonce = raw.recv(NONCE_BYTES)
    raw.settimeout(None)
    conn = FramedConnection(raw, SECRET, nonce, is_server=False)
    conn.send(hello)
    assert conn.recv(timeout=5) == {"echo": hello}
    # After authentication the usual cap holds: a 1 MiB message goes through.
    big = {"blob": "x" * (1 << 20)}
    conn.send(big)
    assert conn.recv(timeout=5) == {"echo": big}
    assert e.received == [hello, big]


def test_a_flood_of_idle_connections_above_the_cap_does_not_keep_a_genuine_client_out(
    echo: Callable[..., _Echo], rogues: Callable[..., socket.socket]
) -> None:
    cap, flood = 8, 40
    # The deadline is far away: only the cap can make room for the genuine client.
    e = echo(handshake_timeout_s=30.0, max_unauthenticated=cap)
    idle = [rogues(e.server.address) for _ in range(flood)]
    _wait_for(lambda: e.server.evicted >= flood - cap, "the oldest idle connections were closed")
    # The threads of the closed ones end: left are the handshakes in progress and the accept loop.
    _wait_for(lambda: len(_channel_threads()) <= cap + 1, "one thread per held connection")
    started = time.monotonic()
    _round_trip(e.server.address)
    assert time.monotonic() - started < 2.0
    # The flood's newest connections are still held; its oldest were closed.
    assert _seconds_until_closed(idle[0], timeout_s=2) < 2.0
    assert e.server.rejected == 0 and e.received == [{"i": 0}, {"i": 1}, {"i": 2}]


def test_a_genuine_client_gets_in_while_a_flood_keeps_coming(
    echo: Callable[..., _Echo],
) -> None:
    e = echo(handshake_timeout_s=30.0, max_unauthenticated=16)
    stop = threading.Event()
    opened = [0]

    def flood() -> None:
        held: list[socket.socket] = []
        try:
            while not stop.is_set():
                held.append(socket.create_connection(e.server.address, timeout=5))
                opened[0] += 1
                if len(held) > 64:  # the flooder's own descriptors stay bounded
                    held.pop(0).close()
                time.sleep(0.005)
        finally:
            for sock in held:
                sock.close()

    flooder = threading.Thread(target=flood, name="test-flooder", daemon=True)
    flooder.start()
    try:
        _wait_for(lambda: e.server.evicted > 16, "the flood filled the cap")
        for _ in range(3):
            _round_trip(e.server.address, n=2)
    finally:
        stop.set()
        flooder.join(timeout=5)
    assert not flooder.is_alive()
    assert opened[0] > 16 + 3
    assert e.received == [{"i": 0}, {"i": 1}] * 3


def test_a_genuine_clients_messages_flow_both_ways_and_the_handshake_stays_internal(
    echo: Callable[..., _Echo],
) -> None:
    e = echo(handshake_timeout_s=0.5)
    conn = connect(e.server.address, SECRET, timeout=5)
    try:
        # Longer than the handshake deadline before the first real message: the connection
        # authenticated itself in connect(), as a task that takes seconds to start its rank does.
        time.sleep(0.8)
        messages = [{"t": "hello", "n": 1}, {"unicode": "é ✓"}, {"blob": "y" * 300_000}]
        for msg in messages:
            conn.send(msg)
        assert [conn.recv(timeout=5) for _ in messages] == [{"echo": m} for m in messages]
    finally:
        conn.close()
    _wait_for(lambda: e.closed == [None], "the server saw a clean close")
    assert e.received == messages  # the handshake frame is not a message
    assert e.server.rejected == 0 and e.server.evicted == 0


def test_a_client_with_the_wrong_secret_is_rejected_and_never_heard(
    echo: Callable[..., _Echo],
) -> None:
    e = echo(handshake_timeout_s=5.0)
    started = time.monotonic()
    with pytest.raises(ChannelError, match="does not hold this run's secret"):
        connect(e.server.address, b"not the run secret" * 2, timeout=5)
    assert time.monotonic() - started < 2, "a refused secret is not retried"
    _wait_for(lambda: e.server.rejected == 1, "the impostor counted as rejected")
    assert e.received == [] and e.closed == []


def test_a_connection_closed_to_make_room_is_told_to_retry_and_only_its_holder_can_believe_it(
    echo: Callable[..., _Echo], rogues: Callable[..., socket.socket]
) -> None:
    e = echo(handshake_timeout_s=30.0, max_unauthenticated=1)
    genuine = rogues(e.server.address)
    nonce = genuine.recv(NONCE_BYTES)  # the server now waits for this connection's handshake
    _wait_for(lambda: len(e.server._pending) == 1, "the connection waits in the handshake")
    rogues(e.server.address)  # one more over the cap: the oldest, the genuine one, makes room
    _wait_for(lambda: e.server.evicted == 1, "the oldest connection was closed")
    genuine.settimeout(None)
    told = FramedConnection(genuine, SECRET, nonce, is_server=False).recv(timeout=5)
    assert told == RETRY  # authenticated with the run's secret: a flooder cannot forge or use it
    assert e.server.rejected == 0  # made room for, not refused


class _EvictingOnce:
    """A scripted server on a real socket: closes its first connection to make room (telling the
    client to retry, as ChannelServer does), and acknowledges the next one's handshake."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.accepted = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        for _ in range(2):
            sock, _ = self.listener.accept()
            self.accepted += 1
            conn = FramedConnection(sock, SECRET, os.urandom(NONCE_BYTES), is_server=True)
            conn.send_nonce()
            assert conn.recv(timeout=5) == HANDSHAKE
            conn.send(RETRY if self.accepted == 1 else HANDSHAKE)
            if self.accepted == 1:
                conn.close()
            else:
                self.last = conn


def test_a_client_told_to_retry_connects_again_within_its_timeout() -> None:
    server = _EvictingOnce()
    try:
        conn = connect(server.address, SECRET, timeout=5)
        server.thread.join(5)
        assert server.accepted == 2
        conn.send({"after": "retry"})
        assert server.last.recv(timeout=5) == {"after": "retry"}
        conn.close()
        server.last.close()
    finally:
        server.listener.close()


_SERVER_OUT_OF_FDS = textwrap.dedent(
    """
    import errno, json, os, resource, sys, time
    from sparkdl._internal.wire.server import ChannelServer

    def on_message(conn, msg):
        conn.send({"echo": msg})

    def exhaust():
        hogs = []
        try:
            while True:
                hogs.append(os.open(os.devnull, os.O_RDONLY))
        except OSError as exc:
            assert exc.errno == errno.EMFILE, exc
        return hogs

    def release(hogs):
        for fd in hogs:
            os.close(fd)

    def say(**kv):
        print(json.dumps(kv), flush=True)

    server = ChannelServer("127.0.0.1", SECRET, on_message, lambda c, r: None,
                           handshake_timeout_s=5.0, accept_backoff_max_s=0.2)
    server.__enter__()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 24, hard))
    say(port=server.address[1])
    hogs = exhaust()
    cpu = time.process_time()
    say(exhausted=True)
    sys.stdin.readline()  # the parent has connected, and waited a while
    cpu = time.process_time() - cpu
    release(hogs)
    say(released=True, cpu_s=cpu)
    sys.stdin.readline()  # the parent's clients are done
    hogs = exhaust()
    time.sleep(0.3)  # well into the accept loop's back-off
    started = time.monotonic()
    server.close()
    close_s = time.monotonic() - started
    release(hogs)
    say(close_s=close_s)
    """
)


def test_the_accept_loop_survives_running_out_of_file_descriptors() -> None:
    script = f"SECRET = {SECRET!r}\n" + _SERVER_OUT_OF_FDS
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    assert proc.stdin is not None and proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True)
    reader.start()
    queued: socket.socket | None = None

    def said(timeout_s: float = 20.0) -> dict[str, Any]:
        try:
            return dict(json.loads(lines.get(timeout=timeout_s)))
        except queue.Empty:
            pytest.fail(f"the server process said nothing for {timeout_s} s")

    def tell() -> None:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()

    try:
        address = ("127.0.0.1", int(said()["port"]))
        assert said() == {"exhausted": True}
        # The kernel completes the connection; the server cannot accept it (EMFILE) and waits.
        queued = socket.create_connection(address, timeout=5)
        queued.settimeout(1.0)
        with pytest.raises(TimeoutError):
            queued.recv(NONCE_BYTES)  # no nonce: not accepted while out of descriptors
        tell()
        released = said()
        assert released["released"] is True
        assert released["cpu_s"] < 0.5, f"the accept loop spun: {released['cpu_s']:.2f} s of CPU"
        # The connection queued during the shortage is served, and so is a new one.
        queued.settimeout(5)
        nonce = queued.recv(NONCE_BYTES)
        assert len(nonce) == NONCE_BYTES
        conn = FramedConnection(queued, SECRET, nonce, is_server=False)
        conn.send({"queued": True})
        assert conn.recv(timeout=5) == {"echo": {"queued": True}}
        _round_trip(address)
        tell()
        assert said()["close_s"] < 1.5  # close() ends the back-off at once
        assert proc.wait(timeout=10) == 0
    finally:
        if queued is not None:
            queued.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdin.close()
        reader.join(timeout=5)
        proc.stdout.close()


ROGUE_TENANT = """
import json, socket, struct, sys, threading, time
host, port = sys.argv[1], int(sys.argv[2])
report = []

def trickle():
    s = socket.create_connection((host, port), 5)
    s.settimeout(0.3)
    got, started = b"", time.monotonic()
    try:
        while time.monotonic() - started < 20:
            try:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
            except socket.timeout:
                pass
            s.send(b"\\0")  # one byte of a header, now and then
    except OSError:
        pass
    report.append({"kind": "trickle", "received": len(got), "open_s": round(time.monotonic() - started, 1)})

def oversized():
    s = socket.create_connection((host, port), 5)
    s.settimeout(20)
    got, started = b"", time.monotonic()
    try:
        s.sendall(struct.pack(">I", 1 << 20) + b"t" * 32 + b"x" * 65536)
        while chunk := s.recv(4096):
            got += chunk
    except OSError:
        pass
    report.append({"kind": "oversized", "received": len(got), "open_s": round(time.monotonic() - started, 1)})

threads = [threading.Thread(target=trickle) for _ in range(3)] + [threading.Thread(target=oversized)]
for t in threads:
    t.start()
for t in threads:
    t.join(30)
print(json.dumps(report), flush=True)
"""


def test_another_user_with_slow_and_oversized_frames_gets_only_a_nonce(
    echo: Callable[..., _Echo], other_user: Any
) -> None:
    e = echo(handshake_timeout_s=2.0)
    script = other_user.shared_dir() / "rogue.py"
    script.write_text(ROGUE_TENANT)
    script.chmod(0o644)
    rogue = other_user.popen([other_user.python, str(script), *map(str, e.server.address)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        time.sleep(0.5)
        _round_trip(e.server.address)  # a genuine task gets in while the attack goes on
        out, err = rogue.communicate(timeout=60)
    finally:
        if rogue.poll() is None:
            rogue.kill()
            rogue.wait()
    report = json.loads(out)
    assert len(report) == 4, err
    for conn in report:
        # Each rogue connection got the server's nonce and nothing more, and was closed at the
        # handshake deadline (2 s) or at once for the oversized frame, not left open.
        assert conn["received"] == NONCE_BYTES and conn["open_s"] < 10, report
    assert e.received == [{"i": i} for i in range(3)]
