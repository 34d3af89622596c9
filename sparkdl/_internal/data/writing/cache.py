"""The dataset cache: ``write_dataset(df)`` without a path, keyed on what makes two writes the same.

Entries live under the directory the Spark conf ``spark.sparkdl.cacheDir`` names (default
``<system temp dir>/sparkdl-<uid>/cache``, private to this user: created 0700 and checked on the
driver before anything is read from or written into it). An entry is written beside its final
place and renamed, so a reader never sees a half-written one; the key it records in its manifest
is what a later write compares.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import posixpath
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from sparkdl._internal.common.errors import ConfigError, DatasetError
from sparkdl._internal.data.dataset import Dataset, written
from sparkdl._internal.data.format.manifest import MANIFEST_NAME, MANIFEST_VERSION
from sparkdl._internal.data.format.scan import path_info
from sparkdl._internal.data.writing.etl import (
    check_not_empty,
    exists,
    finish_manifest,
    qualify,
    spark_write,
)
from sparkdl._internal.fs.private import user_dir
from sparkdl._internal.fs.storage import filesystem, make_dirs, normalize_url, redact
from sparkdl._internal.spark import confs
from sparkdl._internal.spark.reach import Marker, probe_executors

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

CACHE_DIR_CONF = confs.CACHE_DIR.name


def cache_dir(spark: SparkSession) -> str:
    """The URL of the dataset cache: ``spark.sparkdl.cacheDir``, else this user's private default."""
    configured = spark.conf.get(CACHE_DIR_CONF, None)
    if configured:
        return qualify(spark, configured)  # the user's choice: used as given
    # The default is resolved, created and checked here, on the driver, before the cache is
    # looked up: an entry in a directory another user controls could be planted.
    return normalize_url(str(user_dir("cache", setting=CACHE_DIR_CONF)))


def _cache_key(df: DataFrame, options: Mapping[str, Any]) -> str:
    """What makes two writes the same: see write_dataset's docstring."""
    parts: dict[str, Any] = {
        "version": MANIFEST_VERSION,
        "schema": df.schema.json(),
        "semantic_hash": df.semanticHash(),
        "options": dict(options),
    }
    jdf = getattr(df, "_jdf", None)
    if jdf is not None:  # classic Spark: the canonical plan text (expression ids normalized)
        plan = str(jdf.queryExecution().optimizedPlan().canonicalized().toString())
        parts["plan"] = plan
        if "LogicalRDD" in plan or "ExistingRDD" in plan:
            # An RDD's rows live only in this application; its hash is its identity.
            parts["application"] = df.sparkSession.sparkContext.applicationId
    parts["inputs"] = _input_stamps(df.inputFiles())
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
    return "ds-" + digest[:32]


def _input_stamps(files: Sequence[str]) -> list[Any]:
    """``[url, size, mtime]`` of each input file; a random stamp when one cannot be read (a miss)."""
    by_fs: dict[str, list[tuple[str, str]]] = {}
    for f in sorted(files):
        url = normalize_url(f)
        parts = urlsplit(url)
        by_fs.setdefault(f"{parts.scheme}://{parts.netloc}", []).append((f, url))
    stamps: list[Any] = []
    for group in by_fs.values():
        try:
            fs, _ = filesystem(group[0][1], None)
            paths = [_filesystem_path(u) for _, u in group]
            infos = fs.get_file_info(paths)
            stamps += [[f, i.size, i.mtime_ns] for (f, _), i in zip(group, infos, strict=True)]
        except Exception:
            stamps += [[f, "unknown", uuid.uuid4().hex] for f, _ in group]
    return stamps


def _filesystem_path(url: str) -> str:
    # The path inside the filesystem of a normalized URL; remote ones keep their bucket or host.
    parts = urlsplit(url)
    return parts.path if parts.scheme == "file" else f"{parts.netloc}{parts.path}"


