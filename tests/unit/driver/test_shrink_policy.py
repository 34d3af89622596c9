"""``RunConfig(min_workers=M)`` as policy, without processes: a gang short of task slots waits
``slot_wait_s`` for a replacement, then goes on with the free slots or stops, naming both settings;
without ``min_workers`` it waits until ``start_timeout_s``. ``min_workers`` is checked before any
Spark work. The runs that lose an executor for good are in tests/cluster/test_shrink.py."""

from __future__ import annotations

from typing import Any

import pytest

import sparkdl
from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.driver.policy import (
    AttemptView,
    Decision,
    Slots,
    Snapshot,
    judge,
    reschedule,
)
from sparkdl._internal.driver.report import RankRecord
from sparkdl._internal.wire.messages import RankState


def _waiting(slots: Slots | None, now: float = 50.0) -> Snapshot:
    lost = tuple(RankRecord(attempt=0, rank=r, state=RankState.LOST, failed_at=10.0) for r in range(4))
    return Snapshot(now=now, job_started=0.0, last_trouble=10.0, running_since=None, waiting_tasks=0,
                    num_workers=4, max_attempts=4, attempts=(AttemptView(0, lost, judged=True),), slots=slots)


@pytest.mark.parametrize(
    ("min_workers", "free", "since", "decision", "world_size"),
    [
        (2, 3, 48.0, Decision.WAIT, None),  # short for 2 s of slot_wait_s=5: a replacement may come
        (2, 3, 40.0, Decision.RERUN, 3),  # short for longer: go on with the free slots
        (3, 3, 40.0, Decision.RERUN, 3),
        (4, 3, 40.0, Decision.STOP, None),  # fewer than min_workers
        (1, 0, 40.0, Decision.STOP, None),
    ],
)
def test_a_gang_short_of_slots_waits_then_shrinks_or_stops(
    min_workers: int, free: int, since: float, decision: Decision, world_size: int | None
) -> None:
    cfg = RunConfig(min_workers=min_workers, slot_wait_s=5, start_timeout_s=30)
    verdict = judge(_waiting(Slots(needed=4, free=free, short_since=since)), cfg)
    assert verdict.decision is decision
    assert verdict.world_size == world_size
    if decision is Decision.STOP:
        assert verdict.slots == Slots(4, free, since) and not verdict.timed_out
        assert verdict.reason is not None
        assert f"could not be rescheduled: it needs 4 task slots and only {free} are free" in verdict.reason
        assert f"RunConfig.min_workers={min_workers}" in verdict.reason and "slot_wait_s=5" in verdict.reason


def test_a_shrunk_gang_of_several_ranks_per_task_counts_ranks_not_slots() -> None:
    # Two ranks in each task: 3 free slots hold 6 ranks, enough for min_workers=5 of 8.
    cfg = RunConfig(min_workers=5, slot_wait_s=5, processes_per_task=2)
    verdict = judge(_waiting(Slots(needed=4, free=3, short_since=40.0)), cfg)
    assert (verdict.decision, verdict.world_size) == (Decision.RERUN, 6)
    assert verdict.reason is not None and "runs on 6 ranks" in verdict.reason
    assert judge(_waiting(Slots(needed=4, free=2, short_since=40.0)), cfg).decision is Decision.STOP


def test_without_min_workers_the_gang_waits_until_start_timeout_and_says_slots_are_missing() -> None:
    cfg = RunConfig(slot_wait_s=5, start_timeout_s=30)
    slots = Slots(needed=4, free=1, short_since=11.0)
    assert reschedule(_waiting(slots), cfg) is None
    assert judge(_waiting(slots, now=35.0), cfg).decision is Decision.WAIT
    verdict = judge(_waiting(slots, now=45.0), cfg)
    assert verdict.decision is Decision.STOP and verdict.timed_out
    assert verdict.reason is not None and "needs 4 task slots and only 1 are free" in verdict.reason
    assert "RunConfig.min_workers" in verdict.reason


def test_enough_slots_never_shrink() -> None:
    cfg = RunConfig(min_workers=1, slot_wait_s=5)
    assert reschedule(_waiting(None), cfg) is None
    assert reschedule(_waiting(Slots(needed=4, free=4, short_since=0.0)), cfg) is None


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_min_workers_must_be_a_positive_integer(bad: Any) -> None:
    with pytest.raises(sparkdl.ConfigError, match=r"RunConfig\.min_workers must be an integer >= 1"):
        RunConfig(min_workers=bad)


def test_min_workers_above_num_workers_is_refused_before_any_spark_work() -> None:
    with pytest.raises(sparkdl.ConfigError, match=r"RunConfig\.min_workers=3 is more than num_workers=2"):
        sparkdl.run(print, num_workers=2, config=RunConfig(min_workers=3))


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"num_workers": 3}, r"num_workers=3 is not a multiple of RunConfig\.processes_per_task=2.*num_workers=2 or 4"),
    ({"num_workers": 1}, r"num_workers=1 is not a multiple .*use num_workers=2$"),
    ({"num_workers": 4, "backend": "horovod"}, r"processes_per_task=2 .* backend='horovod' runs one rank per task"),
])
def test_ranks_that_do_not_fill_their_tasks_are_refused_before_any_spark_work(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(sparkdl.ConfigError, match=says):
        sparkdl.run(print, config=RunConfig(processes_per_task=2), **kwargs)
    with pytest.raises(sparkdl.ConfigError, match=r"RunConfig\.processes_per_task must be an integer >= 1"):
        RunConfig(processes_per_task=0)
