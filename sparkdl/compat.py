"""Drop-in replacements for Databricks' ``HorovodRunner`` and Spark's ``TorchDistributor``.

Change one import and existing code runs on sparkdl, with gang rerun, live rank-tagged logs,
time bounds and the failure report::

    # from sparkdl import HorovodRunner          (was: from sparkdl import HorovodRunner)
    # from sparkdl import TorchDistributor       (was: from pyspark.ml.torch.distributor import TorchDistributor)
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sparkdl.config import RunConfig
from sparkdl.errors import ConfigError


class HorovodRunner:
    """Runs Horovod training code on gang-scheduled Spark workers, like Databricks' HorovodRunner.

    Args:
        np: ``np > 0``: that many workers on the cluster, one Spark task slot each;
            ``np < 0``: ``-np`` processes on the driver alone, for development, with their output
            shown in the notebook or console. ``np = 0`` is refused.
        driver_log_verbosity: accepted for compatibility; every rank's output is always shown.
        config: sparkdl's bounds and settings (:class:`sparkdl.RunConfig`).

    Example::

        def train(lr):
            import horovod.torch as hvd
            hvd.init()
            ...
            return model.state_dict()

        state = HorovodRunner(np=2).run(train, lr=0.1)
    """

    def __init__(self, *, np: int, driver_log_verbosity: str = "all", config: RunConfig | None = None) -> None:
        if isinstance(np, bool) or not isinstance(np, int) or np == 0:
            raise ConfigError(
                f"HorovodRunner(np={np!r}): np must be a non-zero integer: np > 0 runs np workers on "
                "the cluster, np < 0 runs -np processes on the driver"
            )
        self.num_processor = np
        self.driver_log_verbosity = driver_log_verbosity
        self._config = config

    def run(self, main: Callable[..., Any], **kwargs: Any) -> Any:
        """Runs ``main(**kwargs)`` on every process; returns the value of the first process (rank 0)."""
        if self.num_processor < 0:
            from sparkdl.driver.local import run_on_driver

            return run_on_driver(main, (), kwargs, num_processes=-self.num_processor, backend="horovod",
                                 config=self._config)
        from sparkdl.driver.run import run

        return run(main, num_workers=self.num_processor, backend="horovod", config=self._config, **kwargs)


class TorchDistributor:
    """Runs torch.distributed code like ``pyspark.ml.torch.distributor.TorchDistributor``, on sparkdl.

    Args:
        num_processes: processes (ranks) in all.
        local_mode: True: the processes run on the driver; False: on gang-scheduled Spark workers,
            one task slot each (and, unlike Spark's class, the gang reruns when a rank fails).
        use_gpu: give each process one GPU; on a cluster this needs
            ``spark.task.resource.gpu.amount``, in local mode ``spark.driver.resource.gpu.amount``.
        config: sparkdl's bounds and settings (:class:`sparkdl.RunConfig`).

    Example::

        def train(lr):
            import torch.distributed as dist
            dist.init_process_group("gloo")
            ...
            return model.state_dict()

        state = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(train, 0.1)
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run("train.py", "--lr", "0.1")
    """

    def __init__(
        self,
        num_processes: int = 1,
        local_mode: bool = True,
        use_gpu: bool = True,
        *,
        config: RunConfig | None = None,
    ) -> None:
        if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
            raise ConfigError(f"TorchDistributor(num_processes={num_processes!r}): must be an integer >= 1")
        self.num_processes = num_processes
        self.local_mode = local_mode
        self.use_gpu = use_gpu
        self._config = config

    def run(self, train_object: Callable[..., Any] | str, *args: Any) -> Any:
        """Runs ``train_object``: a function (returns rank 0's value) or a script path with its arguments (returns None)."""
        if isinstance(train_object, str):
            source = Path(train_object).read_text()
            fn: Callable[..., Any] = run_script_source
            call_args: tuple[Any, ...] = (source, train_object, [str(a) for a in args])
        else:
            fn, call_args = train_object, args
        if self.local_mode:
            from sparkdl.driver.local import run_on_driver

            return run_on_driver(fn, call_args, {}, num_processes=self.num_processes, backend="torch",
                                 gpu_ids=_driver_gpus(self.num_processes) if self.use_gpu else None,
                                 config=self._config)
        from sparkdl.driver.run import run

        return run(fn, *call_args, num_workers=self.num_processes, backend="torch", use_gpu=self.use_gpu,
                   config=self._config)


def _driver_gpus(num_processes: int) -> list[str]:
    from pyspark.sql import SparkSession

    session = SparkSession.getActiveSession()
    conf = session.sparkContext.getConf() if session is not None else None
    if conf is None or not conf.get("spark.driver.resource.gpu.amount", None):
        raise ConfigError(
            "TorchDistributor(local_mode=True, use_gpu=True) needs the driver's GPUs, but "
            "'spark.driver.resource.gpu.amount' is unset; set it and "
            "spark.driver.resource.gpu.discoveryScript (conf/gpu-discovery.sh), or pass use_gpu=False"
        )
    assert session is not None
    resources = session.sparkContext.resources
    return list(resources["gpu"].addresses) if "gpu" in resources else []


def run_script_source(source: str, filename: str, argv: list[str]) -> None:
    """Runs a training script's source as ``__main__`` with ``sys.argv``, as torchrun would.

    The source travels from the driver, so the script need not exist on the executors.
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sparkdl-script-") as tmp:
        path = os.path.join(tmp, os.path.basename(filename) or "script.py")
        Path(path).write_text(source)
        saved = sys.argv
        sys.argv = [filename, *argv]
        try:
            runpy.run_path(path, run_name="__main__")
        finally:
            sys.argv = saved
