"""A drop-in for ``spark_tensorflow_distributor.MirroredStrategyRunner`` (Databricks'
spark-tensorflow-distributor), on sparkdl's gang with ``backend="tensorflow"``::

    # from sparkdl.compat import MirroredStrategyRunner
    #     (was: from spark_tensorflow_distributor import MirroredStrategyRunner)
    MirroredStrategyRunner(num_slots=2, use_gpu=False).run(train, epochs=3)

Each Spark task is one worker of ``tf.distribute.MultiWorkerMirroredStrategy`` (its
``TF_CONFIG`` built from the gang); unless ``use_custom_strategy=True``, ``train_fn`` runs inside
the strategy's scope, so single-worker Keras code trains on every worker unchanged. On top of
the original: the gang reruns when a worker fails, every worker's output reaches the driver
tagged with its rank, every wait is bounded, and a failure raises one report.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.common.validate import is_int
from sparkdl._internal.compat.gpus import (
    TASK_GPU_CONF,
    active_session,
    driver_gpus,
    tasks_of,
    whole_gpus,
)

log = logging.getLogger(__name__)


class MirroredStrategyRunner:
    """Runs TensorFlow training code on gang-scheduled Spark workers, like spark-tensorflow-distributor's.

    Args:
        num_slots: GPUs in all (``use_gpu=True``: ``num_slots / spark.task.resource.gpu.amount``
            Spark tasks, each worker with its task's GPUs), or Spark tasks (``use_gpu=False``).
        local_mode: True: one worker on the driver (``num_slots`` of its GPUs, or 1 on CPUs).
        use_gpu: schedule GPUs through Spark's ``gpu`` resource.
        gpu_resource_name: Spark's resource name of the GPUs; sparkdl schedules ``"gpu"``.
        use_custom_strategy: False: ``train_fn`` runs inside ``MultiWorkerMirroredStrategy().scope()``;
            True: ``train_fn`` creates its own strategy.
        config: sparkdl's bounds and settings (:class:`sparkdl.RunConfig`).

    Raises:
        ConfigError: (a ``ValueError``) ``num_slots`` is not an integer >= 1 ("cannot be less than
            or equal to 0", in the original's words too).
        GpuConfigError: (also a ``RuntimeError`` and a ``ConfigError``) ``use_gpu=True`` and
            ``spark.task.resource.gpu.amount`` is unset or not whole, or ``num_slots`` is no
            multiple of it.
    """

    def __init__(
        self,
        *,
        num_slots: int,
        local_mode: bool = False,
        use_gpu: bool = True,
        gpu_resource_name: str = "gpu",
        use_custom_strategy: bool = False,
        config: RunConfig | None = None,
    ) -> None:
        if not is_int(num_slots) or num_slots <= 0:
            raise ConfigError(f"MirroredStrategyRunner(num_slots={num_slots!r}): num_slots cannot be less than or "
                              "equal to 0; give the number of GPUs (use_gpu=True) or of Spark tasks in all")
        if use_gpu and gpu_resource_name != "gpu":
            raise ConfigError(
                f"MirroredStrategyRunner(gpu_resource_name={gpu_resource_name!r}): sparkdl schedules GPUs as "
                "Spark's 'gpu' resource (spark.task.resource.gpu.amount); name them 'gpu' in the Spark confs"
            )
        self._num_slots = num_slots
        self._local_mode = local_mode
        self._use_gpu = use_gpu
        self._use_custom_strategy = use_custom_strategy
        self._config = config
        if local_mode:
            if not use_gpu and num_slots > 1:
                raise ConfigError(f"MirroredStrategyRunner(num_slots={num_slots}, local_mode=True, use_gpu=False): "
                                  "local mode runs one CPU worker on the driver; set num_slots=1")
            log.warning("MirroredStrategyRunner runs in local mode on the driver: training competes with "
                        "whatever else the driver runs")
            self._num_tasks: int | None = None
        else:
            self._num_tasks = _num_tasks(num_slots) if use_gpu else num_slots

    def get_num_tasks(self) -> int | None:
        """The Spark tasks (workers) of a distributed run; None in local mode."""
        return self._num_tasks

    def run(self, train_fn: Callable[..., Any], **kwargs: Any) -> Any:
        """Runs ``train_fn(**kwargs)`` on every worker; returns the chief's (rank 0's) value."""
        fn = functools.partial(_run_worker, train_fn, self._use_custom_strategy, kwargs)
        if self._local_mode:
            from sparkdl._internal.driver.local import run_on_driver

            gpus = None
            if self._use_gpu:
                owned = driver_gpus(self._num_slots)
                if len(owned) < self._num_slots:
                    raise ConfigError(f"MirroredStrategyRunner(num_slots={self._num_slots}, local_mode=True): "
                                      f"the driver has {len(owned)} GPU(s) ({','.join(owned) or 'none'}); "
                                      f"lower num_slots or set spark.driver.resource.gpu.amount")
                gpus = [",".join(owned[: self._num_slots])]
            return run_on_driver(fn, (), {}, num_processes=1, backend="tensorflow", gpu_ids=gpus, config=self._config)
        from sparkdl._internal.driver.run import run

        assert self._num_tasks is not None
        return run(fn, num_workers=self._num_tasks, backend="tensorflow", use_gpu=self._use_gpu, config=self._config)


def _run_worker(train_fn: Callable[..., Any], use_custom_strategy: bool, kwargs: dict[str, Any]) -> Any:
    """One worker's part: ``train_fn`` inside the strategy's scope, or on its own."""
    if use_custom_strategy:
        return train_fn(**kwargs)
    import tensorflow as tf

    with tf.distribute.MultiWorkerMirroredStrategy().scope():
        return train_fn(**kwargs)


def _num_tasks(num_slots: int) -> int:
    """GPUs in all -> Spark tasks, from the active session's ``spark.task.resource.gpu.amount``."""
    gpus = whole_gpus(active_session(), TASK_GPU_CONF,
                      "MirroredStrategyRunner(use_gpu=True) gives each worker the GPUs of its Spark task")
    return tasks_of("MirroredStrategyRunner", "num_slots", num_slots, gpus)
