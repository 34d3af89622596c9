"""The doctor's checks that need a Spark session: executors, task slots, executors' Python, the
driver's channel, shared directories, GPUs; over a classic session or a Spark Connect client's."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from sparkdl._internal.cli.checks import ERROR, INFO, OK, WARN, Report, version_tuple
from sparkdl._internal.cli.executor_probe import check_executor_mpi, probe_executors
from sparkdl._internal.cli.listen import Listener
from sparkdl._internal.data.writing.cache import CACHE_DIR_CONF, cache_dir
from sparkdl._internal.driver.cluster import RUN_DIR_CONF, executor_error, runs_root
from sparkdl._internal.fs.storage import normalize_url, redact
from sparkdl._internal.spark.reach import Marker
from sparkdl._internal.spark.spark_api import (
    CHANNEL_HOST_CONF,
    CHANNEL_MODE_CONF,
    ConnectApi,
    SparkApi,
    of,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def _wait_for_executors(sc: Any, wanted: int, timeout_s: float) -> int:
    """Executors registered with the driver, waiting up to ``timeout_s`` for ``wanted`` of them."""
    deadline = time.monotonic() + timeout_s
    while True:
        count = max(0, len(sc._jsc.sc().statusTracker().getExecutorInfos()) - 1)  # minus the driver
        if count >= wanted or time.monotonic() > deadline:
            return count
        time.sleep(0.25)


def _settled_slots(api: SparkApi, wanted: int, timeout_s: float, settle_s: float = 5.0) -> int | None:
    """Task slots once executors stop registering: ``wanted`` reached, or no change for ``settle_s``."""
    deadline = time.monotonic() + timeout_s
    last, since = api.task_slots(), time.monotonic()
    while last is not None and last < wanted and time.monotonic() < deadline:
        time.sleep(0.25)
        now = api.task_slots()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            break
    return last


def check_cluster(report: Report, spark: SparkSession, driver: dict[str, str | None], num_workers: int,
                  timeout_s: float, driver_gpus: list[str]) -> None:
    """Adds the session, executor, slot, executor-package, channel and GPU rows to ``report``.

    ``spark`` is a classic session or a Spark Connect client's (then the driver column is this
    client's, and what a client cannot see is said so in its row). ``driver`` holds the driver's
    package versions, which the executors' are compared with; ``timeout_s`` bounds the wait for
    executors and the probe job (``--timeout``).
    """
    api = of(spark)
    conf = api.confs()
    master = api.master
    local = master.startswith("local")
    if isinstance(api, ConnectApi):
        host, port = api.server
        report.add("spark session", OK, f"Spark {spark.version}, a Spark Connect client",
                   f"server sc://{host}:{port}, master {master}")
    else:
        report.add("spark session", OK, f"Spark {spark.version}, master {master}")
    # local-cluster[...] is one host, but its executors are JVMs of their own that register late.
    if not api.local and not api.remote:  # a Connect client sees no executor list: the probe finds them
        executors = _wait_for_executors(spark.sparkContext, 1, min(timeout_s / 2, 30.0))
        if executors == 0:
            report.add("executors", ERROR, executors="none registered", problem=f"no executor registered with {master}",
                       fix="check that the cluster has free cores and memory for spark.executor.cores/memory, "
                       "and that executors can reach the driver (spark.driver.host)")
            return
    if not local and conf.get("spark.dynamicAllocation.enabled", "false") == "true":
        report.add("dynamic allocation", ERROR, problem="barrier stages (sparkdl.run) do not support dynamic allocation",
                   fix="--conf spark.dynamicAllocation.enabled=false" + (" on the Connect server" if api.remote else ""))
    total = api.task_slots() if api.local or api.remote else _settled_slots(api, num_workers, min(timeout_s / 2, 30.0))
    _check_slots(report, api, conf, total, num_workers)

    partitions = max(total or api.default_parallelism(), 1) * 2
    dirs = _plant_markers(api, spark, conf)
    try:
        with Listener(api.channel_host()) as channel:
            rows = probe_executors(api, partitions, timeout_s,
                                   {name: (m.url, m.path, m.token) for name, (m, _) in dirs.items()}, channel)
    except TimeoutError as exc:
        report.add("executor python", ERROR, problem=str(exc),
                   fix="the cluster is busy or its executors cannot start Python; see the executor logs")
        return
    except OSError as exc:  # the listener: not an address of this machine
        report.add("driver channel", ERROR, api.channel_host(), problem=f"cannot listen on {api.channel_host()}: {exc}",
                   fix=f"set {CHANNEL_HOST_CONF} to an address of this machine that the executors reach")
        return
    except Exception as exc:
        first = executor_error(exc) or (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        fix = ("the Connect server's executors run its spark.pyspark.python (PYSPARK_PYTHON where they run): "
               "install pyarrow, torch and sparkdl in that Python" if api.remote else
               "set spark.pyspark.python (or PYSPARK_PYTHON on the workers) to a Python with pyspark, torch and sparkdl installed")
        report.add("executor python", ERROR, problem=f"a probe task failed: {first}", fix=fix)
        return
    finally:
        for marker, _ in dirs.values():
            marker.remove()
    envs = {r["executor"]: r for r in rows}
    hosts = api.executor_hosts() or sorted({str(r.get("address") or r["host"]) for r in rows})
    report.add("executors", OK, executors=f"{len(envs)} reached on {len(hosts)} host(s): {', '.join(hosts)}")
    _check_channel(report, api, rows)
    _check_shared(report, rows, dirs, "this host (local mode)" if local and not api.remote else
                  f"this {'client' if api.remote else 'driver'} and {len(rows)}/{len(rows)} probe tasks")
    _compare(report, driver, list(envs.values()))
    check_executor_mpi(report, list(envs.values()))
    _check_executor_gpus(report, conf, list(envs.values()), driver_gpus)


def _check_slots(report: Report, api: SparkApi, conf: Any, total: int | None, num_workers: int) -> None:
    """The task slots row: the cluster's slots against ``-n``; over Spark Connect, what is not visible."""
    cpus = f"spark.task.cpus={conf.get('spark.task.cpus', '1')}"
    gpu = conf.get("spark.task.resource.gpu.amount", None)
    settings = cpus + (f", spark.task.resource.gpu.amount={gpu}" if gpu else "")
    fix = ("lower num_workers, or add executors/cores (spark.executor.instances, spark.executor.cores, "
           "local[N]), or lower spark.task.cpus")
    if api.remote:
        if total is None:
            report.add("task slots", INFO, executors=f"unknown (master {api.master}); busy slots: not visible over Spark Connect",
                       problem=f"a Spark Connect client sees neither the task slots of {api.master} nor which are busy: "
                       f"a sparkdl.run(num_workers={num_workers}) that cannot get its slots at once fails after "
                       "RunConfig.start_timeout_s",
                       fix=f"check that the cluster has {num_workers} free task slots ({settings}), or run sparkdl doctor "
                       "with --master on a session of its own against the same cluster")
        elif total < num_workers:
            report.add("task slots", ERROR, executors=f"{total} total; need {num_workers}",
                       problem=f"sparkdl.run(num_workers={num_workers}) needs {num_workers} task slots at once; "
                       f"master {api.master} has {total} ({settings})", fix=fix + " on the Connect server")
        else:
            report.add("task slots", INFO, executors=f"{total} total (master {api.master}); need {num_workers}",
                       problem="busy slots: not visible over Spark Connect, so neither are the free ones: a "
                       f"sparkdl.run(num_workers={num_workers}) that finds them busy fails after RunConfig.start_timeout_s")
        return
    busy = api.busy_slots() or 0
    slots_text = f"{total} total, {max((total or 0) - busy, 0)} free; need {num_workers}" if total is not None else "unknown"
    if total is not None and total - busy < num_workers:
        report.add("task slots", ERROR, executors=slots_text,
                   problem=f"sparkdl.run(num_workers={num_workers}) needs {num_workers} free task slots at once; "
                   f"the cluster has {total - busy} ({settings})", fix=fix)
    else:
        report.add("task slots", OK, executors=slots_text)


