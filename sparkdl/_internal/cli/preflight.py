"""``sparkdl doctor``: a pre-flight check of the driver, then of the cluster.

The driver's checks (Java, the packages sparkdl needs, Horovod and its MPI controller, Petastorm,
GPUs) run here without Spark; :func:`doctor` then starts a session (``--remote``: a Spark Connect
client's, which needs the Connect client's packages and no Java) and adds the cluster's rows
(:mod:`sparkdl._internal.cli.executors`), prints the table and exits 1 when any row is an error.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from sparkdl._internal.cli.checks import ERROR, INFO, OK, WARN, Report, version_tuple
from sparkdl._internal.cli.executor_probe import MPI_HERE, MPI_OPTIONAL, MPI_ROW, mpi_problem
from sparkdl._internal.cli.executors import check_cluster
from sparkdl._internal.cli.options import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    cli_session,
    remote_url,
    spark_confs,
)
from sparkdl._internal.common.errors import ConfigError

MIN_JAVA = 17
# pyspark 4's Arrow paths (mapInArrow, Arrow UDFs), which sparkdl uses, need this pyarrow.
MIN_PYARROW_FOR_SPARK4 = (18, 0)


def parse_java_version(text: str) -> int | None:
    """The major version in ``java -version`` output: ``"17.0.15"`` -> 17, ``"1.8.0_292"`` -> 8."""
    match = re.search(r'version "(\d+)(?:\.(\d+))?', text)
    if not match:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _check_java(report: Report, remote: bool = False) -> None:
    """The java row; a Spark Connect client (``remote``) runs no JVM, so there it is never an error."""
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home and (Path(java_home) / "bin" / "java").exists() else shutil.which("java")
    fix = f"install Java {MIN_JAVA} (e.g. apt-get install openjdk-{MIN_JAVA}-jre-headless) and put it on PATH or set JAVA_HOME"
    if remote:
        report.add("java", INFO, java or "not found", problem="not needed here: a Spark Connect client runs no JVM")
        return
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
    if spark and arrow and version_tuple(spark)[:1] >= (4,) and version_tuple(arrow)[:2] < MIN_PYARROW_FOR_SPARK4:
        report.set("pyarrow", ERROR, f"pyspark {spark} needs pyarrow >= {'.'.join(map(str, MIN_PYARROW_FOR_SPARK4))} for its Arrow features",
                   "pip install 'pyarrow>=18', or use the classic stack (pyspark 3.5) for an older pyarrow")
    pandas = versions["pandas"]
    if spark and pandas and version_tuple(spark)[:1] >= (4,) and version_tuple(pandas)[:1] >= (3,):
        report.set("pandas", WARN, f"pyspark {spark} warns about pandas {pandas}", "pip install 'pandas<3'")
    try:
        from pyspark.find_spark_home import _find_spark_home

        report.add("SPARK_HOME", OK, _find_spark_home())
    except Exception as exc:  # pyspark missing or broken: already reported above
        report.add("SPARK_HOME", WARN, "unknown", problem=f"cannot locate Spark: {exc}")


def _check_connect_client(report: Report) -> None:
    """The Spark Connect client's own packages (pyspark[connect]), which pyspark imports lazily."""
    import importlib.util

    missing = []
    for module, dist in (("grpc", "grpcio"), ("grpc_status", "grpcio-status"), ("google.rpc", "googleapis-common-protos"),
                         ("zstandard", "zstandard")):
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # "google" itself missing
            found = False
        if not found:
            missing.append(dist)
    if missing:
        report.add("connect client", ERROR, f"missing {', '.join(missing)}",
                   problem=f"the Spark Connect client needs {', '.join(missing)} in {sys.executable}",
                   fix="pip install 'sparkdl[connect]' (or 'pyspark[connect]')")
    else:
        report.add("connect client", OK, f"grpcio {_dist_version('grpcio')}")


