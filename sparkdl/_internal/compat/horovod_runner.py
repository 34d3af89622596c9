"""The drop-in for Databricks' ``HorovodRunner`` (exported as :class:`sparkdl.HorovodRunner`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sparkdl._internal.common.calls import bind_kwargs, check_call
from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.common.validate import is_int

LOG_VERBOSITIES = ("log_callback_only", "all")


class HorovodRunner:
    """Runs Horovod training code on gang-scheduled Spark workers, like Databricks' HorovodRunner.

    Args:
        np: ``np > 0``: that many workers on the cluster, one Spark task slot each;
            ``np < 0``: ``-np`` processes on the driver alone, for development, with their output
            shown in the notebook or console. ``np = 0`` (deprecated on Databricks) is refused.
        driver_log_verbosity: ``"log_callback_only"`` or ``"all"``, accepted for compatibility;
            every rank's output is always shown.
        config: sparkdl's bounds and settings (:class:`sparkdl.RunConfig`).

    Example::

        def train(lr):
            import horovod.torch as hvd
            hvd.init()
            ...
            return model.state_dict()

        state = HorovodRunner(np=2).run(train, lr=0.1)
    """

    def __init__(self, *, np: int, driver_log_verbosity: str = "log_callback_only",
                 config: RunConfig | None = None) -> None:
        if not is_int(np) or np == 0:
            raise ConfigError(
                f"HorovodRunner(np={np!r}): np must be a non-zero integer: np > 0 runs np workers on "
                "the cluster, np < 0 runs -np processes on the driver"
            )
        if driver_log_verbosity not in LOG_VERBOSITIES:
            raise ConfigError(
                f"HorovodRunner(driver_log_verbosity={driver_log_verbosity!r}): must be "
                "'log_callback_only' or 'all' (sparkdl shows every rank's output either way)"
            )
        self.num_processor = np
        self.driver_log_verbosity = driver_log_verbosity
        self._config = config

    def run(self, main: Callable[..., Any], **kwargs: Any) -> Any:
        """Runs ``main(**kwargs)`` on every process; returns the value of the first process (rank 0).

        Raises ``TypeError`` before anything starts when ``main`` cannot take ``kwargs``, as
        Databricks' HorovodRunner does.
        """
        check_call("HorovodRunner.run", main, kwargs)
        if self.num_processor < 0:
            from sparkdl._internal.driver.local import run_on_driver

            return run_on_driver(main, (), kwargs, num_processes=-self.num_processor, backend="horovod",
                                 config=self._config)
        from sparkdl._internal.driver.run import run

        return run(bind_kwargs(main, kwargs), num_workers=self.num_processor, backend="horovod", config=self._config)