def _check_channel(report: Report, api: SparkApi, rows: list[dict[str, Any]]) -> None:
    """Whether every probe task reached the address where sparkdl.run's channel listens."""
    host = api.channel_host()
    who = "this client" if api.remote else "the driver"
    blind = sorted({str(r.get("address") or r["host"]) for r in rows if r.get("channel")})
    if not blind:
        report.add("driver channel", OK, host, f"reached from {len(rows)}/{len(rows)} probe tasks")
        return
    why = next(str(r["channel"]) for r in rows if r.get("channel"))
    fix = (f"set {CHANNEL_HOST_CONF} (--conf) to an address of {who} that the executors reach, and let them "
           "connect to it (firewall)" + (", or run the client nearer the cluster" if api.remote else ""))
    # Without the direct channel, "auto" and "relay" runs bring logs and failures back through
    # Spark instead (sparkdl._internal.driver.relay); "direct" runs fail.
    mode = api.channel_mode()
    status, effect = ((ERROR, "sparkdl.run's ranks report to it, and a task that cannot fails") if mode == "direct" else
                      (WARN, f"with {CHANNEL_MODE_CONF}={mode}, runs bring their logs back through Spark at the end "
                       "of each attempt instead of live"))
    report.add("driver channel", status, host, f"not reached from {', '.join(blind)}",
               problem=f"the executors on {', '.join(blind)} cannot open a connection to {who} at {host} ({why}): {effect}",
               fix=fix)


