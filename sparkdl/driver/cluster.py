"""What the driver asks of the Spark cluster before a run: slots, GPUs, addresses, directories.

Every function takes the ``SparkContext`` (or its conf) and reads; none starts a job.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sparkdl.config import RunConfig
from sparkdl.errors import ConfigError, InsufficientSlotsError
from sparkdl.private import user_dir

DEFAULT_STAGE_ATTEMPTS = 4
RUN_DIR_CONF = "spark.sparkdl.runDir"


def resolve_gpu(conf: Any, use_gpu: bool | None) -> bool:
    """Whether ranks get GPUs: ``use_gpu``, or (when None) whether Spark assigns GPUs to tasks."""
    amount = conf.get("spark.task.resource.gpu.amount", None)
    has_task_gpus = amount is not None and float(amount) > 0
    if use_gpu is None:
        return has_task_gpus
    if use_gpu and not has_task_gpus:
        raise ConfigError(
            "use_gpu=True but 'spark.task.resource.gpu.amount' is unset, so Spark assigns no GPU to "
            "tasks. Set spark.task.resource.gpu.amount=1, spark.executor.resource.gpu.amount and "
            "spark.executor.resource.gpu.discoveryScript (conf/spark-defaults.gpu.conf shows them), "
            "or pass use_gpu=False"
        )
    return bool(use_gpu)


def stage_attempts(conf: Any) -> int:
    """How often Spark itself runs a failed barrier stage (``spark.stage.maxConsecutiveAttempts``)."""
    return int(conf.get("spark.stage.maxConsecutiveAttempts", str(DEFAULT_STAGE_ATTEMPTS)))


def task_slots(sc: Any) -> int | None:
    """Task slots of the cluster for the default resource profile (cores, GPUs and spark.task.cpus)."""
    try:
        jsc = sc._jsc.sc()
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    except Exception:
        return None


def busy_slots(sc: Any, *, except_group: str | None = None) -> int:
    """Task slots that running stages hold now, less those of the jobs of ``except_group``."""
    tracker = sc.statusTracker()
    own: set[int] = set()
    if except_group is not None:
        for job_id in tracker.getJobIdsForGroup(except_group):
            job = tracker.getJobInfo(job_id)
            if job is not None:
                own.update(job.stageIds)
    busy = 0
    for stage_id in tracker.getActiveStageIds():
        info = tracker.getStageInfo(stage_id) if stage_id not in own else None
        if info is not None:
            busy += info.numActiveTasks
    return busy


def free_slots(sc: Any, group: str) -> int | None:
    """Task slots free now for the gang of job group ``group``: the live executors' slots less
    those other jobs hold (the group's own tasks are the gang's); None when Spark does not say."""
    total = task_slots(sc)
    if total is None:
        return None
    try:
        return max(total - busy_slots(sc, except_group=group), 0)
    except Exception:  # the status tracker of a stopping context
        return None


def check_cluster(sc: Any, num_workers: int, cfg: RunConfig) -> None:
    """Returns once ``num_workers`` slots are free at once; InsufficientSlotsError after ``slot_wait_s``."""
    conf = sc.getConf()
    master = sc.master
    if not master.startswith("local") and conf.get("spark.dynamicAllocation.enabled", "false") == "true":
        raise ConfigError(
            "Spark's barrier mode, which sparkdl.run uses, does not support dynamic allocation: "
            "set spark.dynamicAllocation.enabled=false for this application"
        )
    deadline = time.monotonic() + cfg.slot_wait_s
    while True:
        total = task_slots(sc)
        if total is None:
            return
        free = total - busy_slots(sc)
        if free >= num_workers:
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    task_cpus = conf.get("spark.task.cpus", "1")
    gpu_part = ""
    if conf.get("spark.task.resource.gpu.amount", None):
        gpu_part = (
            f", spark.task.resource.gpu.amount={conf.get('spark.task.resource.gpu.amount')} and "
            f"spark.executor.resource.gpu.amount={conf.get('spark.executor.resource.gpu.amount', 'unset')}"
        )
    raise InsufficientSlotsError(
        f"num_workers={num_workers} needs {num_workers} task slots at once, but the cluster has "
        f"{total} (master {master}, spark.task.cpus={task_cpus}{gpu_part}) of which {free} are free "
        f"after waiting {cfg.slot_wait_s:g} s (RunConfig.slot_wait_s). Lower num_workers, or add "
        "executors or cores (spark.executor.instances, spark.executor.cores, local[N]), or lower "
        "spark.task.cpus",
        required=num_workers,
        available=max(free, 0),
    )


def is_local(sc: Any) -> bool:
    """Whether the session runs its tasks in the driver's JVM (``local``, ``local[N]``, ``local[N, F]``)."""
    return bool(sc.master == "local" or sc.master.startswith("local["))


def driver_bind_host(sc: Any) -> str:
    """The address tasks reach the driver on: loopback in local mode, whatever the session's
    spark.driver.host says (nothing of a local run is for other hosts), else spark.driver.host."""
    if is_local(sc):
        return "127.0.0.1"
    host = sc.getConf().get("spark.driver.host", None) or os.environ.get("SPARK_LOCAL_IP") or "127.0.0.1"
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def run_dir(conf: Any, run_id: str) -> str:
    """The run's directory: ``<spark.sparkdl.runDir>/<run id>``.

    Without ``spark.sparkdl.runDir``, ``<temp dir>/sparkdl-<uid>/runs/<run id>``: this user's
    private directory, created 0700 and checked here (a ConfigError when it is a symlink,
    another user's, or writable by others). A runDir the user set is used as given.
    """
    runs = conf.get(RUN_DIR_CONF, None) or str(user_dir("runs", setting=RUN_DIR_CONF))
    return f"{runs.rstrip('/')}/{run_id}"


def local_metrics_path(run_dir: str, run_id: str) -> Path:
    """The metrics file: in the run's directory when that is local, else in this user's private
    ``<temp dir>/sparkdl-<uid>/runs/<run id>``."""
    parts = urlsplit(run_dir)
    if len(parts.scheme) <= 1:
        return Path(run_dir) / "metrics.jsonl"
    if parts.scheme == "file":
        return Path(parts.path) / "metrics.jsonl"
    return user_dir("runs", setting=RUN_DIR_CONF) / run_id / "metrics.jsonl"


def mlflow_enabled(conf: Any, cfg: RunConfig) -> bool:
    """RunConfig.mlflow, else ``spark.sparkdl.mlflow.enabled``; ConfigError when on without mlflow."""
    wanted = cfg.mlflow
    if wanted is None:
        wanted = str(conf.get("spark.sparkdl.mlflow.enabled", "false")).lower() == "true"
    if not wanted:
        return False
    try:
        import mlflow  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "MLflow logging is on (RunConfig.mlflow or spark.sparkdl.mlflow.enabled) but mlflow is "
            "not installed: pip install mlflow-skinny, or turn it off"
        ) from exc
    return True
