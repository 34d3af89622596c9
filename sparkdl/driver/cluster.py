"""What the driver asks of the Spark cluster before a run: slots, GPUs, addresses, directories.

Every function takes the ``SparkContext`` (or its conf) and reads; none starts a job, except
:func:`check_executor_python` on a cluster whose executors run pyspark's default ``python3``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Iterator
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
    return f"{runs_root(conf).rstrip('/')}/{run_id}"


def runs_root(conf: Any) -> str:
    """Where runs get their directories: ``spark.sparkdl.runDir``, else this user's private default."""
    return str(conf.get(RUN_DIR_CONF, None) or user_dir("runs", setting=RUN_DIR_CONF))


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


def _default_python(sc: Any) -> bool:
    """Whether the session's Python workers run pyspark's default, ``python3`` from PATH: nobody set
    PYSPARK_PYTHON (a notebook kernel of a venv, ``.venv/bin/python script.py``)."""
    return "PYSPARK_PYTHON" not in os.environ and getattr(sc, "pythonExec", None) == "python3"


@contextlib.contextmanager
def executor_python(sc: Any) -> Iterator[None]:
    """While a run builds its stages: the executors' Python is this interpreter (which has sparkdl,
    torch and pyarrow) when the executors are on this machine (``local``, ``local-cluster``) and
    nobody chose another; a Python someone chose is kept. Elsewhere nothing changes."""
    if not (str(sc.master).startswith("local") and _default_python(sc)):
        yield
        return
    chosen = sc.pythonExec
    sc.pythonExec = sc.getConf().get("spark.pyspark.python", None) or sys.executable
    try:
        yield
    finally:
        sc.pythonExec = chosen


def check_executor_python(sc: Any) -> None:
    """On a cluster whose executors run pyspark's default ``python3``: a one-task job that imports
    what a rank needs, so that a Python without them fails now with its own error and the setting
    that fixes it, not after a barrier stage's reruns."""
    if str(sc.master).startswith("local") or not _default_python(sc):
        return

    def imports(_: Any) -> Iterator[str]:
        import importlib

        for name in ("pyarrow", "torch", "sparkdl"):
            importlib.import_module(name)
        yield sys.executable

    try:
        sc.parallelize([0], 1).mapPartitions(imports).collect()
    except Exception as exc:
        raise ConfigError(
            f"the executors run pyspark's default Python, {sc.pythonExec!r} from their PATH (neither "
            f"PYSPARK_PYTHON nor spark.pyspark.python is set), and it cannot run sparkdl: "
            f"{executor_error(exc) or type(exc).__name__}. Set spark.pyspark.python (spark-submit "
            "--conf, or spark-defaults.conf) or PYSPARK_PYTHON (before the session starts) to an "
            "interpreter that has sparkdl, torch and pyarrow on every executor host"
        ) from None


def executor_error(exc: BaseException | None) -> str | None:
    """The Python exception an executor raised, as its last traceback line (``ModuleNotFoundError:
    No module named 'pyarrow'``), from the Spark error that wraps it; None when there is none."""
    text = str(exc) if exc is not None else ""
    start = text.rfind("Traceback (most recent call last)")
    if start < 0:
        return None
    for line in text[start:].splitlines()[1:]:
        if line.strip() and not line.startswith((" ", "\t")):
            return line.strip()
    return None


def executor_hosts(sc: Any) -> list[str]:
    """The addresses of the hosts the session's executors run on (in local mode, the driver's)."""
    try:
        summaries = sc._jsc.sc().statusStore().executorList(True)
        found = [summaries.apply(i) for i in range(summaries.size())]
        pairs = [(str(e.id()), str(e.hostPort()).rsplit(":", 1)[0]) for e in found]
    except Exception:
        return []
    executors = {host for ident, host in pairs if ident != "driver"}
    return sorted(executors or {host for _, host in pairs})
