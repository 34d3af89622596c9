"""The Spark launcher: each attempt of the gang is a barrier ``mapInArrow`` stage and a shuffle.

A barrier *result* stage is never retried, so the stage is followed by a shuffle
(``repartition(1)``): Spark then reruns every task of the stage when any rank fails, up to
``spark.stage.maxConsecutiveAttempts``. The driver watches every rank over an authenticated
channel, stops the job when the failure policy says so, and starts a new job when Spark's stage
attempts ran out before ``max_attempts``. After a failure it also watches the cluster's free task
slots: Spark would wait without end for the slots of a resubmitted barrier stage, so with
``RunConfig.min_workers`` a gang short of slots for ``slot_wait_s`` goes on in a new job with
fewer ranks (and without it, the ``start_timeout_s`` report says which slots are missing).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparkdl.config import RunConfig
from sparkdl.driver import policy
from sparkdl.driver.cluster import executor_error
from sparkdl.driver.launcher import Job, Launcher
from sparkdl.driver.monitor import Monitor
from sparkdl.driver.report import RankRecord, build_report
from sparkdl.errors import (
    ConfigError,
    InsufficientSlotsError,
    RunFailedError,
    RunTimeoutError,
    SparkDLError,
)
from sparkdl.reach import Marker
from sparkdl.spark_api import SparkApi
from sparkdl.storage import redact
from sparkdl.task.main import TaskPayload, task_main
from sparkdl.wire.channel import ChannelServer

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

_RESULT_SCHEMA = "chunk long, data binary"
# How often the driver looks at its ranks' state, and at the cluster's free slots after a failure.
_POLL_S = 0.25
log = logging.getLogger(__name__)


@dataclass
class _Outcome:
    """How one Spark job ended: rank 0's result, or an error and why the driver stopped it."""

    result: bytes | None = None
    error: BaseException | None = None
    verdict: policy.Verdict | None = None


class SparkLauncher(Launcher):
    def __init__(self, session: SparkSession, api: SparkApi, checkpoints: Marker | None = None) -> None:
        self.session = session
        self.api = api
        self.checkpoints = checkpoints

    def launch(self, job: Job, monitor: Monitor) -> bytes:
        cfg = job.run.config
        api = self.api
        secret = secrets.token_bytes(32)
        with api.executor_python(), ChannelServer(api.channel_host(), secret, monitor.on_message, monitor.on_close,
                                                  handshake_timeout_s=cfg.handshake_timeout_s) as server:
            # In local mode the ranks' listeners (TCPStore, gloo) are on loopback too.
            payload = TaskPayload(job.run, job.fn_bytes, secret.hex(), server.address[0], server.address[1],
                                  rank_host="127.0.0.1" if api.local else None, checkpoints=self.checkpoints)
            job_index = 0
            watch = _SlotWatch(api)
            while True:
                outcome = self._run_job(payload, f"sparkdl-{job.run.run_id}-{job_index}", monitor, cfg, watch)
                job_index += 1
                if outcome.result is not None:
                    return outcome.result
                verdict = outcome.verdict
                if verdict is not None and verdict.decision is policy.Decision.RERUN and verdict.world_size:
                    payload = _shrunk(payload, verdict.world_size, job.run.world_size, monitor)
                    continue
                decision = policy.after_job(
                    stopped=outcome.verdict is not None,
                    attempts_used=monitor.attempts_seen(),
                    max_attempts=job.max_attempts,
                )
                if decision is not policy.Decision.RERUN:
                    raise _failure(monitor, outcome, job.max_attempts, python=api.python_exec)

    def _run_job(
        self, payload: TaskPayload, group: str, monitor: Monitor, cfg: RunConfig, watch: _SlotWatch
    ) -> _Outcome:
        session, api = self.session, self.api
        outcome = _Outcome()
        done = threading.Event()
        n = payload.run.world_size

        def job() -> None:
            try:
                api.tag_jobs(group, f"sparkdl.run: {n} ranks")
                df: Any = (
                    session.range(0, n, 1, n)
                    .mapInArrow(functools.partial(task_main, payload), _RESULT_SCHEMA, barrier=True)
                    .repartition(1)
                )
                chunks = _collect_chunks(df)
                if not chunks:
                    raise SparkDLError("rank 0 finished but sent no return value back (internal error)")
                outcome.result = b"".join(data for _, data in chunks)
            except BaseException as exc:
                outcome.error = exc
            finally:
                api.untag_jobs(group)
                done.set()
                with monitor.cond:
                    monitor.cond.notify_all()

        started = time.monotonic()
        thread = _job_thread(api, job, f"sparkdl-job-{group}")
        thread.start()
        try:
            while not done.is_set():
                # Spark is asked outside the lock, which the channel's handlers need.
                slots = watch.poll(group, n, waiting=monitor.awaiting_gang())
                with monitor.cond:
                    verdict = monitor.check(started, slots)
                    if verdict.decision is not policy.Decision.WAIT:
                        outcome.verdict = verdict
                        monitor.stopping = verdict.reason
                        break
                    if not done.is_set():
                        monitor.cond.wait(timeout=_POLL_S)
        except BaseException:
            # Ctrl-C in a notebook or console: stop the gang before giving control back.
            monitor.stopping = "the driver was interrupted"
            api.cancel(group)
            done.wait(cfg.kill_grace_s)
            raise
        if outcome.verdict is not None:
            try:
                # Where each running rank is, for the report, before their tasks are killed (bounded).
                monitor.collect_stacks()
            finally:
                api.cancel(group)
            done.wait(cfg.kill_grace_s)
            outcome.result = None
        else:
            thread.join()
            if outcome.result is None:
                # The stacks the last failure asked for may still be on their way.
                monitor.collect_stacks(ask=False)
        return outcome


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


