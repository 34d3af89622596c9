"""The drop-in for Spark's ``TorchDistributor`` (exported as :class:`sparkdl.TorchDistributor`), and
how it runs a script (:func:`run_script_source`). The other drop-ins: ``HorovodRunner`` in
:mod:`sparkdl._internal.compat.horovod_runner`, ``MirroredStrategyRunner`` in
:mod:`sparkdl._internal.compat.tf_distributor`; :mod:`sparkdl.compat` exports all three.

The drop-ins refuse what the originals refuse, with exceptions of the same built-in types, at the same
point: a bad setting or Spark conf at construction, arguments a script cannot take at ``run``.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sparkdl._internal.common.calls import bind_kwargs
from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.common.validate import is_int
from sparkdl._internal.compat.gpus import (
    DRIVER_GPU_CONF,
    TASK_GPU_CONF,
    GpuConfigError,
    active_session,
    driver_gpus,
    tasks_of,
    whole_gpus,
)
from sparkdl._internal.spark.spark_api import is_remote

log = logging.getLogger(__name__)

class TorchDistributor:
    """Runs torch.distributed code like ``pyspark.ml.torch.distributor.TorchDistributor``, on sparkdl.

    Args:
        num_processes: processes (ranks) in all.
        local_mode: True: the processes run on the driver; False: on gang-scheduled Spark workers,
            one task slot each (and, unlike Spark's class, the gang reruns when a rank fails).
        use_gpu: give each process one GPU; on a cluster this needs
            ``spark.task.resource.gpu.amount``, in local mode ``spark.driver.resource.gpu.amount``.
            As in Spark's class, with ``spark.task.resource.gpu.amount=P`` a run is
            ``num_processes / P`` Spark tasks of P processes each (``RunConfig.processes_per_task``):
            every process sees its task's P GPUs and takes ``cuda:LOCAL_RANK``.
            As in Spark's class, local mode lowers ``num_processes`` to the driver's GPUs.
        config: sparkdl's bounds and settings (:class:`sparkdl.RunConfig`).

    Raises:
        GpuConfigError: (a ``ConfigError`` and a ``RuntimeError``) ``use_gpu=True`` and the active
            session's GPU confs are unset, or ``num_processes`` is not a multiple of
            ``spark.task.resource.gpu.amount``.
        ConfigError: (a ``ValueError``) ``num_processes`` is not an integer >= 1 ("has to be a
            positive integer", in Spark's words too).

    Attributes:
        input_params: ``num_processes``, ``local_mode``, ``use_gpu`` and ``num_tasks``, as in
            Spark's class.

    Example::

        def train(lr, epochs=1):
            import torch.distributed as dist
            dist.init_process_group("gloo")
            ...
            return model.state_dict()

        state = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(train, 0.1, epochs=3)
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
        positive = (f"TorchDistributor(num_processes={num_processes!r}): num_processes has to be a positive "
                    "integer (>= 1): the number of processes (ranks) in all")
        if not is_int(num_processes):
            raise ConfigError(positive)
        self.local_mode = local_mode
        self.use_gpu = use_gpu
        self._config = config
        # Spark's order: the GPU confs first, then the number of processes.
        self.num_processes, per_task = _gpu_processes(num_processes, local_mode) if use_gpu else (num_processes, 1)
        if self.num_processes < 1:
            raise ConfigError(positive)
        # As in Spark's class: with spark.task.resource.gpu.amount=P, num_processes / P tasks of P
        # processes each (torchrun's --nproc_per_node), each process with its own LOCAL_RANK.
        self.num_tasks = self.num_processes // per_task
        if per_task > 1:
            self._config = (config or RunConfig()).replace(processes_per_task=per_task)
        # Public in Spark's class: the settings its run passes on.
        self.input_params: dict[str, Any] = {
            "num_processes": self.num_processes, "local_mode": local_mode, "use_gpu": use_gpu,
            "num_tasks": self.num_tasks,
        }

    def run(self, train_object: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Any:
        """Runs ``train_object``: a function, as ``train_object(*args, **kwargs)`` (returns rank 0's
        value), or a script path with its command-line arguments ``args`` (returns None).

        Raises ``ConfigError`` (a ``ValueError``, as Spark raises) before anything starts when a
        script is given keyword arguments.
        """
        if isinstance(train_object, str):
            if kwargs:
                raise ConfigError(
                    f"TorchDistributor.run({train_object!r}, ...) got keyword arguments "
                    f"({', '.join(sorted(kwargs))}), but a script takes command-line arguments only; "
                    "pass them as strings, e.g. run(path, '--lr', '0.1'), or pass a function instead"
                )
            source = Path(train_object).read_text()
            fn: Callable[..., Any] = run_script_source
            call_args: tuple[Any, ...] = (source, train_object, [str(a) for a in args])
        else:
            fn, call_args = train_object, args
        if self.local_mode:
            from sparkdl._internal.driver.local import run_on_driver

            return run_on_driver(fn, call_args, kwargs, num_processes=self.num_processes, backend="torch",
                                 gpu_ids=driver_gpus(self.num_processes) if self.use_gpu else None,
                                 config=self._config)
        from sparkdl._internal.driver.run import run

        return run(bind_kwargs(fn, kwargs), *call_args, num_workers=self.num_processes, backend="torch",
                   use_gpu=self.use_gpu, config=self._config)


def _gpu_processes(num_processes: int, local_mode: bool) -> tuple[int, int]:
    """``num_processes`` as the GPU confs allow it, checked where and as Spark's class checks them,
    and the processes each Spark task runs (one a GPU of the task; 1 in local mode)."""
    session = active_session()
    if session is None:
        raise GpuConfigError(
            "TorchDistributor(use_gpu=True) reads the GPU confs of the active SparkSession, but "
            "there is none; create one first (SparkSession.builder...getOrCreate()), or pass use_gpu=False"
        )
    if not local_mode:
        per_task = whole_gpus(session, TASK_GPU_CONF, "TorchDistributor(use_gpu=True) gives each process a GPU of its Spark task")
        tasks_of("TorchDistributor", "num_processes", num_processes, per_task)
        return num_processes, per_task
    available = whole_gpus(session, DRIVER_GPU_CONF, "TorchDistributor(use_gpu=True) gives each process a GPU of the driver")
    if not is_remote(session) and "gpu" not in session.sparkContext.resources:
        raise GpuConfigError(
            f"TorchDistributor(local_mode=True, use_gpu=True): {DRIVER_GPU_CONF}={available}, but Spark "
            "found no GPU on the driver; check spark.driver.resource.gpu.discoveryScript "
            "(`sparkdl conf gpu-discovery --path`), or pass use_gpu=False"
        )
    if num_processes > available:
        log.warning(
            "TorchDistributor(num_processes=%d, local_mode=True): the driver has %d GPUs "
            "(%s); running %d processes, as Spark's TorchDistributor does",
            num_processes, available, DRIVER_GPU_CONF, available,
        )
        return available, 1
    return num_processes, 1


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
