"""The failure policy as a pure function of a snapshot: no processes, no clock, no Spark."""

from __future__ import annotations

import pytest

from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.driver.policy import (
    AttemptView,
    Decision,
    Snapshot,
    after_job,
    judge,
    ready_to_judge,
)
from sparkdl._internal.driver.report import RankRecord
from sparkdl._internal.wire.messages import RankState

CFG = RunConfig(start_timeout_s=30, outcome_wait_s=10, timeout_s=100)


def rec(attempt: int, rank: int, state: str, error: str | None = None, failed_at: float | None = None) -> RankRecord:
    return RankRecord(attempt=attempt, rank=rank, host=f"h{rank}", state=RankState(state), error=error, failed_at=failed_at)


def snap(*views: AttemptView, now: float = 50.0, running_since: float | None = 1.0, max_attempts: int = 3,
         last_trouble: float = 0.0, waiting: int = 0) -> Snapshot:
    return Snapshot(now=now, job_started=0.0, last_trouble=last_trouble, running_since=running_since,
                    waiting_tasks=waiting, num_workers=2, max_attempts=max_attempts, attempts=views)


SAME_BUG = (rec(0, 0, "failed", "TypeError: f() takes 1 argument", 5.0),
            rec(0, 1, "failed", "TypeError: f() takes 1 argument", 5.5))
ONE_OFF = (rec(0, 0, "failed", "ValueError: bad batch 17", 5.0), rec(0, 1, "lost", None, 6.0))


def test_all_running_waits() -> None:
    view = AttemptView(0, (rec(0, 0, "running"), rec(0, 1, "running")))
    assert judge(snap(view), CFG).decision is Decision.WAIT


@pytest.mark.parametrize(("attempt", "max_attempts", "stops"), [(0, 1, True), (0, 2, False), (1, 2, True), (2, 4, False)])
def test_a_failed_attempt_stops_the_job_only_when_attempts_are_used_up(attempt: int, max_attempts: int, stops: bool) -> None:
    ranks = (rec(attempt, 0, "failed", "OSError: disk", 5.0), rec(attempt, 1, "running"))
    views = tuple(AttemptView(a, (rec(a, 0, "failed", "OSError: disk", 1.0),), judged=True) for a in range(attempt))
    verdict = judge(snap(*views, AttemptView(attempt, ranks), max_attempts=max_attempts, running_since=None,
                         last_trouble=40.0), RunConfig(stop_on_repeated_error=False))
    assert (verdict.decision is Decision.STOP) == stops
    if stops:
        assert verdict.reason == f"attempt {attempt} failed and max_attempts={max_attempts} are used up"
        assert not verdict.timed_out


@pytest.mark.parametrize(
    ("ranks", "now", "later_gang", "ready"),
    [
        ((rec(0, 0, "failed", "E", 5.0), rec(0, 1, "running")), 10.0, False, False),  # the peer may still report
        ((rec(0, 0, "failed", "E", 5.0), rec(0, 1, "running")), 15.5, False, True),  # outcome_wait_s passed
        ((rec(0, 0, "failed", "E", 5.0), rec(0, 1, "running")), 10.0, True, True),  # the next gang formed
        ((rec(0, 0, "failed", "E", 5.0), rec(0, 1, "succeeded")), 6.0, False, True),  # every rank ended
        ((rec(0, 0, "running"), rec(0, 1, "running")), 99.0, False, False),  # nothing failed
    ],
)
def test_a_failed_attempt_is_judged_once_its_ranks_reported_or_the_wait_ran_out(
    ranks: tuple[RankRecord, ...], now: float, later_gang: bool, ready: bool
) -> None:
    view = AttemptView(0, ranks)
    views = (view, AttemptView(1, (rec(1, 0, "starting"), rec(1, 1, "starting")))) if later_gang else (view,)
    assert ready_to_judge(view, snap(*views, now=now), CFG) is ready


def test_every_rank_raising_the_same_program_error_stops_without_rerun() -> None:
    verdict = judge(snap(AttemptView(0, SAME_BUG, progressed=False)), CFG)
    assert verdict.decision is Decision.STOP
    assert verdict.gave_up is not None and "same TypeError" in verdict.gave_up
    assert verdict.reason is not None and verdict.reason.endswith("(RunConfig.stop_on_repeated_error)")


def test_a_program_error_is_rerun_when_the_attempt_saved_a_checkpoint() -> None:
    verdict = judge(snap(AttemptView(0, SAME_BUG, progressed=True)), CFG)
    assert verdict.decision is Decision.WAIT and verdict.judged == (0,)


