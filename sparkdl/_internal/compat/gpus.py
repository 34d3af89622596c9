"""The Spark confs and driver resources that give the drop-ins' processes their GPUs, read as
the originals read them (:mod:`sparkdl.compat`, :mod:`sparkdl._internal.compat.tf_distributor`)."""

from __future__ import annotations

import os
from typing import Any

from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.common.validate import nearest_multiples
from sparkdl._internal.spark.spark_api import is_remote

TASK_GPU_CONF = "spark.task.resource.gpu.amount"
DRIVER_GPU_CONF = "spark.driver.resource.gpu.amount"


class GpuConfigError(ConfigError, RuntimeError):
    """``use_gpu=True``, but the Spark confs give the processes no GPU (or no whole GPUs).

    Also a ``RuntimeError``: Spark's ``TorchDistributor`` raises one for the same confs at the
    same point (its constructor), so code written for it catches this one too.
    """


def active_session() -> Any:
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession()


def conf_of(session: Any, key: str) -> str | None:
    """Spark conf ``key`` of ``session``, or None when unset.

    ``session.conf`` answers for classic and Spark Connect sessions alike (a Connect session has
    no ``sparkContext``); it holds the confs the session was built with.
    """
    value = session.conf.get(key, None)
    return None if value is None else str(value)


_GPU_SETUP = {
    TASK_GPU_CONF: f"set {TASK_GPU_CONF}=1 with spark.executor.resource.gpu.amount and "
                   "spark.executor.resource.gpu.discoveryScript (`sparkdl conf gpu` prints them)",
    DRIVER_GPU_CONF: f"set {DRIVER_GPU_CONF} to the driver's GPUs with "
                     "spark.driver.resource.gpu.discoveryScript (`sparkdl conf gpu-discovery --path`)",
}


def whole_gpus(session: Any, key: str, who: str) -> int:
    """The whole number of GPUs conf ``key`` of ``session`` gives; GpuConfigError when unset, 0,
    fractional or there is no session. ``who``: what needs them, said first ("TorchDistributor(
    use_gpu=True) gives each process a GPU of its Spark task")."""
    raw = conf_of(session, key) if session is not None else None
    amount = float(raw) if raw else 0.0
    if amount >= 1 and amount.is_integer():
        return int(amount)
    state = "is unset" if not amount else f"is {raw}, not a whole number of GPUs"
    raise GpuConfigError(
        f"{who}, but '{key}' {state}" + ("" if session is not None else " (there is no active SparkSession)")
        + f"; {_GPU_SETUP[key]}, or pass use_gpu=False"
    )


def tasks_of(owner: str, name: str, total: int, per_task: int) -> int:
    """The Spark tasks of ``total`` processes when each task has ``per_task`` GPUs and as many
    processes; GpuConfigError naming the two nearest counts when ``total`` is no multiple of it."""
    if total % per_task:
        raise GpuConfigError(
            f"{owner}({name}={total}) with {TASK_GPU_CONF}={per_task}: {name} must be a multiple of "
            f"{TASK_GPU_CONF} (each task's GPUs go to as many processes); use {nearest_multiples(name, total, per_task)}"
        )
    return total // per_task


def driver_gpus(num_processes: int) -> list[str]:
    """The driver's GPU addresses, one per process to be."""
    session = active_session()
    if session is None:
        raise GpuConfigError(
            "TorchDistributor(local_mode=True, use_gpu=True) takes the driver's GPUs from the "
            "active SparkSession, but there is none; create one first, or pass use_gpu=False"
        )
    if is_remote(session):
        # The processes run here, on the client, as Spark's do under Spark Connect: the server
        # driver's GPU addresses mean nothing on this machine, so rank i takes its i-th GPU.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            return [gpu for gpu in visible.split(",") if gpu]
        return [str(i) for i in range(num_processes)]
    resources = session.sparkContext.resources
    return list(resources["gpu"].addresses) if "gpu" in resources else []
