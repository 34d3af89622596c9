"""Launcher pieces that need no JVM: config, channel authentication, the report, the policy."""

from __future__ import annotations

import json
import pickle
import socket
import struct
import threading
import time

import pytest

import sparkdl
from sparkdl._internal.common.errors import InsufficientSlotsError, RunFailedError, RunTimeoutError
from sparkdl._internal.driver.policy import decide
from sparkdl._internal.driver.report import RankRecord, build_report, root_cause
from sparkdl._internal.wire.channel import ChannelError, connect
from sparkdl._internal.wire.server import ChannelServer


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_attempts", 0),
        ("max_attempts", 1.5),
        ("timeout_s", -1),
        ("timeout_s", float("nan")),
        ("start_timeout_s", 0),
        ("collective_timeout_s", "5"),
        ("log_tail_lines", -1),
    ],
)
def test_config_rejects_bad_values_and_names_the_field(field: str, value: object) -> None:
    with pytest.raises(sparkdl.ConfigError, match=field):
        sparkdl.RunConfig(**{field: value})  # type: ignore[arg-type]


def test_config_is_frozen() -> None:
    cfg = sparkdl.RunConfig(timeout_s=5)
    with pytest.raises(AttributeError):
        cfg.timeout_s = 6  # type: ignore[misc]


@pytest.mark.parametrize("failed_attempt,max_attempts,expected", [(0, 1, "stop"), (0, 2, "rerun"), (1, 2, "stop"), (2, 4, "rerun")])
def test_retry_policy(failed_attempt: int, max_attempts: int, expected: str) -> None:
    assert decide(failed_attempt, max_attempts) == expected


@pytest.mark.parametrize(
    "exc",
    [
        RunFailedError("report text", attempts=3, root_cause="rank 1 boom"),
        RunTimeoutError("late", attempts=1, root_cause="timeout_s"),
        InsufficientSlotsError("too many", required=3, available=2),
    ],
)
def test_errors_survive_pickling(exc: Exception) -> None:
    clone = pickle.loads(pickle.dumps(exc))
    assert type(clone) is type(exc)
    assert str(clone) == str(exc)
    assert clone.__dict__ == exc.__dict__


def test_context_outside_a_run_says_where_it_works() -> None:
    with pytest.raises(sparkdl.NotInRunError, match=r"inside a function launched by sparkdl.run"):
        sparkdl.context()


def test_run_rejects_bad_input_before_any_spark_work() -> None:
    with pytest.raises(sparkdl.ConfigError, match="num_workers"):
        sparkdl.run(print, num_workers=0)
    with pytest.raises(sparkdl.ConfigError, match="num_workers"):
        sparkdl.run(print, num_workers=True)  # type: ignore[arg-type]
    with pytest.raises(sparkdl.ConfigError, match=r"backend must be one of 'torch', 'horovod', 'tensorflow', 'none'; got 'mpi'"):
        sparkdl.run(print, num_workers=1, backend="mpi")
    lock = threading.Lock()
    with pytest.raises(sparkdl.ConfigError, match="cannot be pickled"):
        sparkdl.run(lambda: lock.acquire(), num_workers=1)
    with pytest.raises(sparkdl.ConfigError, match="max_attempts"):
        sparkdl.run(print, num_workers=1, max_attempts=0)


def test_report_names_the_earliest_failure_as_root_cause_and_groups_repeats() -> None:
    t = time.monotonic()
    records = [
        RankRecord(attempt=0, rank=0, host="h0", pid=10, exit_code=1, state="failed", failed_at=t + 2,
                   error="RuntimeError: Connection closed by peer"),
        RankRecord(attempt=0, rank=1, host="h1", pid=11, exit_code=1, state="failed", failed_at=t + 1,
                   error="ValueError: bad batch", tail=["epoch 0 step 3", "boom"], traceback="Traceback...\nValueError: bad batch"),
        RankRecord(attempt=1, rank=0, host="h0", pid=20, state="lost", failed_at=t + 9),
        RankRecord(attempt=1, rank=1, host="h1", pid=21, signal=9, state="failed", failed_at=t + 8,
                   error="ValueError: bad batch"),
    ]
    assert root_cause(records) is records[1]
    report, root = build_report(records, headline="failed", hint="raise max_attempts")
    assert root.startswith("attempt 0, rank 1 on h1 (pid 11): exited with code 1: ValueError: bad batch")
    assert "Attempt 0:" in report and "Attempt 1:" in report
    assert "killed by SIGKILL" in report
    assert "task killed or executor lost" in report
    assert "| boom" in report
    assert "Identical errors" in report and "2x ValueError: bad batch  [attempt 0 rank 1, attempt 1 rank 1]" in report
    assert report.rstrip().endswith("raise max_attempts")