def _compare(report: Report, driver: dict[str, str | None], envs: list[dict[str, Any]]) -> None:
    """Sets the executors' column of each package row, and flags what differs from the driver."""
    n = len(envs)
    required = ("python", "pyspark", "torch", "pyarrow", "numpy", "pandas", "cloudpickle", "sparkdl")
    for name in (*required, "horovod", "petastorm"):
        seen = sorted({str(e.get(name)) for e in envs})
        text = ", ".join(f"{v} on {sum(str(e.get(name)) == v for e in envs)}/{n}" for v in seen)
        row = next((c for c in report.checks if c.name == name), None) or report.add(name, INFO)
        row.executors = text.replace("None", "missing")
        missing = sorted({_host_of(e) for e in envs if e.get(name) is None})
        differs = [e["executor"] for e in envs if e.get(name) is not None and e.get(name) != driver.get(name)]
        exe = envs[0]["executable"] if envs else "?"
        if name in required and missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            row.status, row.problem = ERROR, f"missing in the executors' Python ({exe}) on {', '.join(missing[:3])}{more}"
            row.fix = ("ship a venv that has it: `sparkdl pack -o env.tar.gz`, then spark.archives=env.tar.gz#env and "
                       "spark.pyspark.python=./env/bin/python (spark-submit --archives); or install it on every "
                       f"executor host, or point spark.pyspark.python at a Python there that has it (the driver uses {sys.executable})")
        elif name == "python" and any(version_tuple(str(e["python"]))[:2] != version_tuple(str(driver["python"]))[:2] for e in envs):
            row.status, row.problem = ERROR, "the executors run another Python minor version than the driver: pickled functions break"
            row.fix = "use the same Python on the driver and the executors (spark.pyspark.python, spark.pyspark.driver.python)"
        elif differs and name not in ("horovod", "petastorm"):
            if row.status == OK:
                row.status = WARN
            row.problem = row.problem or f"the executors have another version than the driver ({driver.get(name)})"
            row.fix = row.fix or "install the same versions everywhere (constraints/*.txt pins them)"


