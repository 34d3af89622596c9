"""What the driver knows about every rank of every attempt, fed by typed events.

Both launchers feed the same :class:`Monitor`: the Spark launcher through the authenticated
channel (:meth:`Monitor.on_message`, :meth:`Monitor.on_close`), the driver-local launcher by
calling the event methods directly. The monitor keeps each rank's :class:`RankRecord`, echoes
output with a rank tag, keeps the tail for the failure report, hands metrics to the metrics log
and the progress line, and turns its state into a :class:`~sparkdl._internal.driver.policy.Snapshot` for
the failure policy. It also gathers the stacks of running ranks for the report: at once from the
peers of a rank that fails, and from every running rank before the driver stops an attempt.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from sparkdl._internal.ckpt.store import CheckpointStore
from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.driver import policy
from sparkdl._internal.driver.output import RankOutput
from sparkdl._internal.driver.progress import PROGRESS_KEY, MetricsLog, Progress
from sparkdl._internal.driver.report import RankRecord
from sparkdl._internal.wire.channel import ChannelError, FramedConnection, Message
from sparkdl._internal.wire.messages import (
    MAX_LINE_BYTES,
    SKIPPED_CHECKPOINT_KEY,
    DumpStacks,
    Exited,
    Gang,
    GoAhead,
    Hello,
    LogLine,
    LogLines,
    Metric,
    RankState,
    Stacks,
    Started,
    decode,
)
from sparkdl._internal.wire.trial import OBJECTIVE, REPORT_KEY, Decide

# How long the driver waits for running ranks' stacks before it stops their attempt.
STACKS_WAIT_S = 2.0
log = logging.getLogger(__name__)
_Ask = tuple[tuple[int, int], Callable[[], bool]]


def _ask_over(conn: FramedConnection) -> bool:
    """Asks a Spark task, over its channel, for its rank's stacks."""
    try:
        conn.send(DumpStacks().encode())
        return True
    except (OSError, ChannelError):
        return False


def _order_over(conn: FramedConnection, decision: Decide) -> bool:
    """Sends a Spark task, over its channel, its rank's trial decision."""
    try:
        conn.send(decision.encode())
        return True
    except (OSError, ChannelError):
        return False


