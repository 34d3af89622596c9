"""The Spark launcher: each attempt of the gang is a barrier ``mapInArrow`` stage and a shuffle.

A barrier *result* stage is never retried, so the stage is followed by a shuffle
(``repartition(1)``): Spark then reruns every task of the stage when any rank fails, up to
``spark.stage.maxConsecutiveAttempts``. The driver watches every rank over an authenticated
channel, stops the job when the failure policy says so, and starts a new job when Spark's stage
attempts ran out before ``max_attempts``. After a failure it also watches the cluster's free task
slots: Spark would wait without end for the slots of a resubmitted barrier stage, so with
``RunConfig.min_workers`` a gang short of slots for ``slot_wait_s`` goes on in a new job with
fewer ranks (and without it, the ``start_timeout_s`` report says which slots are missing).
While a shrunk gang runs, the driver watches for the slots to come back: once they are, the
attempt is stopped right after its next checkpoint is committed, and a new job runs the gang on
``num_workers`` ranks again from that checkpoint (:class:`_GrowWatch`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import (
    SparkDLError,
)
from sparkdl._internal.driver import policy, relay
from sparkdl._internal.driver.failure import failure, slots_refused, too_few_slots
from sparkdl._internal.driver.launcher import Job, Launcher
from sparkdl._internal.driver.monitor import Monitor
from sparkdl._internal.spark.reach import Marker
from sparkdl._internal.spark.spark_api import SparkApi
from sparkdl._internal.task.entry import TaskPayload, task_main
from sparkdl._internal.wire import result_chunks
from sparkdl._internal.wire.rankspec import RunSpec
from sparkdl._internal.wire.server import ChannelServer

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# How often the driver looks at its ranks' state, and at the cluster's free slots after a failure.
_POLL_S = 0.25
# How often a Spark Connect server is asked whether it is there, and how long it may not answer.
_SERVER_POLL_S = 2.0
_SERVER_DOWN_S = 10.0
# Once a Spark job ended, the longest wait for its tasks' connections to be read to their end.
_DRAIN_S = 10.0
# How often a shrunk gang's driver asks for free slots, then for a newer checkpoint, to grow it back.
_GROW_POLL_S = 1.0
log = logging.getLogger(__name__)


@dataclass
class _Outcome:
    """How one Spark job ended: rank 0's result, or an error and why the driver stopped it."""

    result: bytes | None = None
    error: BaseException | None = None
    verdict: policy.Verdict | None = None
    # The attempt as the relay hub recorded it, when the ranks could not reach this driver.
    relayed: relay.Replayed | None = None
    # Why the Spark Connect server is taken for gone (it refuses connections), when it is.
    gone: str | None = None