def _host_of(env: dict[str, Any]) -> str:
    """An executor's host as a person finds it: its name, and its address where Spark was told one."""
    return f"{env['host']} ({env['address']})" if env.get("address") else str(env["host"])


def _check_executor_gpus(report: Report, conf: Any, envs: list[dict[str, Any]], driver_gpus: list[str]) -> None:
    amount = conf.get("spark.task.resource.gpu.amount", None)
    if not amount:
        if driver_gpus:
            report.add("gpu scheduling", INFO, problem="spark.task.resource.gpu.amount is unset: sparkdl.run trains on CPUs",
                       fix="to use GPUs, set the confs `sparkdl conf gpu` prints (with the script `sparkdl conf gpu-discovery --path` names)")
        return
    without = [e["executor"] for e in envs if not e.get("task_gpus")]
    unusable = [e["executor"] for e in envs if e.get("task_gpus") and (e.get("cuda_devices") or 0) < 1]
    if without:
        report.add("gpu scheduling", ERROR, executors=f"no GPU assigned on {len(without)}/{len(envs)}",
                   problem=f"spark.task.resource.gpu.amount={amount} but tasks got no GPU address",
                   fix="set spark.executor.resource.gpu.amount and a discovery script (`sparkdl conf gpu-discovery --path`) on the executors")
    elif unusable:
        report.add("gpu scheduling", ERROR, executors=f"torch sees no CUDA device on {len(unusable)}/{len(envs)}",
                   problem="Spark assigns GPUs but the executors' torch cannot use them",
                   fix="install a CUDA build of torch on the executors, and check the NVIDIA driver there")
    else:
        report.add("gpu scheduling", OK, executors=f"GPU per task: {amount}; assigned on {len(envs)}/{len(envs)}")


def _plant_markers(api: SparkApi, spark: SparkSession, conf: Any) -> dict[str, tuple[Marker, str]]:
    """A marker in the run and the cache directory (name: (marker, the setting that moves it));
    a directory the driver cannot write gets no marker (its row says so)."""
    planted = {}
    root = runs_root(conf, default_fs=api.default_fs(), user=api.spark_user())
    for name, url, setting in (("run directory", normalize_url(root), RUN_DIR_CONF),
                               ("cache directory", cache_dir(spark), CACHE_DIR_CONF)):
        try:
            # The default run directory is only an error for runs that save (see sparkdl._internal.spark.reach).
            planted[name] = (Marker.plant(url, strict=setting != RUN_DIR_CONF or bool(conf.get(setting))), setting)
        except Exception:
            continue
    return planted


def _check_shared(report: Report, rows: list[dict[str, Any]], dirs: dict[str, tuple[Marker, str]], scope: str) -> None:
    """A row per directory: whether every executor host sees what the driver wrote there
    (``scope`` says who shares it when all do)."""
    for name, (marker, setting) in dirs.items():
        where = redact(marker.url)
        blind = sorted({str(r.get("address") or r["host"]) for r in rows if name in (r.get("unshared") or {})})
        if not blind:
            report.add(name, OK, executors=f"shared by {scope}: {where}")
            continue
        why = next(r["unshared"][name] for r in rows if name in (r.get("unshared") or {}))
        then = ("checkpoints or cached datasets written there stay on each host's own disk" if marker.strict else
                f"runs without checkpoint_dir train, but their first checkpoint save fails ({setting} is not set)")
        report.add(name, ERROR if marker.strict else WARN, executors=f"not seen on {', '.join(blind)}: {where}",
                   problem=f"the executors on {', '.join(blind)} do not see the driver's {where} ({why}): {then}",
                   fix=f"set {setting} to storage that the driver and every executor reach (a shared mount, "
                   "hdfs://, s3://...)" + (", or pass checkpoint_dir= to sparkdl.run" if setting == RUN_DIR_CONF else ""))
