"""A trial's decisions, from the driver's monitor to the rank's control pipe: the wire format,
the rank's reader (a real pipe), and the monitor sending every rank of the attempt the decision
on rank 0's report, a rank that starts late included."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest

import sparkdl
from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.driver.monitor import Monitor
from sparkdl._internal.driver.progress import MetricsLog, Progress
from sparkdl._internal.rank.orders import ControlPipe
from sparkdl._internal.wire.messages import Gang, Hello, Metric
from sparkdl._internal.wire.trial import (
    OBJECTIVE,
    REPORT_KEY,
    Decide,
    TrialSpec,
    decision_line,
    is_pruned_exception,
)


@pytest.fixture
def pipe():  # type: ignore[no-untyped-def]
    r, w = os.pipe()
    yield ControlPipe(r), w
    for fd in (r, w):
        with contextlib.suppress(OSError):
            os.close(fd)


def test_the_rank_reads_its_gang_then_the_decision_for_each_step_whatever_the_order(pipe) -> None:  # type: ignore[no-untyped-def]
    reader, w = pipe
    # The gang and two decisions in one write: the reader must not lose what follows the gang.
    os.write(w, b'{"RANK": "1"}\n' + decision_line(Decide(1, True)) + decision_line(Decide(0, False)))
    assert reader.first_line() == '{"RANK": "1"}'
    assert reader.decision(0, 1.0) is False
    assert not reader.last_prune
    assert reader.decision(1, 1.0) is True
    assert reader.last_prune


def test_a_decision_that_comes_later_is_waited_for_and_a_missing_one_times_out(pipe) -> None:  # type: ignore[no-untyped-def]
    reader, w = pipe
    os.write(w, b"{}\n")
    reader.first_line()
    threading.Timer(0.2, lambda: os.write(w, decision_line(Decide(3, False)))).start()
    started = time.monotonic()
    assert reader.decision(3, 5.0) is False
    assert 0.15 < time.monotonic() - started < 4
    with pytest.raises(TimeoutError):
        reader.decision(4, 0.2)


def test_no_decision_comes_when_the_lane_says_so_or_closes_the_pipe(pipe) -> None:  # type: ignore[no-untyped-def]
    reader, w = pipe
    # Said in the same write as the gang: the reader has it already, and must not wait for more.
    os.write(w, b"{}\n" + decision_line(None, off="relayed"))
    reader.first_line()
    started = time.monotonic()
    assert reader.decision(0, 5.0) is None and reader.off == "relayed"
    assert time.monotonic() - started < 1
    r2, w2 = os.pipe()
    other = ControlPipe(r2)
    os.close(w2)
    assert other.first_line() == ""  # the lane gave up before the gang formed
    assert other.decision(0, 5.0) is None
    os.close(r2)


def test_the_wire_refuses_malformed_decisions_and_the_trial_round_trips_through_the_environment() -> None:
    assert Decide.asked(Decide(2, True).encode()) == Decide(2, True)
    assert Decide.asked({"do": "decide", "step": "2", "prune": True}) is None
    assert Decide.asked({"do": "decide", "step": True, "prune": True}) is None
    assert Decide.asked({"do": "stacks"}) is None
    spec = TrialSpec(7, {"lr": 0.01, "layers": 3, "opt": "adam"}, pruning=False)
    assert TrialSpec.from_env(spec.env()) == spec
    assert TrialSpec.from_env({}) is None


def test_sparkdl_and_optuna_trial_pruned_end_a_trial_and_nothing_else_does() -> None:
    optuna = pytest.importorskip("optuna")
    assert is_pruned_exception(sparkdl.TrialPruned())
    assert is_pruned_exception(optuna.TrialPruned())
    assert not is_pruned_exception(type("TrialPruned", (Exception,), {})())  # a user's class of that name
    assert not is_pruned_exception(RuntimeError("pruned"))


def test_the_monitor_sends_rank_0s_decision_to_every_rank_of_the_attempt_a_late_one_too(tmp_path) -> None:
    monitor = Monitor(2, 1, RunConfig(), None, MetricsLog(None), Progress(5.0, False, 1.5))
    judged: list[tuple[int, float]] = []
    monitor.judge = lambda step, value: judged.append((step, value)) or value > 1.0
    got: dict[int, list[Decide]] = {0: [], 1: []}
    for rank in (0, 1):
        monitor.hello(rank, Hello("h", 1, rank), rank)
        assert monitor.join(rank, rank, Gang((0, 1))).go
    monitor.order_source(0, 0, lambda d: got[0].append(d) or True)

    def report(rank: int, step: int, value: float) -> None:
        monitor.metric(0, rank, Metric({"step": step, OBJECTIVE: value, REPORT_KEY: 1}))

    report(1, 0, 9.0)  # only rank 0's report is judged
    assert judged == [] and got[0] == []
    report(0, 0, 0.5)
    report(0, 1, 2.0)
    assert judged == [(0, 0.5), (1, 2.0)]
    assert got[0] == [Decide(0, False), Decide(1, True)]
    # Rank 1's process started after both decisions: it gets them when it does.
    monitor.order_source(0, 1, lambda d: got[1].append(d) or True)
    assert got[1] == [Decide(0, False), Decide(1, True)]
    # The reports are kept as metrics too, with the sender's rank.
    assert [(r["rank"], r[OBJECTIVE]) for r in monitor.metrics.records] == [(1, 9.0), (0, 0.5), (0, 2.0)]