def _server(secret: bytes, received: list[dict[str, object]]) -> ChannelServer:
    def on_message(conn, msg):  # type: ignore[no-untyped-def]
        received.append(msg)
        conn.send({"echo": msg})

    return ChannelServer("127.0.0.1", secret, on_message, lambda conn, reason: None, handshake_timeout_s=2)


def test_channel_round_trip_and_binds_to_the_given_address_only() -> None:
    secret = b"s" * 32
    received: list[dict[str, object]] = []
    with _server(secret, received) as server:
        assert server.address[0] == "127.0.0.1"
        conn = connect(server.address, secret, timeout=5)
        for i in range(3):
            conn.send({"i": i, "text": "x" * 1000})
            assert conn.recv(timeout=5) == {"echo": {"i": i, "text": "x" * 1000}}
        conn.close()
    assert [m["i"] for m in received] == [0, 1, 2]


def test_channel_drops_a_peer_with_the_wrong_secret_without_parsing_its_payload() -> None:
    received: list[dict[str, object]] = []
    with _server(b"right" * 8, received) as server:
        # The server never acknowledges the handshake of a peer without the secret: connect() says so.
        with pytest.raises(ChannelError, match="does not hold this run's secret"):
            connect(server.address, b"wrong" * 8, timeout=5)
        deadline = time.monotonic() + 5
        while server.rejected == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.rejected == 1
    assert received == []


def test_channel_rejects_a_replayed_frame() -> None:
    secret = b"k" * 32
    received: list[dict[str, object]] = []
    with _server(secret, received) as server:
        raw = socket.create_connection(server.address, timeout=5)
        nonce = raw.recv(16)
        from sparkdl._internal.wire.channel import FramedConnection

        # Build one valid frame by hand, then send it twice: the second has a stale sequence number.
        helper = FramedConnection.__new__(FramedConnection)
        helper._secret, helper._nonce = secret, nonce
        payload = json.dumps({"t": "x"}).encode()
        frame = struct.pack(">I", len(payload)) + helper._tag(b"C", 0, payload) + payload
        raw.sendall(frame)
        raw.settimeout(5)
        assert raw.recv(1 << 16)  # the echo of the first frame
        raw.sendall(frame)
        assert raw.recv(1 << 16) == b""  # the replay closed the connection
        raw.close()
    assert received == [{"t": "x"}]


def test_channel_server_stops_listening_when_closed() -> None:
    with _server(b"a" * 32, []) as server:
        address = server.address
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=2)


def test_the_task_payload_never_shows_the_run_secret() -> None:
    # The payload reaches tasks pickled, and may be printed in a task's traceback or a log line.
    from sparkdl._internal.task.entry import TaskPayload
    from sparkdl._internal.wire.rankspec import RunSpec

    secret = "ab" * 32
    run = RunSpec(run_id="r", world_size=2, backend="torch", use_gpu=False, checkpoint_url="/tmp/x", config=sparkdl.RunConfig())
    payload = TaskPayload(run, b"fn", secret, "127.0.0.1", 5000)
    assert secret not in repr(payload) and secret not in str(payload)
    assert pickle.loads(pickle.dumps(payload)).secret_hex == secret


def test_run_and_launch_take_the_same_keywords_as_one_checked_object() -> None:
    import dataclasses
    import inspect

    from sparkdl._internal.driver.run import LaunchOptions

    for fn in (sparkdl.run, sparkdl.launch):
        params = inspect.signature(fn).parameters
        keywords = {name for name, p in params.items() if p.kind is p.KEYWORD_ONLY}
        # max_attempts travels inside the options' RunConfig.
        assert keywords == {f.name for f in dataclasses.fields(LaunchOptions)} - {"config"} | {"config", "max_attempts"}
    with pytest.raises(sparkdl.ConfigError, match=r"^config must be a sparkdl.RunConfig; got \{'timeout_s': 5\}$"):
        sparkdl.run(print, num_workers=1, config={"timeout_s": 5})  # type: ignore[arg-type]
    with pytest.raises(sparkdl.ConfigError, match=r"^config must be a sparkdl.RunConfig; got \{'timeout_s': 5\}$"):
        sparkdl.run(print, num_workers=1, max_attempts=2, config={"timeout_s": 5})  # type: ignore[arg-type]
    assert LaunchOptions.from_call({"num_workers": 2, "backend": "none", "use_gpu": None, "config": None,
                                    "spark": None, "checkpoint_dir": None, "max_attempts": 5}).config.max_attempts == 5