def _shrunk(payload: TaskPayload, world_size: int, num_workers: int, monitor: Monitor) -> TaskPayload:
    """The payload of a Spark job that runs the next attempt on ``world_size`` ranks."""
    cfg = payload.run.config
    log.warning(
        "sparkdl: attempt %d runs on %d ranks instead of num_workers=%d, RunConfig.min_workers=%s",
        monitor.attempts_seen(), world_size, num_workers, cfg.min_workers,
    )
    monitor.resize(world_size)
    return dataclasses.replace(payload, run=dataclasses.replace(payload.run, world_size=world_size))


def _collect_chunks(df: Any) -> list[tuple[int, bytes]]:
    if hasattr(df, "toArrow"):
        table = df.toArrow()
        return sorted(zip(table.column("chunk").to_pylist(), table.column("data").to_pylist(), strict=True))
    # pyspark 3.5
    batches = df._collect_as_arrow()
    return sorted(pair for b in batches for pair in zip(b.column(0).to_pylist(), b.column(1).to_pylist(), strict=True))


def _spark_error_text(exc: BaseException | None) -> str | None:
    if exc is None:
        return None
    text = str(exc)
    match = re.search(r"(RankFailed|SparkException|Exception)[:\s].*", text)
    return match.group(0) if match else text


def _failure(monitor: Monitor, outcome: _Outcome, max_attempts: int, python: str = "?") -> SparkDLError:
    if monitor.unshared is not None:
        return _unshared(monitor.unshared, monitor.store.url if monitor.store else "?")
    records = monitor.sorted_records()
    spark_error = _spark_error_text(outcome.error)
    verdict = outcome.verdict
    if verdict is not None and verdict.slots is not None:
        return _unschedulable(records, verdict.slots, verdict.reason or "", monitor.attempts_seen())
    timed_out = verdict is not None and verdict.timed_out
    stop_reason = verdict.reason if verdict is not None else None
    if not records:
        # The executor's own Python error, not Spark's wrapper of it ("Exception thrown in awaitResult").
        error = executor_error(outcome.error)
        if error is not None and ("ModuleNotFoundError" in error or "ImportError" in error):
            return ConfigError(
                f"the executors' Python ({python}) cannot run sparkdl: {error}. Install sparkdl, torch "
                "and pyarrow where the executors run, or point spark.pyspark.python (PYSPARK_PYTHON) "
                "at an interpreter that has them on every executor host"
            )
        if timed_out and stop_reason:
            return RunTimeoutError(f"sparkdl.run stopped: {stop_reason}", attempts=0, root_cause=stop_reason)
        cause = f"the executor's Python raised {error} ({python})" if error else spark_error
        return RunFailedError(
            f"sparkdl.run failed before any rank started: {cause}", attempts=0, root_cause=str(error or spark_error)
        )
    attempts = monitor.attempts_seen()
    if timed_out and stop_reason:
        headline = f"sparkdl.run stopped on attempt {attempts - 1}: {stop_reason}."
        hint = "Raise the bound named above if the run needs longer."
        report, _ = build_report(records, headline=headline, hint=hint, spark_error=None)
        return RunTimeoutError(report, attempts=attempts, root_cause=stop_reason)
    headline = f"sparkdl.run failed after {attempts} attempt(s) of the gang (max_attempts={max_attempts})."
    if monitor.gave_up:
        headline += (
            f" It stopped early: {monitor.gave_up}. To rerun anyway, set "
            "RunConfig(stop_on_repeated_error=False)."
        )
    hint = (
        "Fix the root cause above; to allow more reruns of the gang, raise max_attempts "
        f"(now {max_attempts})."
    )
    report, root = build_report(records, headline=headline, hint=hint)
    return RunFailedError(report, attempts=attempts, root_cause=root)


def _unschedulable(records: list[RankRecord], slots: policy.Slots, reason: str, attempts: int) -> SparkDLError:
    headline = f"sparkdl.run stopped after attempt {attempts - 1} failed: {reason}."
    hint = (
        "Add executors (or free the slots other jobs hold), lower RunConfig.min_workers, or raise "
        "RunConfig.slot_wait_s if lost executors take longer to be replaced."
    )
    report, _ = build_report(records, headline=headline, hint=hint)
    return InsufficientSlotsError(report, required=slots.needed, available=slots.free)


def _unshared(unshared: tuple[int, str, str], url: str) -> ConfigError:
    rank, host, found = unshared
    return ConfigError(
        f"sparkdl.run stopped before training: the checkpoint directory {redact(url)} is not shared by the "
        f"driver and the executors. The driver wrote a marker there, but the task of rank {rank} on {host} "
        f"does not see it: {found}. Checkpoints written there would stay on each host's own disk, and a "
        "rerun would resume from nothing. Pass checkpoint_dir= (TorchEstimator: checkpointDir) on storage "
        "that the driver and every executor reach (a shared mount, hdfs://, s3://...), or set "
        "spark.sparkdl.runDir to such storage: runs without checkpoint_dir keep their checkpoints under "
        "it, and without it under the driver's temp dir, which only local modes share"
    )
