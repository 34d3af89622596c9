"""The failure policy of a run: from a frozen snapshot of its attempts to a decision.

No clock, no I/O, no Spark: the monitor (:mod:`sparkdl._internal.driver.monitor`) polls what the ranks
reported into a :class:`Snapshot` (reading the checkpoint store only for the attempts that
:func:`ready_to_judge` names), and :func:`judge` maps it to a :class:`Verdict`: keep waiting, or
stop the Spark job now, and why, quoting the setting that bounds it. Spark itself reruns the gang
while its stage attempts last; :func:`reschedule` decides whether a gang that lacks task slots after
a failure goes on with fewer ranks (``RunConfig.min_workers``). Every time it uses is a
:class:`~sparkdl._internal.common.config.RunConfig` field.

The launcher's other decisions are here too, as functions of what it observed: what follows a
Spark job that ended without a result (:func:`next_job`: submit it again when Spark refused its
slots, resize, go on in a new job, or fail), the bound on a gang that reports only at its end
(:func:`blind`, :func:`after_relay`), and when a shrunk gang grows back (:func:`grow_back`,
:func:`with_growth`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.driver.report import RankRecord, error_key, root_cause
from sparkdl._internal.wire.messages import RankState


class Decision(enum.Enum):
    WAIT = "wait"  # the job goes on; Spark reruns a failed gang by itself
    STOP = "stop"  # stop the job now and report
    RERUN = "rerun"  # start a new Spark job for the next attempt


@dataclass(frozen=True)
class Slots:
    """Task slots for the gang that waits to be scheduled after a failed attempt, when too few."""

    needed: int  # tasks of the gang Spark tries to schedule (ranks / RunConfig.processes_per_task)
    free: int  # slots free for it now (all slots less those other jobs hold)
    short_since: float  # since when fewer than ``needed`` have been free

    def describe(self, subject: str = "the gang") -> str:
        return f"{subject} needs {self.needed} task slots and only {self.free} are free"


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reason: str | None = None
    timed_out: bool = False
    # Why a rerun cannot help, when that is the reason to stop (RunConfig.stop_on_repeated_error).
    gave_up: str | None = None
    # Failed attempts now found worth a rerun: they are not judged again.
    judged: tuple[int, ...] = ()
    # RERUN: the ranks of the next attempt's gang (fewer than now: RunConfig.min_workers).
    world_size: int | None = None
    # STOP because the next gang cannot get its task slots.
    slots: Slots | None = None


@dataclass(frozen=True)
class AttemptView:
    """One attempt (one gang that formed) as the driver saw it."""

    attempt: int
    ranks: tuple[RankRecord, ...]
    judged: bool = False
    # Whether a new checkpoint was saved since the attempt began; None when not read.
    progressed: bool | None = None

    @property
    def failed(self) -> bool:
        return any(r.failed for r in self.ranks)

    def first_failure(self) -> float | None:
        return min((r.failed_at for r in self.ranks if r.failed_at is not None), default=None)


@dataclass(frozen=True)
class Snapshot:
    """A run's state at one moment (times from one monotonic clock, in seconds)."""

    now: float
    job_started: float
    last_trouble: float
    running_since: float | None  # when all ranks of the current attempt had joined; None meanwhile
    waiting_tasks: int  # tasks that checked in but have not joined a gang
    num_workers: int
    max_attempts: int
    attempts: tuple[AttemptView, ...]
    # Polled only while a gang waits to be scheduled after a failure, and only when short.
    slots: Slots | None = None

    def previous(self, view: AttemptView) -> tuple[RankRecord, ...]:
        earlier = [a for a in self.attempts if a.attempt == view.attempt - 1]
        return earlier[0].ranks if earlier else ()


def decide(failed_attempt: int, max_attempts: int) -> str:
    """Retry policy: ``"rerun"`` while attempts remain after ``failed_attempt``, else ``"stop"``."""
    return "rerun" if failed_attempt + 1 < max_attempts else "stop"


