"""The doctor's Spark job: what each executor's Python has, reported back to the driver.

The executor side of this module imports nothing from sparkdl, and :func:`probe_executors`
ships it by value: the probe runs, and says what is missing, on executors where sparkdl itself
is not installed. On a classic session the job is an RDD job (it needs nothing but Python on the
executors); a Spark Connect client has no RDDs, so there it is
``spark.range(n, numPartitions=n).mapInArrow(...)``, which needs pyarrow on the executors (a
probe that fails for want of it says so).

Each probe task also says whether Horovod's MPI controller (``RunConfig(horovod_controller='mpi')``)
can run in its Python (sparkdl's own check, where sparkdl is installed there);
:func:`check_executor_mpi` turns that into the executors' column of the doctor's MPI row.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sparkdl._internal.cli.checks import INFO, OK, Report

if TYPE_CHECKING:
    from sparkdl._internal.spark.spark_api import SparkApi

# The doctor's row for Horovod's MPI controller, and why it is never more than info.
MPI_ROW = "mpi controller"
MPI_OPTIONAL = "optional: needed only for RunConfig(horovod_controller='mpi')"
MPI_HERE = "on this machine"
_MPI_FIX = ("install Open MPI 4 (apt-get install openmpi-bin libopenmpi-dev) and Horovod built with MPI "
            "(`bash \"$(sparkdl conf build-horovod --path)\" VENV`) on the driver and every executor")


def _sees(url: str, path: str, token: str) -> str | None:
    """None when this host reads ``token`` back from the marker ``path`` of the directory ``url``;
    else what it found. Local files are read here; other URLs through sparkdl, where installed."""
    try:
        if url.startswith("file://"):
            with open(path, encoding="utf-8", errors="replace") as f:
                found = f.read(200)
        else:
            from sparkdl._internal.fs.storage import filesystem

            with filesystem(url)[0].open_input_stream(path) as stream:
                found = stream.read(200).decode(errors="replace")
    except FileNotFoundError:
        return "the driver's marker is not there"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if found == token else "another directory of the same name"


def _reaches(channel: tuple[str, int] | None) -> str | None:
    """None when a TCP connection to ``channel`` (host, port) opens from here within 5 s; else why not."""
    import socket

    if channel is None:
        return None
    try:
        with socket.create_connection(channel, timeout=5):
            return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def _mpi(horovod: str | None) -> dict[str, str] | None:
    """Whether Horovod's MPI controller can run in this Python: None without Horovod, else
    ``{"ok": "Horovod <v>, Open MPI <v>"}`` or ``{"no": why}`` (sparkdl's check: it imports
    horovod.torch and runs ``mpirun --version``)."""
    if horovod is None:
        return None
    try:
        from sparkdl._internal.backends.horovod.horovod_mpi import check_mpi

        return {"ok": check_mpi()}
    except Exception as exc:
        return {"no": str(exc) or type(exc).__name__}


def _executor_probe(markers: dict[str, tuple[str, str, str]], channel: tuple[str, int] | None,
                    _: Any) -> Iterator[dict[str, Any]]:
    """Runs in an executor's Python worker: what sparkdl cares about there, whether it sees the
    driver's marker in each of ``markers`` (name: (url, path, token)), and whether it reaches the
    driver's ``channel`` address (under ``"channel"``: None, or why not). Self-contained."""
    import importlib.metadata as md
    import os
    import socket
    import sys

    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    facts: dict[str, Any] = {
        "host": socket.gethostname(),
        # The Python worker's parent is the executor's pyspark daemon: one per executor.
        "executor": f"{socket.gethostname()}:{os.getppid()}",
        "python": ".".join(map(str, sys.version_info[:3])),
        "executable": sys.executable,
        "address": os.environ.get("SPARK_LOCAL_IP"),
        "unshared": {name: why for name, (url, path, token) in markers.items() if (why := _sees(url, path, token))},
        "channel": _reaches(channel),
    }
    for name in ("pyspark", "torch", "pyarrow", "numpy", "pandas", "cloudpickle", "sparkdl", "horovod", "petastorm"):
        facts[name] = version(name)
    facts["mpi"] = _mpi(facts["horovod"])
    try:
        import pyspark

        facts["pyspark"] = pyspark.__version__  # the pyspark this worker runs, maybe Spark's own zip
    except Exception:
        pass
    try:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        res = ctx.resources() if ctx is not None else {}
        facts["task_gpus"] = list(res["gpu"].addresses) if "gpu" in res else []
    except Exception:
        facts["task_gpus"] = []
    facts["cuda_devices"] = None
    if facts["task_gpus"] and facts["torch"]:
        try:
            import torch

            facts["cuda_devices"] = torch.cuda.device_count()
        except Exception:
            facts["cuda_devices"] = -1
    yield facts


