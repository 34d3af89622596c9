"""The relay's record without Spark (sparkdl._internal.driver.relay): the hub's record of an attempt, signed
with the run's secret, replays into the driver's monitor as if its tasks had reported live (ranks,
states, output); a record that was tampered with, signed with another key, or of another Spark
job is refused. Relayed runs on a real session are in tests/integration/test_relay.py.
"""

from __future__ import annotations

import json
import os

import pytest
from resources.relay_config import FAST

from sparkdl._internal.common.errors import SparkDLError
from sparkdl._internal.driver import relay
from sparkdl._internal.driver.monitor import Monitor
from sparkdl._internal.driver.progress import MetricsLog, Progress


def _monitor() -> Monitor:
    return Monitor(2, 3, FAST, None, MetricsLog(None), Progress(1.0, enabled=False))


def _record(secret: bytes, run_id: str = "r1", first_attempt: int = 0) -> bytes:
    body = {"run": run_id, "first_attempt": first_attempt, "stop": None, "timed_out": False, "dropped_lines": 0,
            "stacks": [],
            "events": [[0, {"t": "hello", "r": 0, "a": -1, "host": "h0", "task_pid": 1, "tid": 10}],
                       [0, {"t": "gang", "r": 0, "a": -1, "tids": [10, 11]}],
                       [0, {"t": "started", "r": 0, "a": first_attempt, "pid": 5}],
                       [0, {"t": "log", "r": 0, "a": first_attempt, "s": "o", "l": "relayed line", "more": False}],
                       [0, {"t": "exit", "r": 0, "a": first_attempt, "code": 0, "signal": None}],
                       [0, None]]}
    return relay.sign(secret, json.dumps(body).encode())


def test_a_signed_record_replays_into_the_drivers_monitor(capsys: pytest.CaptureFixture[str]) -> None:
    secret, monitor = os.urandom(32), _monitor()
    out = relay.replay(_record(secret), secret, "r1", 0, monitor)
    assert out.stop is None and not out.timed_out
    [rec] = monitor.sorted_records()
    assert (rec.attempt, rec.rank, rec.host, str(rec.state), rec.tail) == (0, 0, "h0", "succeeded", ["relayed line"])
    assert not monitor.output.close(timeout_s=10)  # as the run does before it returns
    assert "[rank 0] relayed line" in capsys.readouterr().out


def test_a_tampered_or_foreign_record_is_refused() -> None:
    secret = os.urandom(32)
    blob = bytearray(_record(secret))
    blob[-5] ^= 1
    with pytest.raises(SparkDLError, match="failed authentication"):
        relay.replay(bytes(blob), secret, "r1", 0, _monitor())
    with pytest.raises(SparkDLError, match="failed authentication"):
        relay.replay(_record(os.urandom(32)), secret, "r1", 0, _monitor())
    # Signed by the run, but another job's record: not replayed as this one's.
    with pytest.raises(SparkDLError, match="another Spark job"):
        relay.replay(_record(secret, first_attempt=1), secret, "r1", 0, _monitor())