class Monitor:
    """Thread-safe; ``cond`` is notified on every change of a rank's state."""

    def __init__(
        self,
        num_workers: int,
        max_attempts: int,
        cfg: RunConfig,
        store: CheckpointStore | None,
        metrics: MetricsLog,
        progress: Progress,
        *,
        first_attempt: int = 0,
        output: RankOutput | None = None,
    ) -> None:
        self.num_workers = num_workers
        # Where every line goes (the run's files, the console): without one, the console only.
        self.output = output if output is not None else RankOutput(None, echo=cfg.echo_logs)
        # The number of the first gang that joins (a relay hub's gang continues the driver's count).
        self.first_attempt = first_attempt
        self.max_attempts = max_attempts
        self.cfg = cfg
        self.store = store
        self.metrics = metrics
        self.progress = progress
        self.cond = threading.Condition()
        self.records: dict[tuple[int, int], RankRecord] = {}
        self.stopping: str | None = None
        self.gave_up: str | None = None
        # (rank, host, what it found) of the first task that did not see the driver's marker in
        # the checkpoint directory: the run stops before training (sparkdl._internal.spark.reach).
        self.unshared: tuple[int, str, str] | None = None
        self.succeeded = False
        self._hellos: dict[Hashable, Hello] = {}
        self._joined: dict[Hashable, tuple[int, int]] = {}
        self._gangs: dict[tuple[int, ...], int] = {}
        self._partial: dict[tuple[int, int, str], list[str]] = {}
        self.cut_chars = 0  # of lines longer than MAX_LINE_BYTES (in characters): what was not kept
        self._start_seq: dict[int, int | None] = {}
        self._judged: set[int] = set()
        self._last_trouble = time.monotonic()
        self._running_since: float | None = None
        # Stacks: how to ask each running rank for them, whom was asked (and when), replies due.
        self._askers: dict[tuple[int, int], Callable[[], bool]] = {}
        self._asked: dict[tuple[int, int], str] = {}
        self._awaited: set[tuple[int, int]] = set()
        # A trial of sparkdl.tune: rank 0's reports go to ``judge`` (step, value -> prune), and
        # each decision to every rank of the attempt, over the connections kept here.
        self.judge: Callable[[int, float], bool | None] | None = None
        self._orders: dict[tuple[int, int], Callable[[Decide], bool]] = {}
        self._decided: dict[int, dict[int, bool]] = {}

    # ---- events ---------------------------------------------------------------------------

    def attempts_seen(self) -> int:
        with self.cond:
            return len(self._gangs)

    def hello(self, key: Hashable, msg: Hello, rank: int = -1) -> None:
        with self.cond:
            self._hellos[key] = msg
            if msg.unshared is not None and self.unshared is None:
                self.unshared = (rank, msg.host, msg.unshared)
            self.cond.notify_all()

    def world_sizes(self) -> list[int]:
        """The number of ranks of each attempt's gang, in order."""
        with self.cond:
            return [len(tids) for tids, _ in sorted(self._gangs.items(), key=lambda item: item[1])]

    def awaiting_gang(self) -> bool:
        """Whether the latest attempt failed and the next gang has not formed yet."""
        with self.cond:
            latest = len(self._gangs) - 1
            return self._running_since is None and any(
                rec.failed for (a, _), rec in self.records.items() if a == latest
            )

    def resize(self, world_size: int, *, grown: bool = False) -> None:
        """The next Spark job runs a gang of ``world_size`` ranks; the stopped job's stop is over.
        An attempt stopped to grow the gang back failed nothing: it adds one to ``max_attempts``."""
        with self.cond:
            self.num_workers = world_size
            self.max_attempts += grown
            self.stopping = None
            self.cond.notify_all()

    def join(self, key: Hashable, rank: int, msg: Gang) -> GoAhead:
        """A task's gang formed: its attempt number, or why it must not run."""
        with self.cond:
            hello = self._hellos.pop(key, None)
            if len(msg.tids) != self.num_workers:
                # A straggler of a Spark job stopped to run the gang on fewer ranks: not an attempt.
                return GoAhead(False, reason=f"the run goes on with {self.num_workers} ranks, not {len(msg.tids)}")
            attempt = self._gangs.setdefault(msg.tids, self.first_attempt + len(self._gangs))
            refuse = self.stopping or (
                f"attempt {attempt} exceeds max_attempts={self.max_attempts}" if attempt >= self.max_attempts else None
            )
            if refuse:
                return GoAhead(False, reason=refuse)
            rec = RankRecord(attempt=attempt, rank=rank, host=hello.host if hello else "?")
            rec.task_pid = hello.task_pid if hello else None
            self.records[(attempt, rank)] = rec
            self._joined[key] = (attempt, rank)
            if sum(1 for (a, _) in self.records if a == attempt) == self.num_workers:
                self._running_since = time.monotonic()
            self.cond.notify_all()
            return GoAhead(True, attempt=attempt)

    def rank_event(self, attempt: int, rank: int, msg: Started | Exited) -> None:
        asks: list[_Ask] = []
        with self.cond:
            rec = self.records[(attempt, rank)]
            if isinstance(msg, Started):
                rec.pid = msg.pid
                rec.state = RankState.RUNNING
            else:
                rec.exit_code, rec.signal = msg.code, msg.signal
                self._awaited.discard((attempt, rank))
                if msg.succeeded:
                    rec.state = RankState.SUCCEEDED
                else:
                    rec.state = RankState.FAILED
                    rec.error, rec.traceback = msg.error, msg.traceback
                    rec.failed_at = time.monotonic()
                    rec.failed_wall = msg.at
                    self._trouble()
                    asks = self._ask_peers(attempt, rank, f"when rank {rank} failed")
            self.cond.notify_all()
        self._send(asks)

    def closed(self, key: Hashable) -> None:
        """A task's connection ended: a rank that had not reported its end is lost."""
        asks: list[_Ask] = []
        with self.cond:
            self._hellos.pop(key, None)
            joined = self._joined.pop(key, None)
            if joined is None:
                return
            self._askers.pop(joined, None)
            self._orders.pop(joined, None)
            self._awaited.discard(joined)
            rec = self.records[joined]
            if rec.state in (RankState.STARTING, RankState.RUNNING) and self.stopping is None:
                rec.state = RankState.LOST
                rec.failed_at = time.monotonic()
                self._trouble()
                asks = self._ask_peers(joined[0], joined[1], f"when rank {joined[1]} was lost")
            self.cond.notify_all()
        self._send(asks)

    def _trouble(self) -> None:
        # A failure ends the attempt; the clock for the next gang to start runs from here.
        self._last_trouble = time.monotonic()
        self._running_since = None

    def log(self, attempt: int, rank: int, msg: LogLine) -> None:
        pkey = (attempt, rank, msg.stream)
        if msg.more:
            # Pieces are joined once, when the line ends: adding each to a string made a line of
            # n pieces cost n squared. A line longer than the task's bound is cut there.
            pieces = self._partial.setdefault(pkey, [])
            if sum(map(len, pieces)) + len(msg.text) <= MAX_LINE_BYTES:
                pieces.append(msg.text)
            else:
                self.cut_chars += len(msg.text)
            return
        line = "".join([*self._partial.pop(pkey, []), msg.text])
        # Without ``cond``: a rank's lines come on its own connection's thread only, which alone
        # writes its tail, and the report reads a list that is always whole. Every channel thread
        # taking the one lock for every line made a gang of 64 spend most of its time waiting on it.
        rec = self.records.get((attempt, rank))
        if rec is not None and self.cfg.log_tail_lines:
            rec.tail.append(line)
            if len(rec.tail) > self.cfg.log_tail_lines:
                del rec.tail[: -self.cfg.log_tail_lines]
        self.output.line(attempt, rank, msg.stream, line)

    def metric(self, attempt: int, rank: int, msg: Metric) -> None:
        # The rank and attempt are the sender's; the record cannot claim others.
        record = {**msg.record, "rank": rank, "attempt": attempt}
        if (skipped := record.pop(SKIPPED_CHECKPOINT_KEY, None)) is not None:  # for the result and report
            if (rec := self.records.get((attempt, rank))) is not None and isinstance(skipped, int):
                rec.skipped.append((skipped, str(record.get("reason", ""))))
            return
        reported = record.pop(REPORT_KEY, None)
        if not record.pop(PROGRESS_KEY, None):  # a step report is for the progress line only
            self.metrics.add(record)
        self.progress.update(record)
        if reported and rank == 0 and self.judge is not None:
            self._decide(attempt, record)

    def _decide(self, attempt: int, record: dict[str, Any]) -> None:
        """Rank 0 of ``attempt`` reported: the study's decision goes to every rank of the attempt
        (those whose rank has not started yet get it when it does, :meth:`order_source`)."""
        step, value = record.get("step"), record.get(OBJECTIVE)
        if not isinstance(step, int) or not isinstance(value, int | float):
            return
        assert self.judge is not None
        try:
            decided = self.judge(step, float(value))
        except Exception as exc:  # the study's storage or pruner failed: the trial goes on
            log.warning("sparkdl: the study could not judge step %d of this trial (it goes on): %s: %s",
                        step, type(exc).__name__, exc)
            decided = False
        if decided is None:  # the study does not prune: the ranks do not wait for decisions
            return
        prune = bool(decided)
        with self.cond:
            self._decided.setdefault(attempt, {})[step] = prune
            sends = [send for (a, _), send in self._orders.items() if a == attempt]
        for send in sends:
            send(Decide(step, prune))

    def order_source(self, attempt: int, rank: int, send: Callable[[Decide], bool]) -> None:
        """How to send a running rank the trial's decisions; it gets those made before at once."""
        with self.cond:
            self._orders[(attempt, rank)] = send
            past = dict(self._decided.get(attempt, {}))
        for step, prune in sorted(past.items()):
            send(Decide(step, prune))

    # ---- the channel ----------------------------------------------------------------------

    def on_message(self, conn: FramedConnection, frame: Message) -> None:
        """A frame from a Spark task (already authenticated): decoded, then handled."""
        env = decode(frame)
        msg = env.message
        if isinstance(msg, Stacks):
            self.stacks(env.attempt, env.rank, msg)
            return
        if isinstance(msg, Started):
            self.stack_source(env.attempt, env.rank, functools.partial(_ask_over, conn))
            if self.judge is not None:
                self.order_source(env.attempt, env.rank, functools.partial(_order_over, conn))
        if isinstance(msg, LogLine):
            self.log(env.attempt, env.rank, msg)
        elif isinstance(msg, LogLines):
            for text in msg.texts:
                self.log(env.attempt, env.rank, LogLine(msg.stream, text))
        elif isinstance(msg, Metric):
            self.metric(env.attempt, env.rank, msg)
        elif isinstance(msg, Hello):
            self.hello(id(conn), msg, env.rank)
        elif isinstance(msg, Gang):
            conn.send(self.join(id(conn), env.rank, msg).encode())
        else:
            self.rank_event(env.attempt, env.rank, msg)

    def on_close(self, conn: FramedConnection, reason: str | None) -> None:
        self.closed(id(conn))

    # ---- stacks of running ranks ----------------------------------------------------------

    def stack_source(self, attempt: int, rank: int, ask: Callable[[], bool]) -> None:
        """How to ask a running rank for its stacks: ``ask()`` sends the request without waiting
        and says whether it went; the reply comes to :meth:`stacks`."""
        with self.cond:
            self._askers[(attempt, rank)] = ask

    def stacks(self, attempt: int, rank: int, msg: Stacks) -> None:
        """A rank's stacks, in reply to a request; anything not asked for is dropped."""
        with self.cond:
            key = (attempt, rank)
            if key not in self._awaited:
                return
            self._awaited.discard(key)
            rec = self.records.get(key)
            if rec is not None and msg.text:
                rec.stack, rec.stack_when = msg.text, self._asked[key]
            self.cond.notify_all()

    def relayed_stacks(self, attempt: int, rank: int, text: str, when: str | None) -> None:
        """A rank's stacks as the relay hub gathered them (sparkdl._internal.driver.relay)."""
        with self.cond:
            rec = self.records.get((attempt, rank))
            if rec is not None and text:
                rec.stack, rec.stack_when = text, when

    def collect_stacks(self, wait_s: float = STACKS_WAIT_S, *, ask: bool = True) -> None:
        """Before the driver stops an attempt: asks every running rank for its stacks (with
        ``ask``), then waits at most ``wait_s`` for the replies due. Call without ``cond`` held."""
        with self.cond:
            running = [key for key, rec in self.records.items() if rec.state is RankState.RUNNING]
            asks = self._ask(running, "when the run was stopped") if ask else []
        self._send(asks)
        deadline = time.monotonic() + wait_s
        with self.cond:
            while self._awaited and (left := deadline - time.monotonic()) > 0:
                self.cond.wait(left)

    def _ask_peers(self, attempt: int, rank: int, when: str) -> list[_Ask]:
        """A rank of ``attempt`` failed: its running peers are asked at once (with ``cond`` held),
        before Spark ends their tasks to rerun the gang."""
        peers = [
            key for key, rec in self.records.items()
            if key[0] == attempt and key[1] != rank and rec.state is RankState.RUNNING
        ]
        return self._ask(peers, when)

    def _ask(self, keys: list[tuple[int, int]], when: str) -> list[_Ask]:
        asks = []
        for key in keys:
            ask = self._askers.get(key)
            if ask is not None and key not in self._asked:
                self._asked[key] = when
                self._awaited.add(key)
                asks.append((key, ask))
        return asks

    def _send(self, asks: list[_Ask]) -> None:
        # Outside the lock: a request is a send on another task's connection.
        for key, ask in asks:
            try:
                sent = ask()
            except Exception:
                sent = False
            if not sent:
                with self.cond:
                    self._awaited.discard(key)
                    self.cond.notify_all()

    # ---- the policy -----------------------------------------------------------------------

    def check(self, job_started: float, slots: policy.Slots | None = None) -> policy.Verdict:
        """The policy's verdict now, given the free task slots (when short); call with ``cond`` held."""
        if self.unshared is not None:
            rank, host, _ = self.unshared
            return policy.Verdict(policy.Decision.STOP, reason=f"rank {rank} on {host} does not share the checkpoint directory")
        for attempt in range(len(self._gangs)):
            if attempt not in self._start_seq:
                self._start_seq[attempt] = self.latest_checkpoint()
        snap = dataclasses.replace(self._snapshot(job_started), slots=slots)
        # The checkpoint store is read only for the failed attempts that can be judged now.
        ready = {v.attempt for v in snap.attempts if policy.ready_to_judge(v, snap, self.cfg)}
        if ready:
            latest = self.latest_checkpoint()
            views = tuple(
                dataclasses.replace(v, progressed=latest != self._start_seq.get(v.attempt)) if v.attempt in ready else v
                for v in snap.attempts
            )
            snap = dataclasses.replace(snap, attempts=views)
        verdict = policy.judge(snap, self.cfg)
        self._judged.update(verdict.judged)
        if verdict.gave_up:
            self.gave_up = verdict.gave_up
        return verdict

    def _snapshot(self, job_started: float) -> policy.Snapshot:
        by_attempt: dict[int, list[RankRecord]] = {a: [] for a in range(len(self._gangs))}
        for (a, _), rec in self.records.items():
            by_attempt.setdefault(a, []).append(rec)
        views = tuple(
            policy.AttemptView(a, tuple(recs), judged=a in self._judged)
            for a, recs in sorted(by_attempt.items())
        )
        return policy.Snapshot(
            now=time.monotonic(),
            job_started=job_started,
            last_trouble=self._last_trouble,
            running_since=self._running_since,
            waiting_tasks=len(self._hellos),
            num_workers=self.num_workers,
            max_attempts=self.max_attempts,
            attempts=views,
        )

    def latest_checkpoint(self) -> int | None:
        """The run's latest complete checkpoint, None when there is none (or it cannot be read now)."""
        if self.store is None:
            return None
        try:
            return self.store.latest()
        except Exception:
            return None

    def sorted_records(self) -> list[RankRecord]:
        with self.cond:
            return sorted(self.records.values(), key=lambda r: (r.attempt, r.rank))