# Errors in the program itself: raised the same way by every rank, a rerun meets them again.
PROGRAM_ERRORS = frozenset({
    "TypeError",
    "NameError",
    "AttributeError",
    "ImportError",
    "ModuleNotFoundError",
    "SyntaxError",
    "IndentationError",
    "NotImplementedError",
    "UnboundLocalError",
})


def _error_type(error: str | None) -> str:
    head = (error or "").split(":", 1)[0].strip()
    return head.rsplit(".", 1)[-1]


def unrecoverable(
    attempt: Sequence[RankRecord], previous: Sequence[RankRecord], *, progressed: bool
) -> str | None:
    """Why rerunning the gang after this failed attempt cannot help, or None when it may.

    A rerun is skipped only when the attempt made no progress (saved no new checkpoint) and
    either its root cause is a :class:`~sparkdl.ConfigError` (sparkdl refused a setting), or every
    rank failed with the same error of a kind that is a bug in the program (``TypeError``,
    ``NameError``, ...), or the attempt failed with the same root cause as the attempt before it. Anything else (a crash, a signal, a lost executor, a timeout in a
    collective, a one-off error on one rank) is worth a rerun.
    """
    if progressed or not attempt:
        return None
    root = root_cause(list(attempt))
    if root is not None and _error_type(root.error) == "ConfigError":
        # sparkdl refused a setting (a checkpoint directory some host does not share, ...).
        return f"rank {root.rank} raised a ConfigError (a setting to change, below), which a rerun would raise again"
    errors = {error_key(r.error) for r in attempt if r.state is RankState.FAILED and r.error}
    all_failed = all(r.state is RankState.FAILED and r.error for r in attempt)
    if all_failed and len(errors) == 1:
        kind = _error_type(attempt[0].error)
        if kind in PROGRAM_ERRORS:
            return f"every rank raised the same {kind} ({attempt[0].error}); a rerun would raise it again"
    before = root_cause(list(previous))
    if (
        root is not None
        and before is not None
        and root.error
        and error_key(root.error) == error_key(before.error or "")
    ):
        return (
            f"attempt {root.attempt} failed with the same root cause as attempt {before.attempt} "
            f"({root.error}) and saved no checkpoint in between"
        )
    return None


def ready_to_judge(view: AttemptView, snapshot: Snapshot, cfg: RunConfig) -> bool:
    """Whether a failed attempt can be judged now: every rank reported its outcome, the next gang
    formed already, or ``cfg.outcome_wait_s`` passed since its first failure."""
    if not view.failed or view.judged or not cfg.stop_on_repeated_error:
        return False
    ended = all(r.state.ended for r in view.ranks)
    first = view.first_failure()
    waited = first is not None and snapshot.now - first > cfg.outcome_wait_s
    return ended or view.attempt + 1 < len(snapshot.attempts) or waited


def judge(snapshot: Snapshot, cfg: RunConfig) -> Verdict:
    """Keep waiting, or stop the job (attempts used up, a rerun cannot help, or a bound passed)."""
    judged: list[int] = []
    for view in sorted(snapshot.attempts, key=lambda v: v.attempt):
        if not view.failed:
            continue
        if decide(view.attempt, snapshot.max_attempts) == "stop":
            return Verdict(
                Decision.STOP,
                f"attempt {view.attempt} failed and max_attempts={snapshot.max_attempts} are used up",
            )
        if not ready_to_judge(view, snapshot, cfg) or view.progressed is None:
            continue
        why = unrecoverable(view.ranks, snapshot.previous(view), progressed=view.progressed)
        if why is not None:
            return Verdict(
                Decision.STOP,
                f"not rerunning the gang: {why} (RunConfig.stop_on_repeated_error)",
                gave_up=why,
            )
        judged.append(view.attempt)
    if snapshot.running_since is None:
        shrink = reschedule(snapshot, cfg)
        if shrink is not None:
            return dataclasses.replace(shrink, judged=tuple(judged))
        waiting = snapshot.now - max(snapshot.last_trouble, snapshot.job_started)
        if waiting > cfg.start_timeout_s:
            why = "the cluster's task slots may be busy with other jobs"
            if snapshot.slots is not None:
                why = (
                    f"{snapshot.slots.describe()} (an executor was lost and not replaced, or other "
                    "jobs hold them); add executors, or set RunConfig.min_workers to go on with "
                    "fewer ranks"
                )
            return Verdict(
                Decision.STOP,
                f"only {snapshot.waiting_tasks} of {snapshot.num_workers} ranks started within "
                f"start_timeout_s={cfg.start_timeout_s:g} s (RunConfig.start_timeout_s); {why}",
                timed_out=True,
                judged=tuple(judged),
            )
    elif cfg.timeout_s is not None and snapshot.now - snapshot.running_since > cfg.timeout_s:
        return Verdict(
            Decision.STOP,
            f"the attempt ran longer than timeout_s={cfg.timeout_s:g} s (RunConfig.timeout_s)",
            timed_out=True,
            judged=tuple(judged),
        )
    return Verdict(Decision.WAIT, judged=tuple(judged))


