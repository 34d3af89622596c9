"""The launcher's decisions as pure functions of what it observed (sparkdl/_internal/driver/policy.py):
what follows a Spark job without a result, the bound on a gang that reports only at its end, and
when a shrunk gang grows back. The launcher that acts on them, with Spark:
tests/cluster/test_shrink.py, tests/integration/test_faults.py, tests/integration/test_relay.py."""

from __future__ import annotations

import pytest

from sparkdl._internal.driver.policy import (
    SLOTS_RETRY_S,
    Decision,
    GrowState,
    JobEnd,
    Next,
    Verdict,
    after_relay,
    blind,
    grow_back,
    next_job,
    with_growth,
)

STOP = Verdict(Decision.STOP, "attempt 1 failed and max_attempts=2 are used up")


def end(before: int = 1, after: int = 2, verdict: Verdict | None = None, refused: bool = False,
        now: float = 10.0, until: float = 100.0, max_attempts: int = 3) -> JobEnd:
    return JobEnd(now=now, attempts_before=before, attempts_after=after, verdict=verdict, slots_refused=refused,
                  slots_until=until, max_attempts=max_attempts)


def test_a_stage_refused_for_slots_before_any_gang_is_submitted_again_until_slot_wait_s() -> None:
    assert next_job(end(before=0, after=0, refused=True)).action is Next.RETRY
    assert next_job(end(before=0, after=0, refused=True, now=100.0 - SLOTS_RETRY_S)).action is Next.RETRY
    assert next_job(end(before=0, after=0, refused=True, now=100.0 - SLOTS_RETRY_S / 2)).action is Next.TOO_FEW_SLOTS
    # Refused after a gang had formed: not executors registering, the policy's other rules apply.
    assert next_job(end(before=1, after=1, refused=True)).action is Next.FAIL


def test_a_job_in_which_no_gang_formed_after_earlier_ones_fails_the_run() -> None:
    assert next_job(end(before=2, after=2)).action is Next.FAIL
    assert next_job(end(before=0, after=0)).action is Next.FAIL  # none ever: after_job stops


@pytest.mark.parametrize(("verdict", "after", "max_attempts", "action", "world"), [
    (Verdict(Decision.RERUN, "shrink", world_size=3), 2, 3, Next.RESIZE, 3),  # min_workers, or growing back
    (None, 2, 3, Next.NEW_JOB, None),  # Spark's stage attempts ran out before max_attempts
    (None, 3, 3, Next.FAIL, None),  # every attempt used
    (STOP, 2, 3, Next.FAIL, None),  # the driver stopped the job itself
])
def test_after_a_job_that_formed_gangs(verdict: Verdict | None, after: int, max_attempts: int, action: Next,
                                       world: int | None) -> None:
    step = next_job(end(before=1, after=after, verdict=verdict, max_attempts=max_attempts))
    assert (step.action, step.world_size) == (action, world)


def test_a_gang_that_reports_only_at_its_end_is_bounded_by_start_and_run_timeouts() -> None:
    assert blind(50.0, 60.0).decision is Decision.WAIT
    assert blind(1e9, None).decision is Decision.WAIT  # timeout_s=None: no bound
    verdict = blind(61.0, 60.0)
    assert verdict.decision is Decision.STOP and verdict.timed_out
    assert "start_timeout_s + timeout_s = 60 s" in (verdict.reason or "") and "spark.sparkdl.channel" in (verdict.reason or "")


def test_a_relayed_attempt_stops_on_the_hubs_bound_or_the_replayed_verdict() -> None:
    wait = Verdict(Decision.WAIT)
    bound = after_relay("the hub's bound passed", True, wait)
    assert bound is not None and bound.decision is Decision.STOP and bound.timed_out
    assert after_relay("rank 1 failed", False, STOP) is STOP
    assert after_relay("rank 1 failed", False, wait) is None  # a new job goes on
    assert after_relay(None, False, wait) is None


def test_a_shrunk_gang_grows_back_after_a_checkpoint_newer_than_when_the_slots_came_back() -> None:
    def unread() -> int:
        raise AssertionError("the store is read only while the slots are back")

    state, grow = grow_back(GrowState(), free=2, tasks=4, latest=unread, num_workers=4)
    assert (state, grow) == (GrowState(), None)  # too few slots
    assert grow_back(GrowState(), free=None, tasks=4, latest=unread, num_workers=4) == (GrowState(), None)
    state, grow = grow_back(state, free=4, tasks=4, latest=lambda: 3, num_workers=4)
    assert state.back_at == (3,) and grow is None  # back: wait for a newer checkpoint
    state, grow = grow_back(state, free=5, tasks=4, latest=lambda: 3, num_workers=4)
    assert grow is None  # the same checkpoint: the grown gang would redo the steps since
    state, grow = grow_back(state, free=4, tasks=4, latest=lambda: 4, num_workers=4)
    assert grow == 4
    # The slots went again before that checkpoint: the watch starts over.
    state, _ = grow_back(GrowState((3,)), free=3, tasks=4, latest=lambda: 4, num_workers=4)
    assert state == GrowState()
    # No checkpoint yet when they came back: the first one counts.
    state, _ = grow_back(GrowState(), free=4, tasks=4, latest=lambda: None, num_workers=4)
    assert grow_back(state, free=4, tasks=4, latest=lambda: None, num_workers=4)[1] is None
    assert grow_back(state, free=4, tasks=4, latest=lambda: 0, num_workers=4)[1] == 4


def test_growing_back_replaces_only_a_verdict_to_go_on() -> None:
    grown = with_growth(Verdict(Decision.WAIT), 4)
    assert (grown.decision, grown.world_size, grown.reason) == (Decision.RERUN, 4, "the gang grows back to 4 ranks")
    assert with_growth(STOP, 4) is STOP  # a failure wins
    assert with_growth(Verdict(Decision.WAIT), None).decision is Decision.WAIT
