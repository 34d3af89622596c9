"""The ``sparkdl`` command line.

``sparkdl doctor``
    A pre-flight check of the driver and the cluster: Java, Spark, torch, pyarrow, numpy,
    Horovod and Petastorm (optional), GPUs; then a small Spark job that reports the same from
    each executor's Python, and the free task slots. It prints a table, then every problem with
    its fix, and exits 1 when there is an error.

``sparkdl run -n 2 train.py --lr 0.1``
    Runs an existing torch.distributed script on N gang-scheduled Spark workers, the way
    ``torchrun --nproc-per-node 2 train.py --lr 0.1`` runs it on one machine: every rank runs the
    script as ``__main__`` with ``sys.argv``, ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and the
    rest set; a failed rank reruns the whole gang.

Exit status: 0 success, 1 a failed check or run, 2 a usage error, 124 a run that timed out.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT = 0, 1, 2, 124
MIN_JAVA = 17
# pyspark 4's Arrow paths (mapInArrow, Arrow UDFs), which sparkdl uses, need this pyarrow.
MIN_PYARROW_FOR_SPARK4 = (18, 0)


# --------------------------------------------------------------------------------------------
# Sessions
# --------------------------------------------------------------------------------------------


def _conf_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"--conf takes KEY=VALUE, e.g. spark.executor.memory=2g; got {text!r}")
    return key.strip(), value


def _read_properties(path: str) -> dict[str, str]:
    """``key value`` lines of a spark-defaults.conf-style file."""
    props: dict[str, str] = {}
    for raw in Path(path).read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line[0] in "#!":
            continue
        match = re.match(r"(\S+?)\s*[=:\s]\s*(.*)$", line)
        if match:
            props[match.group(1)] = match.group(2).strip()
    return props


def _session(master: str | None, confs: dict[str, str], app_name: str, default_master: str) -> SparkSession:
    """A session for the command: loopback and this interpreter's Python when the master is local."""
    from pyspark.sql import SparkSession

    confs = dict(confs)
    master = master or confs.pop("spark.master", None) or default_master
    confs.pop("spark.master", None)
    if master.startswith("local"):
        ip = os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        confs.setdefault("spark.driver.host", ip)
        confs.setdefault("spark.driver.bindAddress", ip)
        # pyspark takes the workers' Python from PYSPARK_PYTHON, not from spark.pyspark.python.
        os.environ.setdefault("PYSPARK_PYTHON", confs.get("spark.pyspark.python", sys.executable))
    elif "spark.pyspark.python" in confs:
        os.environ.setdefault("PYSPARK_PYTHON", confs["spark.pyspark.python"])
    confs.setdefault("spark.ui.showConsoleProgress", "false")
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in confs.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def _spark_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--master", default=None, help="Spark master URL (default: spark.master from --properties-file, else local)")
    p.add_argument("--conf", metavar="KEY=VALUE", type=_conf_pair, action="append", default=[],
                   help="a Spark conf; repeat for more")
    p.add_argument("--properties-file", metavar="FILE", default=None, help="Spark confs, spark-defaults.conf style")


def _confs(args: argparse.Namespace) -> dict[str, str]:
    confs = _read_properties(args.properties_file) if args.properties_file else {}
    confs.update(dict(args.conf))
    return confs


# --------------------------------------------------------------------------------------------
# sparkdl doctor
# --------------------------------------------------------------------------------------------

OK, INFO, WARN, ERROR = "ok", "info", "warn", "ERROR"