def reschedule(snapshot: Snapshot, cfg: RunConfig) -> Verdict | None:
    """With ``RunConfig.min_workers``: what to do about a gang that lacks task slots after a failure.

    None when this does not apply (no ``min_workers``, or enough slots): the other bounds hold.
    While the slots have been short for at most ``slot_wait_s``, WAIT (a lost executor may be
    replaced). Then RERUN on as many ranks as there are free slots, or STOP when they are fewer
    than ``min_workers``.
    """
    slots = snapshot.slots
    if cfg.min_workers is None or slots is None or slots.free >= slots.needed:
        return None
    if snapshot.now - slots.short_since <= cfg.slot_wait_s:
        return Verdict(Decision.WAIT)
    ranks = slots.free * cfg.processes_per_task  # the ranks the free slots hold
    if ranks >= cfg.min_workers:
        return Verdict(
            Decision.RERUN,
            f"{slots.describe()} after slot_wait_s={cfg.slot_wait_s:g} s (RunConfig.slot_wait_s): "
            f"the next attempt runs on {ranks} ranks (RunConfig.min_workers={cfg.min_workers})",
            world_size=ranks,
        )
    return Verdict(
        Decision.STOP,
        f"the gang could not be rescheduled: {slots.describe('it')} after waiting "
        f"slot_wait_s={cfg.slot_wait_s:g} s (RunConfig.slot_wait_s), fewer than "
        f"RunConfig.min_workers={cfg.min_workers}",
        slots=slots,
    )


def after_job(*, stopped: bool, attempts_used: int, max_attempts: int) -> Decision:
    """A Spark job ended without rank 0's result: go on in a new job, or stop.

    Spark's own stage retries (``spark.stage.maxConsecutiveAttempts``) may run out before
    ``max_attempts``; a new job then continues the count. Nothing to continue when the driver
    stopped the job itself, or when no gang formed at all (the job failed before any rank).
    """
    if not stopped and 0 < attempts_used < max_attempts:
        return Decision.RERUN
    return Decision.STOP


# -- between Spark jobs, and around the gang: the launcher observes, these decide ------------------

# How long the launcher waits before it submits again a job that Spark refused for too few slots.
SLOTS_RETRY_S = 1.0


class Next(enum.Enum):
    """What the launcher does after a Spark job of the run ended without rank 0's result."""

    RETRY = "retry"  # submit the same job again after SLOTS_RETRY_S: Spark refused its slots
    TOO_FEW_SLOTS = "too_few_slots"  # raise InsufficientSlotsError: refused until slot_wait_s
    RESIZE = "resize"  # a new job runs the next attempt on JobStep.world_size ranks
    NEW_JOB = "new_job"  # a new job continues the count of attempts
    FAIL = "fail"  # raise the run's failure


@dataclass(frozen=True)
class JobEnd:
    """How one Spark job of the run ended, as the launcher saw it (times from one monotonic clock)."""

    now: float
    attempts_before: int  # gangs that had formed in the run before this job
    attempts_after: int  # ... and after it
    verdict: Verdict | None  # why the driver stopped the job itself, if it did
    slots_refused: bool  # Spark refused the barrier stage for too few slots before any task ran
    slots_until: float  # the end of slot_wait_s, counted from the run's start
    max_attempts: int