def _check_optional(report: Report, versions: dict[str, str | None]) -> None:
    hvd = versions["horovod"]
    usable = False
    if hvd is None:
        report.add("horovod", INFO, "not installed", problem="optional: needed only for backend='horovod' and HorovodRunner",
                   fix=f"build it against this torch: bash \"$(sparkdl conf build-horovod --path)\" {sys.prefix}")
    else:
        try:
            from sparkdl._internal.backends.horovod.horovod_gloo import check_horovod

            check_horovod()
            report.add("horovod", OK, hvd)
            usable = True
        except Exception as exc:
            report.add("horovod", WARN, hvd, problem=f"installed but unusable: {exc}",
                       fix=f"rebuild Horovod with PyTorch and Gloo: bash \"$(sparkdl conf build-horovod --path)\" {sys.prefix}")
    _check_mpi(report, usable)
    peta = versions["petastorm"]
    if peta is None:
        report.add("petastorm", INFO, "not installed", problem="optional: needed only for ds.loader(reader='petastorm')",
                   fix="Petastorm needs pyarrow < 15 (so numpy < 2, pyspark 3.5): install 'sparkdl[petastorm]' in such an environment")
        return
    probe = subprocess.run([sys.executable, "-c", "import petastorm.reader"], capture_output=True, text=True, timeout=120)
    if probe.returncode == 0:
        report.add("petastorm", OK, peta)
    else:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        report.add("petastorm", WARN, peta, problem=f"installed but does not import ({last})",
                   fix="Petastorm needs pyarrow < 15 (so numpy < 2, pyspark 3.5): use an environment with those")


def _check_mpi(report: Report, horovod_usable: bool) -> None:
    """The row of Horovod's MPI controller: its versions, or why it cannot run here. Optional, so
    never more than info; without a usable Horovod the horovod row has said all there is to say."""
    if not horovod_usable:
        report.add(MPI_ROW, INFO, "needs horovod")
        return
    try:
        from sparkdl._internal.backends.horovod.horovod_mpi import check_mpi

        report.add(MPI_ROW, OK, check_mpi())
    except Exception as exc:
        why, fix = mpi_problem(str(exc) or type(exc).__name__)
        report.add(MPI_ROW, INFO, "unavailable", problem=f"{MPI_OPTIONAL}; {MPI_HERE}: {why}", fix=fix)


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


def doctor(args: argparse.Namespace) -> int:
    """``sparkdl doctor``: prints the table and the problems; 1 when there is an error, 2 for a
    usage error (``--master`` with ``--remote``)."""
    confs: dict[str, str] = {}
    confs_error: Exception | None = None
    try:
        confs = spark_confs(args)
    except (ConfigError, OSError) as exc:  # said in the spark session row below
        confs_error = exc
    try:
        url = None if args.no_spark else remote_url(args, confs)
    except ConfigError as exc:
        print(f"sparkdl doctor: {exc}", file=sys.stderr)
        return EXIT_USAGE
    report = Report()
    _check_java(report, remote=url is not None)
    versions = _driver_versions()
    _check_driver_packages(report, versions)
    if url is not None:
        _check_connect_client(report)
    _check_optional(report, versions)
    gpus = _check_gpus(report)
    needed = ("pyspark", "connect client") if url is not None else ("java", "pyspark")
    ready = all(c.status != ERROR for c in report.checks if c.name in needed)
    if args.no_spark:
        pass
    elif not ready:
        report.add("spark session", ERROR, problem="skipped: fix " + ("pyspark and the Spark Connect client" if url is not None
                                                                      else "Java and pyspark") + " first")
    elif confs_error is not None:
        report.add("spark session", ERROR, problem=f"Spark failed: {confs_error}", fix="fix --properties-file or --conf")
    else:
        _check_spark(report, args, confs, url, versions, gpus)
    # The report is the command's output, not a diagnostic.
    print(report.render())
    return EXIT_FAILED if report.errors() else EXIT_OK


def _check_spark(report: Report, args: argparse.Namespace, confs: dict[str, str], url: str | None,
                 versions: dict[str, str | None], gpus: list[str]) -> None:
    """Starts the session (classic, or a Spark Connect client of ``url``) and adds the cluster's rows."""
    spark = None
    try:
        spark = cli_session(args, confs, "sparkdl-doctor", "local[*]")
        if url is None:
            spark.sparkContext.setLogLevel("ERROR")
        check_cluster(report, spark, versions, args.num_workers, args.timeout, gpus)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        report.add("spark session", ERROR, problem=f"Spark failed{f' (Spark Connect {url})' if url else ''}: {first}",
                   fix=f"check that a Spark Connect server listens at {url} and that this machine reaches it" if url
                   else "check --master and the confs; the driver's log above has the details")
    finally:
        if spark is not None:
            spark.stop()