def _arrow_probe(markers: dict[str, tuple[str, str, str]], channel: tuple[str, int] | None,
                 batches: Iterator[Any]) -> Iterator[Any]:
    """:func:`_executor_probe` as a ``mapInArrow`` function: one row per task, its facts as JSON."""
    import json

    import pyarrow as pa

    for _ in batches:  # the task's one input row: what matters is where the task runs
        pass
    facts = [json.dumps(f) for f in _executor_probe(markers, channel, None)]
    yield pa.RecordBatch.from_pydict({"facts": facts}, schema=pa.schema([("facts", pa.string())]))


def probe_executors(api: SparkApi, partitions: int, timeout_s: float, markers: dict[str, tuple[str, str, str]] | None = None,
                    channel: tuple[str, int] | None = None) -> list[dict[str, Any]]:
    """Runs the probe on ``partitions`` tasks of ``api``'s session (a
    :class:`sparkdl._internal.spark.spark_api.SparkApi`) within ``timeout_s``; cancels the job after that.

    Returns one dict per task (host, executor, Python, package versions, task GPUs, which of
    ``markers`` its host does not see, under ``"unshared"``, and whether it reached ``channel``,
    under ``"channel"``). Raises ``TimeoutError`` naming ``--timeout`` when the tasks did not all
    run in time, and re-raises the job's own error when a task failed.
    """
    from pyspark import cloudpickle as spark_cloudpickle

    spark = api.session
    group = f"sparkdl-doctor-{os.getpid()}"
    box: dict[str, Any] = {}
    markers = markers or {}

    def job() -> None:
        try:
            api.tag_jobs(group, "sparkdl doctor: executor environment")
            if api.remote:
                df = spark.range(partitions, numPartitions=partitions)
                rows = df.mapInArrow(functools.partial(_arrow_probe, markers, channel), "facts string").collect()
                box["rows"] = [json.loads(r.facts) for r in rows]
            else:
                probe = functools.partial(_executor_probe, markers, channel)
                box["rows"] = spark.sparkContext.parallelize(range(partitions), partitions).mapPartitions(probe).collect()
        except BaseException as exc:
            box["error"] = exc
        finally:
            api.untag_jobs(group)

    # By value, so that the probe runs (and reports) even where sparkdl is not installed.
    module = sys.modules[__name__]
    spark_cloudpickle.register_pickle_by_value(module)
    try:
        thread = threading.Thread(target=job, name="sparkdl-doctor-probe", daemon=True)
        thread.start()
        thread.join(timeout_s)
    finally:
        spark_cloudpickle.unregister_pickle_by_value(module)
    if thread.is_alive():
        api.cancel(group)
        thread.join(10)
        raise TimeoutError(f"the executors did not run {partitions} probe tasks within {timeout_s:g} s (--timeout)")
    if "error" in box:
        raise box["error"]
    return list(box["rows"])


def mpi_problem(message: str) -> tuple[str, str]:
    """sparkdl's BackendUnavailableError message, ``"<why>. <what to install>"``, as (why, fix)."""
    why, _, fix = message.partition(". ")
    return why, fix or _MPI_FIX


def check_executor_mpi(report: Report, envs: list[dict[str, Any]]) -> None:
    """Fills the executors' column of the MPI row (one env per executor, as the probe found it).

    Executors without Horovod are said to need it, and no more (the horovod row tells of Horovod);
    those where the MPI controller cannot run make the row info, naming their hosts and why.
    """
    row = next((c for c in report.checks if c.name == MPI_ROW), None) or report.add(MPI_ROW, INFO)

    def said(env: dict[str, Any]) -> str:
        mpi = env.get("mpi")
        return "needs horovod" if mpi is None else mpi.get("ok") or "unavailable"

    seen = sorted({said(e) for e in envs})
    row.executors = ", ".join(f"{v} on {sum(said(e) == v for e in envs)}/{len(envs)}" for v in seen)
    hosts_by_why: dict[str, set[str]] = {}
    fix = ""
    for env in envs:
        if (env.get("mpi") or {}).get("no"):
            why, fix = mpi_problem(env["mpi"]["no"])
            hosts_by_why.setdefault(why, set()).add(str(env.get("address") or env["host"]))
    if not hosts_by_why:
        return
    if row.status == OK:
        row.status = INFO
    problem = row.problem or MPI_OPTIONAL
    for why, hosts in hosts_by_why.items():
        there = f"on the executors on {', '.join(sorted(hosts))}"
        here = f"{MPI_HERE}: {why}"  # the driver's reason (preflight), said once for both
        problem = problem.replace(here, f"{MPI_HERE} and {there}: {why}") if here in problem else f"{problem}; {there}: {why}"
    row.problem, row.fix = problem, row.fix or fix