@dataclass(frozen=True)
class JobStep:
    action: Next
    world_size: int | None = None  # RESIZE: the next gang's ranks


def next_job(end: JobEnd) -> JobStep:
    """After a Spark job that returned no result: retry, resize, go on, or fail.

    Spark refuses a barrier stage with too few slots before any task runs (executors still
    registering; over Spark Connect the driver cannot count them first), and its own rechecks do
    not cover a stage that adaptive execution submits: the job is submitted again until
    ``slot_wait_s``. A job in which no gang formed after earlier ones did fails the run: another
    would fail the same way. A verdict to rerun on another number of ranks resizes; otherwise
    :func:`after_job` decides.
    """
    if end.attempts_before == 0 and end.verdict is None and end.slots_refused:
        return JobStep(Next.RETRY if end.now + SLOTS_RETRY_S <= end.slots_until else Next.TOO_FEW_SLOTS)
    if end.attempts_after == end.attempts_before and end.verdict is None and end.attempts_before > 0:
        return JobStep(Next.FAIL)
    if end.verdict is not None and end.verdict.decision is Decision.RERUN and end.verdict.world_size:
        return JobStep(Next.RESIZE, end.verdict.world_size)
    decision = after_job(stopped=end.verdict is not None, attempts_used=end.attempts_after,
                         max_attempts=end.max_attempts)
    return JobStep(Next.NEW_JOB if decision is Decision.RERUN else Next.FAIL)


def blind(elapsed_s: float, bound_s: float | None) -> Verdict:
    """A job whose ranks report only at their end, through the relay hub (the executors cannot
    reach the driver): stop it once ``start_timeout_s + timeout_s`` (``bound_s``) passed."""
    if bound_s is not None and elapsed_s > bound_s:
        return Verdict(
            Decision.STOP,
            f"no word from the ranks within start_timeout_s + timeout_s = {bound_s:g} s: they report through "
            "Spark at the end of each attempt (the executors do not reach this driver: spark.sparkdl.channel)",
            timed_out=True,
        )
    return Verdict(Decision.WAIT)


def after_relay(hub_stop: str | None, hub_timed_out: bool, replayed: Verdict) -> Verdict | None:
    """A relayed attempt ended without rank 0's result: stop (the hub's own bound passed, or the
    policy stops on the replayed attempt, ``replayed``), or None to go on in a new job."""
    if hub_stop is not None and hub_timed_out:
        return Verdict(Decision.STOP, hub_stop, timed_out=True)
    return replayed if replayed.decision is Decision.STOP else None


@dataclass(frozen=True)
class GrowState:
    """A shrunk gang's watch for the slots to come back: the latest checkpoint when they did, or None."""

    back_at: tuple[int | None] | None = None


def grow_back(state: GrowState, *, free: int | None, tasks: int, latest: Callable[[], int | None],
              num_workers: int) -> tuple[GrowState, int | None]:
    """While a gang runs on fewer than ``num_workers`` ranks: once the cluster has ``free`` slots
    for all ``tasks`` again (the gang's own count as free), the gang grows back to ``num_workers``
    as soon as it commits a checkpoint newer than the one it had when they came back (``latest()``,
    asked only while the slots are back: it reads the store), so that the grown gang resumes where
    this one stopped. Returns the new state and the ranks to grow to, or None. ``state.back_at``
    going from None to set is when to say the slots are back."""
    if free is None or free < tasks:
        return GrowState(), None
    newest = latest()
    if state.back_at is None:
        return GrowState((newest,)), None
    return state, num_workers if newest is not None and newest != state.back_at[0] else None


def with_growth(verdict: Verdict, grow_to: int | None) -> Verdict:
    """A gang that would go on (WAIT) stops to grow back to ``grow_to`` ranks in a new job."""
    if verdict.decision is Decision.WAIT and grow_to:
        return Verdict(Decision.RERUN, f"the gang grows back to {grow_to} ranks", world_size=grow_to)
    return verdict
