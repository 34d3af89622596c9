"""Why a run failed, as the error it raises: from the monitor's records of every attempt and the
verdict (or Spark's error) that ended its last Spark job (:func:`failure`), or that stopped its
ranks on the driver (:func:`failure_on_driver`); the reports of both launchers are built here."""

from __future__ import annotations

import re

from sparkdl._internal.common.errors import (
    ConfigError,
    InsufficientSlotsError,
    RunFailedError,
    RunTimeoutError,
    SparkDLError,
)
from sparkdl._internal.driver import policy
from sparkdl._internal.driver.cluster import executor_error
from sparkdl._internal.driver.monitor import Monitor
from sparkdl._internal.driver.report import RankRecord, build_report
from sparkdl._internal.spark.reach import not_shared


def _spark_error_text(exc: BaseException | None) -> str | None:
    if exc is None:
        return None
    text = str(exc)
    match = re.search(r"(RankFailed|SparkException|Exception)[:\s].*", text)
    return match.group(0) if match else text


def failure(monitor: Monitor, error: BaseException | None, verdict: policy.Verdict | None, max_attempts: int,
            python: str = "?", gone: str | None = None) -> SparkDLError:
    """The error a run raises when its last Spark job ended without rank 0's result."""
    if monitor.unshared is not None:
        return _unshared(monitor.unshared, monitor.store.url if monitor.store else "?")
    records = monitor.sorted_records()
    spark_error = _spark_error_text(error)
    if verdict is not None and verdict.slots is not None:
        return _unschedulable(records, verdict.slots, verdict.reason or "", monitor.attempts_seen())
    timed_out = verdict is not None and verdict.timed_out
    stop_reason = verdict.reason if verdict is not None else None
    if not records:
        # The executor's own Python error, not Spark's wrapper of it ("Exception thrown in awaitResult").
        found = executor_error(error)
        if found is not None and ("ModuleNotFoundError" in found or "ImportError" in found):
            return ConfigError(
                f"the executors' Python ({python}) cannot run sparkdl: {found}. Install sparkdl, torch "
                "and pyarrow where the executors run, or point spark.pyspark.python (PYSPARK_PYTHON) "
                "at an interpreter that has them on every executor host"
            )
        if timed_out and stop_reason:
            return RunTimeoutError(f"sparkdl.run stopped: {stop_reason}", attempts=0, root_cause=stop_reason)
        cause = f"the executor's Python raised {found} ({python})" if found else spark_error
        return RunFailedError(
            f"sparkdl.run failed before any rank started: {cause}", attempts=0, root_cause=str(found or spark_error)
        )
    attempts = monitor.attempts_seen()
    if gone is not None:
        headline = f"sparkdl.run stopped on attempt {attempts - 1}: {gone}."
        hint = "The run's ranks ended with its Spark application; start the run again once the server is back."
        report, root = build_report(records, headline=headline, hint=hint)
        return RunFailedError(report, attempts=attempts, root_cause=gone)
    if timed_out and stop_reason:
        headline = f"sparkdl.run stopped on attempt {attempts - 1}: {stop_reason}."
        hint = "Raise the bound named above if the run needs longer."
        if stragglers := monitor.progress.stragglers():
            hint = f"{stragglers}\n{hint}"
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
    if stragglers := monitor.progress.stragglers():
        hint = f"{stragglers}\n{hint}"
    report, root = build_report(records, headline=headline, hint=hint)
    return RunFailedError(report, attempts=attempts, root_cause=root)


def failure_on_driver(monitor: Monitor, verdict: policy.Verdict, processes: int, timeout_s: float | None) -> SparkDLError:
    """The error a run of ``processes`` ranks on the driver raises (no reruns there) when the
    policy stopped it with ``verdict``."""
    records = monitor.sorted_records()
    if verdict.timed_out:
        why = f"the run on the driver took longer than timeout_s={timeout_s:g} s (RunConfig.timeout_s)"
        report, _ = build_report(records, headline=f"sparkdl stopped: {why}.", hint="Raise timeout_s if the run needs longer.")
        return RunTimeoutError(report, attempts=1, root_cause=why)
    report, root = build_report(
        records,
        headline=f"the run on the driver failed ({processes} local processes; no reruns on the driver).",
        hint="Fix the root cause above; on a cluster, sparkdl.run reruns failed gangs.",
    )
    return RunFailedError(report, attempts=1, root_cause=root)


# Spark's BarrierJobSlotsNumberCheckFailed: a barrier stage needs more slots than the cluster has.
_SLOTS_CHECK = "SPARK-24819"


def slots_refused(error: BaseException | None) -> bool:
    """Whether Spark refused a job's barrier stage because the cluster has too few task slots."""
    return error is not None and _SLOTS_CHECK in str(error)


def too_few_slots(num_workers: int, tasks: int, waited_s: float, master: str) -> InsufficientSlotsError:
    """The error when Spark refused the gang's barrier stage (``tasks`` slots) for too few slots for ``waited_s``."""
    return InsufficientSlotsError(
        f"num_workers={num_workers} needs {tasks} task slots at once, but Spark refused the gang's "
        f"barrier stage for too few slots ({_SLOTS_CHECK}) for slot_wait_s={waited_s:g} s (master {master}). "
        "If executors are still starting, raise RunConfig.slot_wait_s; otherwise lower num_workers, or add "
        "executors or cores (spark.executor.instances, spark.executor.cores), or lower spark.task.cpus "
        "or spark.task.resource.gpu.amount",
        required=tasks,
        available=0,  # Spark does not say how many it found
    )


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
    return ConfigError(not_shared(url, rank, host, found, outcome="sparkdl.run stopped before training"))