class SparkLauncher(Launcher):
    def __init__(self, session: SparkSession, api: SparkApi, checkpoints: Marker | None = None,
                 stop: threading.Event | None = None) -> None:
        self.session = session
        self.api = api
        self.checkpoints = checkpoints
        # Set from another thread (a search stopping its trials): the run stops as on Ctrl-C.
        self.stop = stop

    def launch(self, job: Job, monitor: Monitor) -> bytes:
        cfg = job.run.config
        api = self.api
        secret = secrets.token_bytes(32)
        with api.executor_python(), ChannelServer(api.channel_host(), secret, monitor.on_message, monitor.on_close,
                                                  handshake_timeout_s=cfg.handshake_timeout_s) as server:
            # In local mode the ranks' listeners (TCPStore, gloo) are on loopback too.
            mode = api.channel_mode()
            said = False
            payload = TaskPayload(job.run, job.fn_bytes, secret.hex(), server.address[0], server.address[1],
                                  rank_host="127.0.0.1" if api.local else None, checkpoints=self.checkpoints,
                                  channel=mode, hub=relay.Hub if mode != "direct" else None)
            job_index = 0
            watch = _SlotWatch(api)
            slots_until = time.monotonic() + cfg.slot_wait_s
            try:
                while True:
                    before = monitor.attempts_seen()
                    payload = dataclasses.replace(payload, first_attempt=before)
                    grow = _GrowWatch(api, monitor, job.run) if payload.run.world_size < job.run.world_size else None
                    outcome = self._run_job(payload, f"sparkdl-{job.run.run_id}-{job_index}", monitor, cfg, watch, grow)
                    job_index += 1
                    if outcome.relayed is not None and not said:
                        said = True
                        host, port = server.address
                        why = "reported through Spark" if mode == "relay" else f"could not reach this driver at {host}:{port}"
                        log.warning("sparkdl: the ranks %s: their output and ends came back through Spark at the end "
                                    "of each attempt (spark.sparkdl.channel=%s)", why, mode)
                    if outcome.result is not None:
                        return outcome.result
                    step = policy.next_job(policy.JobEnd(
                        now=time.monotonic(), attempts_before=before, attempts_after=monitor.attempts_seen(),
                        verdict=outcome.verdict, slots_refused=slots_refused(outcome.error), slots_until=slots_until,
                        max_attempts=job.max_attempts,
                    ))
                    if step.action is policy.Next.RETRY:
                        if job_index == 1:
                            log.warning("sparkdl: Spark refused the gang's barrier stage: the cluster has fewer "
                                        "than %d task slots yet (executors still registering?); submitting it "
                                        "again until slot_wait_s=%g s", job.run.tasks, cfg.slot_wait_s)
                        time.sleep(policy.SLOTS_RETRY_S)
                    elif step.action is policy.Next.TOO_FEW_SLOTS:
                        raise too_few_slots(job.run.world_size, job.run.tasks, cfg.slot_wait_s, api.master)
                    elif step.action is policy.Next.RESIZE:
                        payload = _resized(payload, step.world_size or job.run.world_size, job.run.world_size, monitor)
                    elif step.action is policy.Next.FAIL:
                        raise failure(monitor, outcome.error, outcome.verdict, job.max_attempts, api.python_exec, outcome.gone)
            finally:
                # Every task closed its connection before its Spark task ended: what the ranks
                # printed last is read (and written out) before the server cuts what is left.
                if left := server.drain(_DRAIN_S):
                    log.warning("sparkdl: %d task connection(s) still open %g s after the job ended were "
                                "closed; their last lines may be missing", left, _DRAIN_S)

    def _run_job(
        self, payload: TaskPayload, group: str, monitor: Monitor, cfg: RunConfig, watch: _SlotWatch,
        grow: _GrowWatch | None,
    ) -> _Outcome:
        session, api = self.session, self.api
        outcome = _Outcome()
        done = threading.Event()
        n = payload.run.tasks

        def job() -> None:
            try:
                api.tag_jobs(group, f"sparkdl.run: {payload.run.world_size} ranks")
                df: Any = (
                    session.range(0, n, 1, n)
                    .mapInArrow(functools.partial(task_main, payload), result_chunks.SCHEMA, barrier=True)
                    .repartition(1)
                )
                result, record = result_chunks.join(_collect_chunks(df))
                if record:  # the relay hub's record of the attempt (sparkdl._internal.driver.relay)
                    outcome.relayed = relay.replay(record, bytes.fromhex(payload.secret_hex), payload.run.run_id,
                                                   payload.first_attempt, monitor)
                if result is not None:
                    outcome.result = result
                elif not record:
                    raise SparkDLError("rank 0 finished but sent no return value back (internal error)")
            except BaseException as exc:
                outcome.error = exc
            finally:
                api.untag_jobs(group)
                done.set()
                with monitor.cond:
                    monitor.cond.notify_all()

        started = time.monotonic()
        gangs = monitor.attempts_seen()
        server = _ServerWatch(api)
        thread = _job_thread(api, job, f"sparkdl-job-{group}")
        thread.start()
        try:
            while not done.is_set():
                # No gang reported in this job: it may report through its relay hub, at its end.
                quiet = payload.channel != "direct" and monitor.attempts_seen() == gangs
                # Spark is asked outside the lock, which the channel's handlers need.
                waiting = monitor.awaiting_gang()
                slots = watch.poll(group, n, waiting=waiting)
                grown = grow.poll(group, running=monitor.attempts_seen() > gangs and not waiting) if grow else None
                outcome.gone = server.poll(quiet or waiting)
                with monitor.cond:
                    if outcome.gone is not None:
                        verdict = policy.Verdict(policy.Decision.STOP, outcome.gone)
                    elif quiet:
                        verdict = policy.blind(time.monotonic() - started, relay.blind_bound(cfg))
                    else:
                        verdict = monitor.check(started, slots)
                    verdict = policy.with_growth(verdict, grown)
                    if verdict.decision is not policy.Decision.WAIT:
                        outcome.verdict = verdict
                        monitor.stopping = verdict.reason
                        break
                    if not done.is_set():
                        monitor.cond.wait(timeout=_POLL_S)
                if self.stop is not None and self.stop.is_set():
                    raise KeyboardInterrupt("the run was stopped from another thread of the driver")
        except BaseException:
            # Ctrl-C in a notebook or console: stop the gang before giving control back.
            monitor.stopping = "the driver was interrupted"
            _cancel(api, group, cfg.kill_grace_s)
            done.wait(cfg.kill_grace_s)
            raise
        if outcome.gone is not None:
            # Nothing to cancel: the job went with the server. Its call may retry for minutes.
            abandon = threading.Thread(target=api.abandon, name="sparkdl-abandon", daemon=True)
            abandon.start()
            abandon.join(cfg.kill_grace_s)
            done.wait(cfg.kill_grace_s)
            outcome.result = None
        elif outcome.verdict is not None:
            try:
                # Where each running rank is, for the report, before their tasks are killed (bounded).
                if not (outcome.verdict.world_size or 0) > payload.run.world_size:  # not a grow-back
                    monitor.collect_stacks()
            finally:
                _cancel(api, group, cfg.kill_grace_s)
            done.wait(cfg.kill_grace_s)
            outcome.result = None
        else:
            thread.join()
            if outcome.result is None and outcome.relayed is None:
                # The stacks the last failure asked for may still be on their way.
                monitor.collect_stacks(ask=False)
            elif outcome.result is None and outcome.relayed is not None:
                with monitor.cond:
                    replayed = monitor.check(started)
                outcome.verdict = policy.after_relay(outcome.relayed.stop, outcome.relayed.timed_out, replayed)
        return outcome