@dataclass
class Check:
    """One row of the doctor's table, and what to do about it when it is not ok."""

    name: str
    status: str
    driver: str = ""
    executors: str = ""
    problem: str = ""
    fix: str = ""


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, status: str, driver: str = "", executors: str = "", problem: str = "", fix: str = "") -> Check:
        check = Check(name, status, driver, executors, problem, fix)
        self.checks.append(check)
        return check

    def errors(self) -> list[Check]:
        return [c for c in self.checks if c.status == ERROR]

    def render(self) -> str:
        header = ("check", "driver", "executors", "status")
        rows = [header, *((c.name, c.driver, c.executors, c.status) for c in self.checks)]
        widths = [min(max(len(r[i]) for r in rows), 64) for i in range(3)]

        def cut(text: str, width: int) -> str:
            return text if len(text) <= width else text[: width - 1] + "…"

        lines = ["  ".join(cut(r[i], widths[i]).ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        problems = [c for c in self.checks if c.problem]
        if problems:
            lines += ["", "What to look at:"]
            for c in problems:
                lines.append(f"  [{c.status}] {c.name}: {c.problem}")
                if c.fix:
                    lines.append(f"      fix: {c.fix}")
        n_err = len(self.errors())
        n_warn = sum(c.status == WARN for c in self.checks)
        lines += ["", f"{n_err} error(s), {n_warn} warning(s)" + ("" if n_err else ": ready to run sparkdl")]
        return "\n".join(lines)


def parse_java_version(text: str) -> int | None:
    """The major version in ``java -version`` output: ``"17.0.15"`` -> 17, ``"1.8.0_292"`` -> 8."""
    match = re.search(r'version "(\d+)(?:\.(\d+))?', text)
    if not match:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _check_java(report: Report) -> None:
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home and (Path(java_home) / "bin" / "java").exists() else shutil.which("java")
    fix = f"install Java {MIN_JAVA} (e.g. apt-get install openjdk-{MIN_JAVA}-jre-headless) and put it on PATH or set JAVA_HOME"
    if java is None:
        report.add("java", ERROR, "not found", problem="no java on PATH and no JAVA_HOME: Spark cannot start", fix=fix)
        return
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
        major = parse_java_version(out.stderr + out.stdout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        report.add("java", ERROR, java, problem=f"{java} -version failed: {exc}", fix=fix)
        return
    if major is None:
        report.add("java", ERROR, java, problem=f"cannot read the version of {java}", fix=fix)
    elif major < MIN_JAVA:
        report.add("java", ERROR, f"{major} ({java})", problem=f"Java {major} is too old: sparkdl needs Java >= {MIN_JAVA}", fix=fix)
    else:
        report.add("java", OK, f"{major} ({java})")


def _driver_versions() -> dict[str, str | None]:
    """Versions of what sparkdl needs, from the installed distributions (nothing is imported)."""
    names = ("pyspark", "torch", "pyarrow", "numpy", "pandas", "cloudpickle", "sparkdl", "horovod", "petastorm")
    return {"python": ".".join(map(str, sys.version_info[:3])), **{n: _dist_version(n) for n in names}}


def _check_driver_packages(report: Report, versions: dict[str, str | None]) -> None:
    report.add("python", OK, f"{versions['python']} ({sys.executable})")
    for name, why in (("sparkdl", "everything"), ("pyspark", "Spark"), ("torch", "training"), ("pyarrow", "the data path"),
                      ("numpy", "tensors"), ("pandas", "Arrow UDFs"), ("cloudpickle", "shipping functions")):
        version = versions[name]
        if version is None:
            report.add(name, ERROR, "missing", problem=f"{name} is not installed in {sys.executable}; sparkdl needs it for {why}",
                       fix=f"pip install {name} (see constraints/*.txt for the tested versions)")
        else:
            report.add(name, OK, version)
    spark, arrow = versions["pyspark"], versions["pyarrow"]
    if spark and arrow and _version_tuple(spark)[:1] >= (4,) and _version_tuple(arrow)[:2] < MIN_PYARROW_FOR_SPARK4:
        _set(report, "pyarrow", ERROR, f"pyspark {spark} needs pyarrow >= {'.'.join(map(str, MIN_PYARROW_FOR_SPARK4))} for its Arrow features",
             "pip install 'pyarrow>=18', or use the classic stack (pyspark 3.5) for an older pyarrow")
    pandas = versions["pandas"]
    if spark and pandas and _version_tuple(spark)[:1] >= (4,) and _version_tuple(pandas)[:1] >= (3,):
        _set(report, "pandas", WARN, f"pyspark {spark} warns about pandas {pandas}", "pip install 'pandas<3'")
    try:
        from pyspark.find_spark_home import _find_spark_home

        report.add("SPARK_HOME", OK, _find_spark_home())
    except Exception as exc:  # pyspark missing or broken: already reported above
        report.add("SPARK_HOME", WARN, "unknown", problem=f"cannot locate Spark: {exc}")


def _set(report: Report, name: str, status: str, problem: str, fix: str) -> None:
    for c in report.checks:
        if c.name == name:
            c.status, c.problem, c.fix = status, problem, fix


def _check_optional(report: Report, versions: dict[str, str | None]) -> None:
    hvd = versions["horovod"]
    if hvd is None:
        report.add("horovod", INFO, "not installed", problem="optional: needed only for backend='horovod' and HorovodRunner",
                   fix="SPARKDL_WITH_HOROVOD=1 bash tools/bootstrap.sh builds it against this torch")
    else:
        try:
            from sparkdl._horovod import check_horovod

            check_horovod()
            report.add("horovod", OK, hvd)
        except Exception as exc:
            report.add("horovod", WARN, hvd, problem=f"installed but unusable: {exc}",
                       fix="rebuild Horovod with PyTorch and Gloo (tools/build-horovod.sh)")
    peta = versions["petastorm"]
    if peta is None:
        report.add("petastorm", INFO, "not installed", problem="optional: needed only for ds.loader(reader='petastorm')",
                   fix="use the classic stack (constraints/classic.txt: pyspark 3.5, pyarrow 14)")
        return
    probe = subprocess.run([sys.executable, "-c", "import petastorm.reader"], capture_output=True, text=True, timeout=120)
    if probe.returncode == 0:
        report.add("petastorm", OK, peta)
    else:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        report.add("petastorm", WARN, peta, problem=f"installed but does not import ({last})",
                   fix="petastorm needs pyarrow < 15: use the classic stack (constraints/classic.txt)")


def _driver_gpus() -> tuple[list[str], str]:
    """GPUs nvidia-smi lists on this machine, and a line about torch's view of CUDA."""
    gpus: list[str] = []
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=index,name,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            gpus = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        except (OSError, subprocess.TimeoutExpired):
            gpus = []
    try:
        import torch

        torch_view = f"torch sees {torch.cuda.device_count()} (CUDA {torch.version.cuda or 'none: CPU build'})"
    except Exception as exc:
        torch_view = f"torch unusable: {exc}"
    return gpus, torch_view


def _check_gpus(report: Report) -> list[str]:
    gpus, torch_view = _driver_gpus()
    if not gpus:
        report.add("gpus", INFO, f"none (nvidia-smi: {'absent' if not shutil.which('nvidia-smi') else '0 GPUs'}); {torch_view}")
    elif "CPU build" in torch_view or torch_view.startswith("torch sees 0"):
        report.add("gpus", WARN, f"{len(gpus)} GPU(s); {torch_view}",
                   problem="nvidia-smi lists GPUs but torch cannot use them",
                   fix="install a CUDA build of torch: SPARKDL_TORCH_INDEX=https://download.pytorch.org/whl/cu126 bash tools/bootstrap.sh")
    else:
        report.add("gpus", OK, f"{len(gpus)}: {'; '.join(gpus)}; {torch_view}")
    return gpus


def _executor_probe(_: Any) -> Any:
    """Runs in an executor's Python worker: what sparkdl cares about there. Self-contained."""
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
    }
    for name in ("pyspark", "torch", "pyarrow", "numpy", "pandas", "cloudpickle", "sparkdl", "horovod", "petastorm"):
        facts[name] = version(name)
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


def _probe_executors(spark: SparkSession, partitions: int, timeout_s: float) -> list[dict[str, Any]]:
    """Runs the probe on ``partitions`` tasks within ``timeout_s``; cancels the job after that."""
    from pyspark import cloudpickle as spark_cloudpickle

    sc = spark.sparkContext
    group = f"sparkdl-doctor-{os.getpid()}"
    box: dict[str, Any] = {}

    def job() -> None:
        try:
            sc.setJobGroup(group, "sparkdl doctor: executor environment", interruptOnCancel=True)
            box["rows"] = sc.parallelize(range(partitions), partitions).mapPartitions(_executor_probe).collect()
        except BaseException as exc:
            box["error"] = exc

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
        sc.cancelJobGroup(group)
        thread.join(10)
        raise TimeoutError(f"the executors did not run {partitions} probe tasks within {timeout_s:g} s (--timeout)")
    if "error" in box:
        raise box["error"]
    return list(box["rows"])


def _wait_for_executors(sc: Any, wanted: int, timeout_s: float) -> int:
    """Executors registered with the driver, waiting up to ``timeout_s`` for ``wanted`` of them."""
    deadline = time.monotonic() + timeout_s
    while True:
        count = max(0, len(sc._jsc.sc().statusTracker().getExecutorInfos()) - 1)  # minus the driver
        if count >= wanted or time.monotonic() > deadline:
            return count
        time.sleep(0.25)


def _settled_slots(sc: Any, wanted: int, timeout_s: float, settle_s: float = 5.0) -> int | None:
    """Task slots once executors stop registering: ``wanted`` reached, or no change for ``settle_s``."""
    from sparkdl.launch import _task_slots

    deadline = time.monotonic() + timeout_s
    last, since = _task_slots(sc), time.monotonic()
    while last is not None and last < wanted and time.monotonic() < deadline:
        time.sleep(0.25)
        now = _task_slots(sc)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            break
    return last


def _check_cluster(report: Report, spark: SparkSession, driver: dict[str, str | None], num_workers: int,
                   timeout_s: float, driver_gpus: list[str]) -> None:
    from sparkdl.launch import _busy_slots, _task_slots

    sc = spark.sparkContext
    conf = sc.getConf()
    local = (sc.master or "").startswith("local")
    report.add("spark session", OK, f"Spark {spark.version}, master {sc.master}")
    if not local:
        executors = _wait_for_executors(sc, 1, min(timeout_s / 2, 30.0))
        if executors == 0:
            report.add("executors", ERROR, executors="none registered", problem=f"no executor registered with {sc.master}",
                       fix="check that the cluster has free cores and memory for spark.executor.cores/memory, "
                       "and that executors can reach the driver (spark.driver.host)")
            return
        if conf.get("spark.dynamicAllocation.enabled", "false") == "true":
            report.add("dynamic allocation", ERROR, problem="barrier stages (sparkdl.run) do not support dynamic allocation",
                       fix="--conf spark.dynamicAllocation.enabled=false")
    total = _settled_slots(sc, num_workers, min(timeout_s / 2, 30.0)) if not local else _task_slots(sc)
    busy = _busy_slots(sc)
    slots_text = f"{total} total, {max((total or 0) - busy, 0)} free; need {num_workers}" if total is not None else "unknown"
    if total is not None and total - busy < num_workers:
        gpu = conf.get("spark.task.resource.gpu.amount", None)
        report.add("task slots", ERROR, executors=slots_text,
                   problem=f"sparkdl.run(num_workers={num_workers}) needs {num_workers} free task slots at once; "
                   f"the cluster has {total - busy} (spark.task.cpus={conf.get('spark.task.cpus', '1')}"
                   + (f", spark.task.resource.gpu.amount={gpu}" if gpu else "") + ")",
                   fix="lower num_workers, or add executors/cores (spark.executor.instances, spark.executor.cores, "
                   "local[N]), or lower spark.task.cpus")
    else:
        report.add("task slots", OK, executors=slots_text)

    partitions = max(total or 1, 1) * 2
    try:
        rows = _probe_executors(spark, partitions, timeout_s)
    except TimeoutError as exc:
        report.add("executor python", ERROR, problem=str(exc),
                   fix="the cluster is busy or its executors cannot start Python; see the executor logs")
        return
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        report.add("executor python", ERROR, problem=f"a probe task failed: {first}",
                   fix="set spark.pyspark.python (or PYSPARK_PYTHON on the workers) to a Python with pyspark, "
                   "torch and sparkdl installed")
        return
    envs = {r["executor"]: r for r in rows}
    report.add("executors", OK, executors=f"{len(envs)} reached ({len({r['host'] for r in rows})} host(s))")
    _compare(report, driver, list(envs.values()))
    _check_executor_gpus(report, conf, list(envs.values()), driver_gpus)


def _compare(report: Report, driver: dict[str, str | None], envs: list[dict[str, Any]]) -> None:
    """Sets the executors' column of each package row, and flags what differs from the driver."""
    n = len(envs)
    required = ("python", "pyspark", "torch", "pyarrow", "numpy", "pandas", "cloudpickle", "sparkdl")
    for name in (*required, "horovod", "petastorm"):
        seen = sorted({str(e.get(name)) for e in envs})
        text = ", ".join(f"{v} on {sum(str(e.get(name)) == v for e in envs)}/{n}" for v in seen)
        row = next((c for c in report.checks if c.name == name), None) or report.add(name, INFO)
        row.executors = text.replace("None", "missing")
        missing = [e["executor"] for e in envs if e.get(name) is None]
        differs = [e["executor"] for e in envs if e.get(name) is not None and e.get(name) != driver.get(name)]
        exe = envs[0]["executable"] if envs else "?"
        if name in required and missing:
            row.status, row.problem = ERROR, f"missing in the executors' Python ({exe}) on {', '.join(missing[:3])}"
            row.fix = f"install it there, or point spark.pyspark.python at a Python that has it (the driver uses {sys.executable})"
        elif name == "python" and any(_version_tuple(str(e["python"]))[:2] != _version_tuple(str(driver["python"]))[:2] for e in envs):
            row.status, row.problem = ERROR, "the executors run another Python minor version than the driver: pickled functions break"
            row.fix = "use the same Python on the driver and the executors (spark.pyspark.python, spark.pyspark.driver.python)"
        elif differs and name not in ("horovod", "petastorm"):
            if row.status == OK:
                row.status = WARN
            row.problem = row.problem or f"the executors have another version than the driver ({driver.get(name)})"
            row.fix = row.fix or "install the same versions everywhere (constraints/*.txt pins them)"


def _check_executor_gpus(report: Report, conf: Any, envs: list[dict[str, Any]], driver_gpus: list[str]) -> None:
    amount = conf.get("spark.task.resource.gpu.amount", None)
    if not amount:
        if driver_gpus:
            report.add("gpu scheduling", INFO, problem="spark.task.resource.gpu.amount is unset: sparkdl.run trains on CPUs",
                       fix="to use GPUs, set the confs in conf/spark-defaults.gpu.conf (with conf/gpu-discovery.sh)")
        return
    without = [e["executor"] for e in envs if not e.get("task_gpus")]
    unusable = [e["executor"] for e in envs if e.get("task_gpus") and (e.get("cuda_devices") or 0) < 1]
    if without:
        report.add("gpu scheduling", ERROR, executors=f"no GPU assigned on {len(without)}/{len(envs)}",
                   problem=f"spark.task.resource.gpu.amount={amount} but tasks got no GPU address",
                   fix="set spark.executor.resource.gpu.amount and a discovery script (conf/gpu-discovery.sh) on the executors")
    elif unusable:
        report.add("gpu scheduling", ERROR, executors=f"torch sees no CUDA device on {len(unusable)}/{len(envs)}",
                   problem="Spark assigns GPUs but the executors' torch cannot use them",
                   fix="install a CUDA build of torch on the executors, and check the NVIDIA driver there")
    else:
        report.add("gpu scheduling", OK, executors=f"GPU per task: {amount}; assigned on {len(envs)}/{len(envs)}")


def doctor(args: argparse.Namespace) -> int:
    """``sparkdl doctor``: prints the table and the problems; 1 when there is an error."""
    report = Report()
    _check_java(report)
    versions = _driver_versions()
    _check_driver_packages(report, versions)
    _check_optional(report, versions)
    gpus = _check_gpus(report)
    java_ok = all(c.status != ERROR for c in report.checks if c.name in ("java", "pyspark"))
    if args.no_spark:
        pass
    elif not java_ok:
        report.add("spark session", ERROR, problem="skipped: fix Java and pyspark first")
    else:
        spark = None
        try:
            spark = _session(args.master, _confs(args), "sparkdl-doctor", "local[*]")
            spark.sparkContext.setLogLevel("ERROR")
            _check_cluster(report, spark, versions, args.num_workers, args.timeout, gpus)
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            report.add("spark session", ERROR, problem=f"Spark failed: {first}",
                       fix="check --master and the confs; the driver's log above has the details")
        finally:
            if spark is not None:
                spark.stop()
    print(report.render())
    return EXIT_FAILED if report.errors() else EXIT_OK


# --------------------------------------------------------------------------------------------
# sparkdl run
# --------------------------------------------------------------------------------------------


def run_script(source: str, path: str, argv: list[str], cwd: str) -> None:
    """Runs in each rank: the script as ``__main__``, from the driver's directory when it exists here.

    Like torchrun, the script's own directory comes first on ``sys.path`` (for its sibling
    modules) and relative paths resolve against the directory the command was started in, when
    this host has those directories (local mode, shared file systems).
    """
    from sparkdl.compat import run_script_source

    if os.path.isdir(cwd):
        os.chdir(cwd)
    script_dir = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(script_dir) and script_dir not in sys.path:
        sys.path.insert(0, script_dir)
    run_script_source(source, path, argv)


def run_command(args: argparse.Namespace) -> int:
    """``sparkdl run``: the script on ``-n`` gang-scheduled Spark workers."""
    import sparkdl

    path = Path(args.script)
    if not path.is_file():
        print(f"sparkdl run: {args.script}: no such file", file=sys.stderr)
        return EXIT_USAGE
    try:
        config = sparkdl.RunConfig(
            max_attempts=args.max_attempts, timeout_s=args.timeout, start_timeout_s=args.start_timeout,
        )
    except sparkdl.ConfigError as exc:
        print(f"sparkdl run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    spark = _session(args.master, _confs(args), f"sparkdl-run-{path.name}", f"local[{args.num_workers}]")
    try:
        sparkdl.run(
            run_script, path.read_text(), str(path.resolve()), list(args.script_args), os.getcwd(),
            num_workers=args.num_workers, use_gpu=args.gpu, config=config, spark=spark,
        )
    except sparkdl.RunTimeoutError as exc:
        print(exc, file=sys.stderr)
        return EXIT_TIMEOUT
    except sparkdl.SparkDLError as exc:
        print(exc, file=sys.stderr)
        return EXIT_FAILED
    finally:
        spark.stop()
    return EXIT_OK


# --------------------------------------------------------------------------------------------
# The parser
# --------------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0; got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from sparkdl import __version__

    parser = argparse.ArgumentParser(prog="sparkdl", description="Distributed PyTorch inside Apache Spark.")
    parser.add_argument("--version", action="version", version=f"sparkdl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{doctor,run}")

    doc = sub.add_parser("doctor", help="check the driver, the executors and the task slots",
                         description="Checks Java, Spark, torch, pyarrow, Horovod, Petastorm and GPUs on the driver, "
                         "the same on the executors (one small Spark job), and the free task slots.")
    _spark_options(doc)
    doc.add_argument("-n", "--num-workers", type=_positive_int, default=2,
                     help="ranks you plan to run: the free task slots needed (default: %(default)s)")
    doc.add_argument("--timeout", type=_positive_float, default=120.0,
                     help="bound on the executor check, in seconds (default: %(default)s)")
    doc.add_argument("--no-spark", action="store_true", help="check the driver only; start no Spark session")
    doc.set_defaults(func=doctor)

    run = sub.add_parser("run", help="run a torch.distributed script on N Spark workers, like torchrun",
                         description="Runs SCRIPT with its arguments as __main__ on N gang-scheduled Spark tasks, "
                         "with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, as torchrun would. "
                         "Example: sparkdl run -n 2 train.py --lr 0.1")
    _spark_options(run)
    run.add_argument("-n", "--num-workers", type=_positive_int, default=1, help="ranks (default: %(default)s)")
    run.add_argument("--max-attempts", type=_positive_int, default=None,
                     help="runs of the whole gang allowed (default: Spark's spark.stage.maxConsecutiveAttempts)")
    run.add_argument("--timeout", type=_positive_float, default=None,
                     help="seconds one attempt may run once all ranks started (default: no limit)")
    run.add_argument("--start-timeout", type=_positive_float, default=120.0,
                     help="seconds for all ranks to be scheduled and start (default: %(default)s)")
    gpu = run.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", dest="gpu", action="store_const", const=True, default=None,
                     help="one GPU per rank (needs spark.task.resource.gpu.amount)")
    gpu.add_argument("--no-gpu", dest="gpu", action="store_const", const=False, help="CPU only")
    run.add_argument("script", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    run.set_defaults(func=run_command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sparkdl`` console script."""
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
