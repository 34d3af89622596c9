"""A class-data-sharing archive of Spark's classes for the JVMs the suite starts.

A Spark JVM spends most of its start-up loading and verifying some 2,500 classes from 250-280
jars: about 10 s of CPU for a ``local[2]`` session on this 2-core machine, 6 s when those classes
come mapped from an archive (JDK 17 AppCDS, ``-XX:SharedArchiveFile``). A CI run started 87 Spark JVMs
on the modern stack and 56 on the classic one: drivers, executors, spark-submit, notebook kernels.

The archive is made once per Java and pyspark install (and venv path: the jars' paths are in it), by a short Spark run (this module run as a
script) with ``-XX:ArchiveClassesAtExit``, and kept under ``~/.cache/sparkdl/jvm``. A JVM maps it
when its class path starts with the one recorded in it (``pyspark``'s launcher gives drivers and
``local-cluster`` executors the same one); any other JVM, and one that cannot read the file (a
second Unix user), loads its classes from the jars as before: silently, since ``-Xlog:cds`` is off.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUILD_TIMEOUT_S = 300
KEEP = 6  # archives kept in the cache: two stacks for each of three checkouts (a working tree, a fresh clone, CI's)
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sparkdl" / "jvm"


def _key(jars: Path, jvm_opts: str) -> str:
    """What the archive depends on: the java binary and version, the jars (names, sizes, times) and
    the JVM options it is made with."""
    java = subprocess.run(["java", "-Xshare:auto", "-version"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "JAVA_TOOL_OPTIONS": ""})
    h = hashlib.sha256(java.stderr.encode() + jvm_opts.encode() + str(jars).encode())
    for jar in sorted(jars.glob("*.jar")):  # the class path (jars/*); not the directories beside them
        st = jar.stat()
        h.update(f"{jar.name} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _prune(cache: Path, keep: int = KEEP) -> None:
    """Leaves the ``keep - 1`` archives used last (each checkout's venvs have their own paths, so
    their own archive: 140-190 MiB each). A JVM that has one mapped keeps its mapping."""
    archives = sorted(cache.glob("spark-*.jsa"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in archives[keep - 1:]:
        with contextlib.suppress(FileNotFoundError):
            old.unlink()
            old.with_suffix(".lock").unlink()


def ensure(jvm_opts: str) -> tuple[Path | None, str]:
    """The archive for this interpreter's pyspark, made if missing (one process makes it, others
    wait on a lock): (path, what happened), or (None, why not)."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        return None, "pyspark is not installed"
    jars = Path(spec.origin).parent / "jars"
    if not jars.is_dir():
        return None, f"no {jars}"
    try:
        key = _key(jars, jvm_opts)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"java -version failed: {exc}"
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"spark-{key}.jsa"
    with open(cache / f"spark-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            os.utime(path)  # recently used: kept by _prune
            return path, "reused"
        _prune(cache)
        started = time.monotonic()
        fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".spark-{key}.", suffix=".jsa")
        os.close(fd)
        os.unlink(tmp)  # the JVM writes it at exit
        env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
               "JAVA_TOOL_OPTIONS": f"{jvm_opts} -XX:ArchiveClassesAtExit={tmp} {QUIET}".strip()}
        try:
            done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0 or not Path(tmp).is_file():
                return None, f"the archive run failed (exit {done.returncode}): {done.stderr[-2000:]}"
            os.replace(tmp, path)
        except subprocess.TimeoutExpired:
            return None, f"the archive run took over {BUILD_TIMEOUT_S} s"
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return path, f"made in {time.monotonic() - started:.0f} s"


def _workload() -> None:
    """What most tests do to a Spark JVM: a session, Arrow both ways, Parquet written and read, a
    Python UDF, pandas and Arrow map functions, a barrier stage, binary files, ML persistence."""
    import pandas as pd
    from pyspark import BarrierTaskContext
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import VectorAssembler
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    spark = (SparkSession.builder.master("local[2]").appName("sparkdl-jvm-archive")
             .config("spark.ui.enabled", "false").config("spark.sql.execution.arrow.pyspark.enabled", "true")
             .getOrCreate())
    try:
        with tempfile.TemporaryDirectory() as tmp:
            df = spark.createDataFrame(pd.DataFrame({"id": range(200), "x": [float(i) for i in range(200)]}))
            df.repartition(2).write.parquet(f"{tmp}/table")
            back = spark.read.parquet(f"{tmp}/table")
            back.groupBy((F.col("id") % 3).alias("k")).agg(F.sum("x")).toPandas()
            back.select(F.udf(lambda v: v * 2.0, "double")("x")).collect()
            back.mapInPandas(lambda it: (p for p in it), back.schema).count()
            back.mapInArrow(lambda it: (b for b in it), back.schema).count()

            def gang(rows):  # type: ignore[no-untyped-def]
                ctx = BarrierTaskContext.get()
                yield len(ctx.allGather(str(ctx.partitionId())))

            back.rdd.repartition(2).barrier().mapPartitions(gang).collect()
            Path(f"{tmp}/files").mkdir()
            Path(f"{tmp}/files/a.bin").write_bytes(b"\0" * 64)
            spark.read.format("binaryFile").load(f"{tmp}/files").count()
            model = Pipeline(stages=[VectorAssembler(inputCols=["x"], outputCol="v")]).fit(back)
            model.write().overwrite().save(f"{tmp}/model")
            spark.sparkContext.parallelize(range(10), 2).map(lambda v: v + 1).sum()
    finally:
        spark.stop()


if __name__ == "__main__":
    _workload()
