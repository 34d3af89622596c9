"""One launcher interface, two ways to run a gang: Spark barrier tasks, or processes on the driver.

A :class:`Launcher` runs every rank of a :class:`Job` until rank 0's return value comes back,
reporting every rank's events to a :class:`~sparkdl._internal.driver.monitor.Monitor`. Both
implementations start ranks the same way (:class:`sparkdl._internal.task.rankproc.RankProcess`), so the
rank's environment, output relay, metrics, clean-up and failure report are the same:

* :class:`sparkdl._internal.driver.spark.SparkLauncher`: a barrier stage of ``num_workers`` tasks followed
  by a shuffle, so Spark reruns the whole gang when a rank fails (``sparkdl.run``);
* :class:`sparkdl._internal.driver.local.LocalLauncher`: processes on the driver, without Spark tasks and
  without reruns (``HorovodRunner(np=-N)``, ``TorchDistributor(local_mode=True)``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.driver.monitor import Monitor
from sparkdl._internal.driver.output import RankOutput, Undelivered, dedupes
from sparkdl._internal.driver.progress import MetricsLog, Progress
from sparkdl._internal.wire.rankspec import RunSpec


@dataclass(frozen=True)
class Job:
    """What a launcher runs: the run, its cloudpickled function, and how many gangs it may try."""

    run: RunSpec
    fn_bytes: bytes
    max_attempts: int


@dataclass(frozen=True)
class Watch:
    """What watches a run on the driver, for either launcher: the monitor of every rank, the
    progress line and the ranks' output (console and files, in ``log_dir``)."""

    monitor: Monitor
    progress: Progress
    output: RankOutput

    @classmethod
    def open(cls, cfg: RunConfig, world_size: int, attempts: int, store: Any, metrics: MetricsLog,
             log_dir: Path) -> Watch:
        progress = Progress(cfg.progress_interval_s, cfg.progress, cfg.straggler_factor)
        output = RankOutput(log_dir, echo=cfg.echo_logs, dedupe=dedupes(cfg.console, world_size), world_size=world_size)
        return cls(Monitor(world_size, attempts, cfg, store, metrics, progress, output=output), progress, output)

    def close(self, cfg: RunConfig) -> Undelivered:
        """Shows the last progress line and writes out the ranks' output, each within
        ``log_flush_timeout_s``, warning about what did not go out; what did not."""
        self.progress.finish(cfg.log_flush_timeout_s)
        undelivered = self.output.close(cfg.log_flush_timeout_s)
        self.output.say(undelivered, cfg.log_flush_timeout_s)
        return undelivered


class Launcher(abc.ABC):
    @abc.abstractmethod
    def launch(self, job: Job, monitor: Monitor) -> bytes:
        """Rank 0's cloudpickled return value; raises a SparkDLError with the failure report."""

    def run(self, job: Job, monitor: Monitor) -> Any:
        """Rank 0's return value."""
        import cloudpickle

        value = cloudpickle.loads(self.launch(job, monitor))
        monitor.succeeded = True
        return value


def pickle_payload(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """``(fn, args, kwargs)`` cloudpickled for the ranks; ConfigError says what cannot travel."""
    import cloudpickle

    try:
        return bytes(cloudpickle.dumps((fn, args, kwargs), protocol=5))
    except Exception as exc:
        raise ConfigError(
            f"fn or its arguments cannot be pickled for the Spark workers: {type(exc).__name__}: {exc}. "
            "Functions sent to workers must not capture a SparkSession, SparkContext, DataFrame, "
            "lock, open file or socket; pass plain values (paths, a sparkdl.Dataset) instead"
        ) from exc