class _ServerWatch:
    """Whether a Spark Connect server is gone, asked while the driver hears nothing from a gang
    (its ranks were lost, or report only at their end): a server that has not answered for
    :data:`_SERVER_DOWN_S` is taken for gone, and the ranks with it. Spark Connect's client itself
    retries for minutes before the job's own call fails."""

    def __init__(self, api: SparkApi) -> None:
        self._api = api
        self._down_since: float | None = None
        self._asked = 0.0

    def poll(self, listening: bool) -> str | None:
        now = time.monotonic()
        if not self._api.remote or not listening:
            self._down_since = None
            return None
        if now - self._asked < _SERVER_POLL_S:
            return None
        self._asked = now
        why = self._api.server_down()
        if why is None:
            self._down_since = None
            return None
        self._down_since = self._down_since or now
        return why if now - self._down_since >= _SERVER_DOWN_S else None


def _cancel(api: SparkApi, group: str, wait_s: float) -> None:
    """Cancels the job, within ``wait_s`` (over Spark Connect a call may retry for minutes)."""
    thread = threading.Thread(target=api.cancel, args=(group,), name="sparkdl-cancel", daemon=True)
    thread.start()
    thread.join(wait_s)


class _SlotWatch:
    """The free task slots while a gang waits to be scheduled after a failure, and since when
    they have been too few: Spark itself would wait for them without end (a barrier stage
    resubmitted after a failure launches only once all its slots are free at once)."""

    def __init__(self, api: SparkApi) -> None:
        self._api = api
        self._gang: tuple[str, int] | None = None
        self._short: policy.Slots | None = None
        self._polled = 0.0

    def poll(self, group: str, needed: int, *, waiting: bool) -> policy.Slots | None:
        """The slots when too few for ``needed`` ranks; ``waiting``: a gang waits after a failure."""
        now = time.monotonic()
        if not waiting:
            self._short = None
            return None
        if (group, needed) != self._gang:
            # Another Spark job, or a gang of another size: its slots are counted afresh.
            self._gang, self._short, self._polled = (group, needed), None, 0.0
        if now - self._polled < _POLL_S:
            return self._short
        self._polled = now
        free = self._api.free_slots(group)
        if free is None or free >= needed:
            self._short = None
        else:
            since = self._short.short_since if self._short is not None else now
            self._short = policy.Slots(needed, free, short_since=since)
        return self._short


