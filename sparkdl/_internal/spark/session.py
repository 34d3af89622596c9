"""Spark sessions and Spark confs, as the command line, the jobs and ``sparkdl.run`` set them up.

One reader of ``spark-defaults.conf``-style files (:func:`read_properties`), one parser of
``--conf KEY=VALUE`` (:func:`conf_pair`), the session a command creates for itself
(:func:`create_session`) and the session ``sparkdl.run`` runs on (:func:`resolve_session`).

This is a leaf: it imports the standard library and :mod:`sparkdl._internal.common.errors`; pyspark is imported
inside the functions that start or inspect a session, so that reading a file costs no JVM.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from sparkdl._internal.common.errors import ConfigError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["conf_pair", "create_session", "read_properties", "resolve_session"]

# The address a session of our own binds to when neither the user nor the environment chose one.
LOOPBACK = "127.0.0.1"


def read_properties(path: str | os.PathLike[str]) -> dict[str, str]:
    """Reads a ``spark-defaults.conf``-style file: ``key value`` (or ``key=value``, ``key: value``).

    Blank lines and lines starting with ``#`` or ``!`` are skipped. The value is the rest of the
    line, stripped, so it may contain spaces (Java options, paths). A line with a key and no
    separator raises :class:`~sparkdl._internal.common.errors.ConfigError` naming ``path:line``. A later line wins
    over an earlier one with the same key. A missing file raises ``FileNotFoundError``.

    For example, the lines ``spark.task.cpus 1`` and ``spark.driver.extraJavaOptions = -Da=1 -Db=2``
    read as ``{"spark.task.cpus": "1", "spark.driver.extraJavaOptions": "-Da=1 -Db=2"}``.
    """
    props: dict[str, str] = {}
    for number, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.strip()
        if not line or line[0] in "#!":
            continue
        key, sep, value = _split_property(line)
        if not sep:
            raise ConfigError(f"{path}:{number}: expected 'key value', got {raw!r}")
        props[key] = value
    return props


def _split_property(line: str) -> tuple[str, str, str]:
    # The key ends at the first whitespace, '=' or ':', as in java.util.Properties, which is what
    # spark-submit reads these files with; "key = value" and "key : value" are one separator.
    for i, ch in enumerate(line):
        if ch.isspace() or ch in "=:":
            value = line[i + 1 :].strip()
            if ch.isspace() and value[:1] in ("=", ":"):
                value = value[1:].strip()
            return line[:i], ch, value
    return line, "", ""


def conf_pair(text: str) -> tuple[str, str]:
    """``--conf KEY=VALUE`` as ``(key, value)``: an argparse ``type``.

    The value is everything after the first ``=``, unstripped (``spark.y=a=b`` is ``("spark.y",
    "a=b")``); the key is stripped. Without ``=`` or a key it raises
    ``argparse.ArgumentTypeError``, which argparse reports as a usage error.
    """
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"--conf takes KEY=VALUE, e.g. spark.executor.memory=2g; got {text!r}")
    return key.strip(), value


def create_session(master: str | None, confs: Mapping[str, str], app_name: str, default_master: str) -> SparkSession:
    """The session a command creates for itself (``sparkdl doctor``, ``sparkdl run``, jobs/*.py).

    The master is ``master``, else ``spark.master`` from ``confs``, else ``default_master``.
    With a local master every socket stays on loopback (``SPARK_LOCAL_IP``, default 127.0.0.1)
    and the Python workers run ``spark.pyspark.python``, else this interpreter, which has torch
    and sparkdl. The console progress bar is off unless ``confs`` turn it on. Settings the
    caller's environment already has (``SPARK_LOCAL_IP``, ``PYSPARK_PYTHON``) are kept.
    """
    from pyspark.sql import SparkSession

    confs = dict(confs)
    conf_master = confs.pop("spark.master", None)
    master = master or conf_master or default_master
    # pyspark takes the workers' Python from PYSPARK_PYTHON; only spark-submit turns
    # spark.pyspark.python into it, so a session started from Python needs the variable.
    if master.startswith("local"):
        ip = os.environ.setdefault("SPARK_LOCAL_IP", LOOPBACK)
        confs.setdefault("spark.driver.host", ip)
        confs.setdefault("spark.driver.bindAddress", ip)
        os.environ.setdefault("PYSPARK_PYTHON", confs.get("spark.pyspark.python", sys.executable))
    elif "spark.pyspark.python" in confs:
        os.environ.setdefault("PYSPARK_PYTHON", confs["spark.pyspark.python"])
    confs.setdefault("spark.ui.showConsoleProgress", "false")
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in confs.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def resolve_session(spark: SparkSession | None, num_workers: int) -> SparkSession:
    """The session ``sparkdl.run`` runs on: ``spark``, else the active one (classic or Spark
    Connect), else a new local one.

    A new session is ``local[max(num_workers, cores)]`` on ``SPARK_LOCAL_IP`` (default
    127.0.0.1), with this interpreter as the workers' Python. Raises
    :class:`~sparkdl._internal.common.errors.ConfigError` when ``spark`` is not the active session, or when it
    has been stopped.
    """
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if spark is not None and active is not None and spark is not active:
        raise ConfigError(
            "the SparkSession passed as spark= is not the active session of this process; "
            "pass the active session (SparkSession.getActiveSession()) or none"
        )
    session = spark or active
    if session is None:
        # PySpark takes its workers' Python from PYSPARK_PYTHON, not from a builder conf: without
        # it, executors would run whatever "python3" is first on PATH, without torch or sparkdl.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        cores = max(num_workers, os.cpu_count() or 1)
        session = (
            SparkSession.builder.master(f"local[{cores}]")
            .appName("sparkdl")
            .config("spark.pyspark.python", sys.executable)
            .config("spark.driver.host", os.environ.get("SPARK_LOCAL_IP", LOOPBACK))
            .config("spark.driver.bindAddress", os.environ.get("SPARK_LOCAL_IP", LOOPBACK))
            .getOrCreate()
        )
    if type(session).__module__.startswith("pyspark.sql.connect"):
        if getattr(session, "is_stopped", False):
            raise ConfigError("the Spark Connect session has been stopped; create a new one before sparkdl.run")
        return session
    sc = session.sparkContext
    if sc._jsc is None:
        raise ConfigError("the SparkSession has been stopped; create a new one before sparkdl.run")
    return session