def test_the_same_root_cause_twice_without_progress_stops() -> None:
    again = (rec(1, 0, "failed", "ValueError: bad batch 23", 30.0), rec(1, 1, "lost", None, 31.0))
    verdict = judge(snap(AttemptView(0, ONE_OFF, judged=True), AttemptView(1, again, progressed=False)), CFG)
    assert verdict.decision is Decision.STOP
    assert verdict.gave_up is not None and "same root cause as attempt 0" in verdict.gave_up


def test_a_one_off_failure_is_worth_a_rerun_and_is_not_judged_again() -> None:
    first = judge(snap(AttemptView(0, ONE_OFF, progressed=False)), CFG)
    assert first.decision is Decision.WAIT and first.judged == (0,)
    again = judge(snap(AttemptView(0, ONE_OFF, judged=True)), CFG)
    assert again.decision is Decision.WAIT and again.judged == ()


def test_without_stop_on_repeated_error_a_shared_bug_is_rerun() -> None:
    cfg = CFG.replace(stop_on_repeated_error=False)
    assert judge(snap(AttemptView(0, SAME_BUG, progressed=False)), cfg).decision is Decision.WAIT


def test_an_unread_checkpoint_state_is_not_judged() -> None:
    # The monitor reads the store only for attempts ready to judge; without it, no verdict yet.
    assert judge(snap(AttemptView(0, SAME_BUG, progressed=None)), CFG).decision is Decision.WAIT


@pytest.mark.parametrize(
    ("now", "last_trouble", "stops"),
    [(29.0, 0.0, False), (31.0, 0.0, True), (45.0, 20.0, False), (51.0, 20.0, True)],
)
def test_a_gang_that_does_not_form_within_start_timeout_s_stops(now: float, last_trouble: float, stops: bool) -> None:
    verdict = judge(snap(now=now, running_since=None, last_trouble=last_trouble, waiting=1), CFG)
    assert (verdict.decision is Decision.STOP) == stops
    if stops:
        assert verdict.timed_out
        assert verdict.reason is not None
        assert "only 1 of 2 ranks started within start_timeout_s=30 s (RunConfig.start_timeout_s)" in verdict.reason


@pytest.mark.parametrize(("timeout_s", "stops"), [(None, False), (100.0, False), (40.0, True)])
def test_an_attempt_longer_than_timeout_s_stops(timeout_s: float | None, stops: bool) -> None:
    view = AttemptView(0, (rec(0, 0, "running"), rec(0, 1, "running")))
    verdict = judge(snap(view, now=60.0, running_since=10.0), CFG.replace(timeout_s=timeout_s))
    assert (verdict.decision is Decision.STOP) == stops
    if stops:
        assert verdict.timed_out and verdict.reason is not None and "timeout_s=40 s (RunConfig.timeout_s)" in verdict.reason


@pytest.mark.parametrize(
    ("stopped", "used", "max_attempts", "decision"),
    [
        (False, 1, 3, Decision.RERUN),  # Spark's stage attempts ran out first: a new job goes on
        (False, 3, 3, Decision.STOP),  # every attempt used
        (True, 1, 3, Decision.STOP),  # the driver stopped the job itself
        (False, 0, 3, Decision.STOP),  # no gang ever formed: the job failed before any rank
    ],
)
def test_after_a_job_without_result(stopped: bool, used: int, max_attempts: int, decision: Decision) -> None:
    assert after_job(stopped=stopped, attempts_used=used, max_attempts=max_attempts) is decision


def test_every_time_the_policy_uses_is_a_validated_setting() -> None:
    for name in ("outcome_wait_s", "start_timeout_s", "handshake_timeout_s"):
        with pytest.raises(ValueError, match=f"RunConfig.{name} must be a positive number of seconds"):
            RunConfig(**{name: 0})


def test_a_config_error_on_one_rank_stops_without_rerun() -> None:
    # Rank 0 was refused its first save (a checkpoint directory a host does not share); its peer
    # was stopped in a collective. A rerun would be refused the same way.
    refused = (rec(0, 0, "failed", "ConfigError: sparkdl: this checkpoint was not saved: ...", 5.0),
               rec(0, 1, "lost", None, 6.0))
    verdict = judge(snap(AttemptView(0, refused, progressed=False)), CFG)
    assert verdict.decision is Decision.STOP
    assert verdict.gave_up is not None and "rank 0 raised a ConfigError" in verdict.gave_up
    # Other errors of one rank still get their rerun.
    assert judge(snap(AttemptView(0, ONE_OFF, progressed=False)), CFG).decision is Decision.WAIT