def _job_thread(api: SparkApi, target: Any, name: str) -> threading.Thread:
    """The thread that submits a Spark job: on a classic session an InheritableThread, which
    carries the job group and local properties in pyspark's pinned-thread mode."""
    if api.remote:
        return threading.Thread(target=target, name=name, daemon=True)
    from pyspark import InheritableThread

    thread: threading.Thread = InheritableThread(target=target, name=name, daemon=True)
    return thread


class _GrowWatch:
    """While a gang runs on fewer than ``num_workers`` ranks: asks the cluster for free slots
    every :data:`_GROW_POLL_S`, and the policy (:func:`policy.grow_back`) when to grow the gang
    back. Never, for a run without checkpoints."""

    def __init__(self, api: SparkApi, monitor: Monitor, run: RunSpec) -> None:
        self._api, self._monitor = api, monitor
        self._num_workers, self._tasks = run.world_size, run.tasks
        self._polled = 0.0
        self._state = policy.GrowState()

    def poll(self, group: str, *, running: bool) -> int | None:
        now = time.monotonic()
        if not running or self._monitor.store is None or now - self._polled < _GROW_POLL_S:
            return None
        self._polled = now
        free = self._api.free_slots(group)  # ours included: the slots this gang holds count as free
        was = self._state
        self._state, grow_to = policy.grow_back(was, free=free, tasks=self._tasks, num_workers=self._num_workers,
                                                latest=self._monitor.latest_checkpoint)
        if was.back_at is None and self._state.back_at is not None:
            log.warning("sparkdl: the cluster has %d free task slots again: the gang grows back to "
                        "num_workers=%d ranks after its next checkpoint", free, self._num_workers)
        return grow_to


def _resized(payload: TaskPayload, world_size: int, num_workers: int, monitor: Monitor) -> TaskPayload:
    """The payload of a Spark job that runs the next attempt on ``world_size`` ranks: fewer than
    ``num_workers`` after a failure (``RunConfig.min_workers``), or ``num_workers`` again."""
    cfg = payload.run.config
    grown = world_size > payload.run.world_size
    if grown:
        log.warning("sparkdl: attempt %d runs on num_workers=%d ranks again, from checkpoint %s",
                    monitor.attempts_seen(), world_size, monitor.latest_checkpoint())
    else:
        log.warning(
            "sparkdl: attempt %d runs on %d ranks instead of num_workers=%d, RunConfig.min_workers=%s",
            monitor.attempts_seen(), world_size, num_workers, cfg.min_workers,
        )
    monitor.resize(world_size, grown=grown)
    return dataclasses.replace(payload, run=dataclasses.replace(payload.run, world_size=world_size))


def _collect_chunks(df: Any) -> list[tuple[int, bytes]]:
    if hasattr(df, "toArrow"):
        table = df.toArrow()
        return list(zip(table.column("chunk").to_pylist(), table.column("data").to_pylist(), strict=True))
    # pyspark 3.5
    batches = df._collect_as_arrow()
    return [pair for b in batches for pair in zip(b.column(0).to_pylist(), b.column(1).to_pylist(), strict=True)]
