"""The one exception hierarchy of sparkdl.

Every message names what went wrong, the setting or column involved, and what to do about it.
Exceptions that cross process boundaries define ``__reduce__`` so that they pickle with their
fields intact.
"""

from __future__ import annotations


class SparkDLError(Exception):
    """Base class of every error that sparkdl raises on purpose."""


class ConfigError(SparkDLError, ValueError):
    """A setting, argument or Spark conf is invalid; raised before any Spark task starts."""


class BackendUnavailableError(SparkDLError):
    """The chosen distributed backend cannot run here (not installed, or built without a feature)."""


class InsufficientSlotsError(SparkDLError, RuntimeError):
    """The cluster cannot run all ranks of a gang at once.

    Also a ``RuntimeError``, as every failure of a run is (see :class:`RunFailedError`)."""

    def __init__(self, message: str, *, required: int, available: int) -> None:
        super().__init__(message)
        self.required = required
        self.available = available

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_slots_error, (str(self), self.required, self.available))


def _rebuild_slots_error(message: str, required: int, available: int) -> InsufficientSlotsError:
    return InsufficientSlotsError(message, required=required, available=available)


class RunFailedError(SparkDLError, RuntimeError):
    """A run failed on every attempt it was allowed; ``report`` holds the per-attempt report.

    Also a ``RuntimeError``: Spark's ``TorchDistributor`` and Databricks' ``HorovodRunner`` raise
    one when training fails, so ``except RuntimeError:`` in code written for them still catches it.
    """

    def __init__(self, report: str, *, attempts: int, root_cause: str) -> None:
        super().__init__(report)
        self.report = report
        self.attempts = attempts
        self.root_cause = root_cause

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_run_failed, (self.report, self.attempts, self.root_cause))


def _rebuild_run_failed(report: str, attempts: int, root_cause: str) -> RunFailedError:
    return RunFailedError(report, attempts=attempts, root_cause=root_cause)


class RunTimeoutError(RunFailedError):
    """A run, or the start of its gang, took longer than its configured bound."""

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_run_timeout, (self.report, self.attempts, self.root_cause))


def _rebuild_run_timeout(report: str, attempts: int, root_cause: str) -> RunTimeoutError:
    return RunTimeoutError(report, attempts=attempts, root_cause=root_cause)


class NotInRunError(SparkDLError, RuntimeError):
    """``sparkdl.context()`` was called outside of a function launched by ``sparkdl.run``."""


class TrialPruned(SparkDLError):
    """Raised in a trial's ranks (``sparkdl.tune``) to end the trial as pruned, when
    ``context().report(...)`` or ``context().should_prune()`` said so. Every rank gets the same
    decision at the same step, so every rank raises it there; ``optuna.TrialPruned`` does the same."""


class DatasetError(SparkDLError):
    """Data cannot be read or written as asked: an unreachable URL, missing or inconsistent files,
    or values that cannot become tensors (nulls, arrays of another length than recorded)."""
