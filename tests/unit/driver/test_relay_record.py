"""The relay's record without Spark (sparkdl._internal.driver.relay): the hub's record of an attempt, signed
with the run's secret, replays into the driver's monitor as if its tasks had reported live (ranks,
states, output); a record that was tampered with, signed with another key, or of another Spark
job is refused. Relayed runs on a real session are in tests/integration/test_relay.py.
"""

from __future__ import annotations

import os

import pytest
from resources.relay_config import FAST

from sparkdl._internal.common.errors import SparkDLError
from sparkdl._internal.driver import relay
from sparkdl._internal.driver.monitor import Monitor
from sparkdl._internal.driver.progress import MetricsLog, Progress
from sparkdl._internal.wire.relay_record import Body


def _monitor() -> Monitor:
    return Monitor(2, 3, FAST, None, MetricsLog(None), Progress(1.0, enabled=False))


def _record(secret: bytes, run_id: str = "r1", first_attempt: int = 0, metrics: tuple[dict, ...] = ()) -> bytes:
    events: list[tuple[int, dict | None]] = [
        (0, {"t": "hello", "r": 0, "a": -1, "host": "h0", "task_pid": 1, "tid": 10}),
        (0, {"t": "gang", "r": 0, "a": -1, "tids": [10, 11]}),
        (0, {"t": "started", "r": 0, "a": first_attempt, "pid": 5}),
        (0, {"t": "log", "r": 0, "a": first_attempt, "s": "o", "l": "relayed line", "more": False}),
        *((0, {"t": "metric", "r": 0, "a": first_attempt, "m": m}) for m in metrics),
        (0, {"t": "exit", "r": 0, "a": first_attempt, "code": 0, "signal": None}),
        (0, None),
    ]
    return Body(run_id, first_attempt, events, []).signed(secret)


def test_a_signed_record_replays_into_the_drivers_monitor(capsys: pytest.CaptureFixture[str]) -> None:
    secret, monitor = os.urandom(32), _monitor()
    out = relay.replay(_record(secret), secret, "r1", 0, monitor)
    assert out.stop is None and not out.timed_out
    [rec] = monitor.sorted_records()
    assert (rec.attempt, rec.rank, rec.host, str(rec.state), rec.tail) == (0, 0, "h0", "succeeded", ["relayed line"])
    assert not monitor.output.close(timeout_s=10)  # as the run does before it returns
    assert "[rank 0] relayed line" in capsys.readouterr().out


def test_a_checkpoint_a_restore_skipped_is_in_the_result_and_the_report_not_in_the_metrics() -> None:
    """A rank's restore that skipped a torn checkpoint says so to the driver (directly, or, as
    here, through the hub's record): RunResult.skipped_checkpoints and the failure report name
    it with its reason; the metrics hold only what the user logged."""
    from sparkdl._internal.driver.report import build_report, skipped_checkpoints
    from sparkdl._internal.wire.messages import SKIPPED_CHECKPOINT_KEY

    secret, monitor = os.urandom(32), _monitor()
    note = {SKIPPED_CHECKPOINT_KEY: 4, "reason": "its data file is empty (0 bytes)", "rank": 1, "attempt": 9}
    relay.replay(_record(secret, metrics=(note, {"step": 1, "loss": 0.5})), secret, "r1", 0, monitor)
    # The rank and attempt are the sender's, whatever the record claims.
    assert skipped_checkpoints(monitor.sorted_records()) == [
        {"attempt": 0, "rank": 0, "checkpoint": 4, "reason": "its data file is empty (0 bytes)"}]
    assert [{k: r[k] for k in ("step", "loss")} for r in monitor.metrics.records] == [{"step": 1, "loss": 0.5}]
    report, _ = build_report(monitor.sorted_records(), headline="h", hint="x")
    assert "rank 0 skipped checkpoint 4, which did not verify: its data file is empty (0 bytes)" in report
    monitor.output.close(timeout_s=10)


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


def test_a_hub_keeps_the_ranks_metrics_up_to_its_bound_and_the_driver_is_told_how_many_it_dropped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Task 0's hub holds the attempt's record in memory until the attempt ends: a rank logging
    metrics without end must not grow it without bound (its output already had one)."""
    from sparkdl._internal.common.config import RunConfig
    from sparkdl._internal.wire.rankspec import RunSpec

    monkeypatch.setattr(relay, "MAX_METRIC_BYTES", 3000)
    monkeypatch.setattr(relay, "_SETTLE_S", 0.1)
    cfg = RunConfig(connect_timeout_s=0.5, handshake_timeout_s=0.5, kill_grace_s=0.5)
    run = RunSpec(run_id="r1", world_size=1, backend="torch", use_gpu=False, checkpoint_url="file:///unused", config=cfg)
    secret = os.urandom(32)
    hub = relay.Hub("127.0.0.1", secret, run, 0)
    try:
        kept = [hub._keep({"t": "metric", "r": 0, "a": 0, "m": {"step": i, "loss": 0.5, "note": "x" * 80}})
                for i in range(100)]
        record = hub.finish()  # no rank joined: the hub stops the attempt after its bound
    finally:
        hub.close()
    assert 20 <= kept.count(True) <= 30 and kept[: kept.count(True)] == [True] * kept.count(True)
    assert hub.monitor.metrics.records == []  # the hub's record carries them; it keeps no second copy
    replayed = relay.replay(record.blob, secret, "r1", 0, _monitor())
    assert replayed.dropped_metrics == kept.count(False)
    assert f"{kept.count(False)} metric records of the ranks were not relayed" in capsys.readouterr().out
