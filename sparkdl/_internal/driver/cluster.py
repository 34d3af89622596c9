"""What the driver asks of the Spark cluster before a run: slots, GPUs, addresses, directories.

Every function takes the session's :class:`~sparkdl._internal.spark.spark_api.SparkApi` (or its confs) and
reads; none starts a job, except :func:`check_executor_python` on a cluster whose executors run
pyspark's default ``python3``.
"""

from __future__ import annotations

import getpass
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import ConfigError, InsufficientSlotsError
from sparkdl._internal.fs.private import user_dir
from sparkdl._internal.fs.storage import filesystem, make_dirs, redact
from sparkdl._internal.spark import confs
from sparkdl._internal.spark.spark_api import ClassicApi, SparkApi

DEFAULT_STAGE_ATTEMPTS = 4
RUN_DIR_CONF = confs.RUN_DIR.name
log = logging.getLogger(__name__)


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
            "spark.executor.resource.gpu.discoveryScript (`sparkdl conf gpu` prints them), "
            "or pass use_gpu=False"
        )
    return bool(use_gpu)


def stage_attempts(conf: Any) -> int:
    """How often Spark itself runs a failed barrier stage (``spark.stage.maxConsecutiveAttempts``)."""
    return int(conf.get("spark.stage.maxConsecutiveAttempts", str(DEFAULT_STAGE_ATTEMPTS)))


def check_cluster(api: SparkApi, num_workers: int, cfg: RunConfig, *, tasks: int | None = None) -> None:
    """Returns once the gang's ``tasks`` slots (one per rank unless said) are free at once;
    InsufficientSlotsError after ``slot_wait_s``.
    Over Spark Connect only the slots the master URL fixes are known, and none counts as busy."""
    conf = api.confs()
    master = api.master
    if not master.startswith("local") and conf.get("spark.dynamicAllocation.enabled", "false") == "true":
        raise ConfigError(
            "Spark's barrier mode, which sparkdl.run uses, does not support dynamic allocation: "
            "set spark.dynamicAllocation.enabled=false for this application"
        )
    tasks = num_workers if tasks is None else tasks
    deadline = time.monotonic() + cfg.slot_wait_s
    while True:
        total = api.task_slots()
        if total is None:
            return
        busy = api.busy_slots()
        free = total - (busy or 0)
        if free >= tasks:
            return
        if api.remote or time.monotonic() >= deadline:  # Connect sees no busy slot to wait for
            break
        time.sleep(0.2)
    waited = ("(Spark Connect shows no busy slots: none was waited for)" if api.remote
              else f"after waiting {cfg.slot_wait_s:g} s (RunConfig.slot_wait_s)")
    task_cpus = conf.get("spark.task.cpus", "1")
    gpu_part = ""
    if conf.get("spark.task.resource.gpu.amount", None):
        gpu_part = (
            f", spark.task.resource.gpu.amount={conf.get('spark.task.resource.gpu.amount')} and "
            f"spark.executor.resource.gpu.amount={conf.get('spark.executor.resource.gpu.amount', 'unset')}"
        )
    raise InsufficientSlotsError(
        f"num_workers={num_workers} needs {tasks} task slots at once"
        + (f" ({cfg.processes_per_task} ranks in each)" if tasks != num_workers else "") + ", but the cluster has "
        f"{total} (master {master}, spark.task.cpus={task_cpus}{gpu_part}) of which {free} are free "
        f"{waited}. Lower num_workers, or add "
        "executors or cores (spark.executor.instances, spark.executor.cores, local[N]), or lower "
        "spark.task.cpus",
        required=tasks,
        available=max(free, 0),
    )


def run_dir(conf: Any, run_id: str, *, default_fs: str | None = None, user: str | None = None) -> str:
    """The run's directory: ``<runs root>/<run id>``, the root as :func:`runs_root` finds it."""
    return f"{runs_root(conf, default_fs=default_fs, user=user).rstrip('/')}/{run_id}"


def runs_root(conf: Any, *, default_fs: str | None = None, user: str | None = None) -> str:
    """Where runs get their directories.

    ``spark.sparkdl.runDir`` when set, used as given. Else, on a cluster whose Hadoop default file
    system is storage every executor reaches (``fs.defaultFS`` such as ``hdfs://namenode:8020``
    on YARN), ``<fs.defaultFS>/user/<user>/sparkdl/runs``, when this driver can create it there
    (a warning says why not, and the next default is used). Else this user's private
    ``<temp dir>/sparkdl-<uid>/runs`` on the driver's disk, created 0700 and checked (a
    ConfigError when it is a symlink, another user's, or writable by others).
    """
    chosen = conf.get(RUN_DIR_CONF, None)
    if chosen:
        return str(chosen)
    if default_fs and urlsplit(default_fs).scheme not in ("", "file"):
        root = f"{default_fs.rstrip('/')}/user/{user or getpass.getuser()}/sparkdl/runs"
        try:
            fs, path = filesystem(root)
            make_dirs(fs, path)
            return root
        except Exception as exc:
            log.warning("sparkdl: the cluster's default file system (fs.defaultFS) is %s, but this driver "
                        "cannot create %s there (%s: %s): runs go to the driver's temp dir instead; set %s to "
                        "storage every executor reaches", redact(default_fs), redact(root), type(exc).__name__,
                        exc, RUN_DIR_CONF)
    return str(user_dir("runs", setting=RUN_DIR_CONF))


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
        wanted = str(conf.get(confs.MLFLOW.name, "false")).lower() == "true"
    if not wanted:
        return False
    try:
        import mlflow  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "MLflow logging is on (RunConfig.mlflow or spark.sparkdl.mlflow.enabled) but mlflow is "
            "not installed: pip install 'sparkdl[mlflow]' (mlflow-skinny), or turn it off"
        ) from exc
    return True


def check_executor_python(api: SparkApi) -> None:
    """On a cluster whose executors run pyspark's default ``python3``: a one-task job that imports
    what a rank needs, so that a Python without them fails now with its own error and the setting
    that fixes it, not after a barrier stage's reruns. (Over Spark Connect the server chose the
    executors' Python; a run that cannot import sparkdl there fails with the executor's error.)"""
    if not isinstance(api, ClassicApi) or api.master.startswith("local") or not api.default_python():
        return
    sc = api.sc

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