def write_cached(
    df: DataFrame, selected: DataFrame, array_columns: Sequence[str], options: Mapping[str, Any],
    cache_url: str | None = None, setting: str = CACHE_DIR_CONF,
) -> Dataset:
    """``write_dataset(df, path=None)``: the cached entry of ``df``, written first if there is none.

    ``selected`` is ``df`` made ready for feeding, ``array_columns`` its array columns, and
    ``options`` the arguments of the write, which are part of the key. ``cache_url``: the cache
    directory, by default :func:`cache_dir`'s; ``setting``: the conf that chose it, for messages.
    """
    import pyarrow.fs as pafs

    spark = df.sparkSession
    cache_url = qualify(spark, cache_url) if cache_url else cache_dir(spark)
    key = _cache_key(df, options)
    url = f"{cache_url}/{key}"
    fs, root = filesystem(url, None)
    cache_root = filesystem(cache_url, None)[1]
    manifest_path = posixpath.join(root, MANIFEST_NAME)
    try:
        make_dirs(fs, cache_root)
    except Exception as exc:
        raise DatasetError(
            f"cannot create the cache directory {redact(cache_url)} ({type(exc).__name__}: {exc}); "
            f"set the Spark conf {setting} to a writable directory, or pass a path"
        ) from exc
    _check_shared(spark, cache_url, setting)
    if path_info(fs, manifest_path, url).type == pafs.FileType.File:
        cached = Dataset(url)
        if cached.manifest.key == key:
            return cached
    check_not_empty(df)
    # Write beside the entry, then rename: a reader never sees a half-written entry.
    tmp_url = f"{cache_url}/.tmp-{key}-{uuid.uuid4().hex[:8]}"
    tmp_root = filesystem(tmp_url, None)[1]
    try:
        spark_write(selected, tmp_url, "error", options)
        manifest = finish_manifest(spark, fs, tmp_root, tmp_url, array_columns, key=key)
        if exists(fs, root, url):  # a stale entry without a valid manifest, or a racing writer
            if path_info(fs, manifest_path, url).type == pafs.FileType.File:
                return Dataset(url)
            fs.delete_dir(root)
        fs.move(tmp_root, root)
    finally:
        if exists(fs, tmp_root, tmp_url):
            fs.delete_dir(tmp_root)
    return written(url, manifest)


def _check_shared(spark: SparkSession, cache_url: str, setting: str = CACHE_DIR_CONF) -> None:
    """ConfigError unless every executor host sees the cache directory the driver sees.

    Executors write the entry and ranks read it: a directory on the driver's own disk would hold
    nothing on other hosts. Local modes (one host) and non-local URLs are not probed.
    """
    try:
        master = str(spark.sparkContext.master)
    except Exception:  # Spark Connect: no SparkContext, nothing to probe with
        return
    if master.startswith("local") or not cache_url.startswith("file://"):
        return
    marker = Marker.plant(cache_url)
    try:
        missing = probe_executors(spark, marker)
    finally:
        marker.remove()
    if missing:
        hosts = "; ".join(f"{host}: {why}" for host, why in missing)
        raise ConfigError(
            f"write_dataset(path=None) writes to the cache directory {redact(cache_url)}, which the "
            f"executors do not share with the driver (the driver wrote a marker there that these "
            f"executor hosts do not see: {hosts}). Set the Spark conf {setting} to storage "
            "that the driver and every executor reach (a shared mount, hdfs://, s3://...), or pass "
            "write_dataset a path on such storage"
        )


# -- who reads an entry: a file per process, so that one leaving deletes nothing another reads ------

_HOLDERS = "_holders"  # beside the Parquet files; readers go by the manifest, never list it


def hold(url: str) -> str:
    """Marks this process as a reader of the cache entry ``url``; returns the mark's name, for :func:`release`."""
    import os
    import socket

    from sparkdl._internal.common.proctree import started_at

    fs, root = filesystem(url)
    mark = f"{socket.gethostname()}-{os.getpid()}-{started_at(os.getpid()) or 0}"
    make_dirs(fs, posixpath.join(root, _HOLDERS))
    with fs.open_output_stream(posixpath.join(root, _HOLDERS, mark)):
        pass
    return mark


def release(url: str, mark: str) -> list[str]:
    """Takes this process's ``mark`` off the entry ``url``; returns the other holders that may still
    read it: processes alive on this host, and every holder on another (which cannot be checked
    from here). Marks of processes gone from this host are removed."""
    import socket

    import pyarrow.fs as pafs

    from sparkdl._internal.common.proctree import still_running

    fs, root = filesystem(url)
    base = posixpath.join(root, _HOLDERS)
    here = socket.gethostname()
    others = []
    for info in fs.get_file_info(pafs.FileSelector(base, allow_not_found=True)):
        name = posixpath.basename(info.path)
        host, pid, started = ([*name.rsplit("-", 2), "", ""])[:3]
        gone = host == here and pid.isdigit() and started.isdigit() and not still_running(int(pid), int(started) or None)
        if name == mark or gone:
            with contextlib.suppress(FileNotFoundError):
                fs.delete_file(info.path)
        else:
            others.append(name)
    return sorted(others)
