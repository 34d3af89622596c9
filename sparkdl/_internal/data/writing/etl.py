"""The steps of ``write_dataset`` that a write to a path and a write to the cache share.

Spark writes the Parquet files; then the driver reads their footers back, asks Spark which
array columns are of one length, and writes the manifest next to the data. A directory with a
manifest is complete.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from sparkdl._internal.common.errors import ConfigError, DatasetError
from sparkdl._internal.data.format.manifest import ARRAY, MANIFEST_NAME, ColumnSpec, Manifest
from sparkdl._internal.data.format.scan import manifest_from_footers, path_info
from sparkdl._internal.fs.storage import normalize_url, redact, unreachable

if TYPE_CHECKING:
    import pyarrow.fs as pafs
    from pyspark.sql import DataFrame, SparkSession


def qualify(spark: SparkSession, path: str | os.PathLike[str]) -> str:
    """A URL that means the same place to Spark (Hadoop) and to pyarrow."""
    text = os.fspath(path)
    if len(urlsplit(text).scheme) > 1:
        return normalize_url(text)
    default_fs = "file:///"
    try:
        hadoop_conf = spark.sparkContext._jsc.hadoopConfiguration()
        default_fs = hadoop_conf.get("fs.defaultFS") or default_fs
    except Exception:  # Spark Connect: only the session's SQL confs are visible
        default_fs = spark.conf.get("spark.hadoop.fs.defaultFS", None) or default_fs
    if default_fs.startswith("file:"):
        return normalize_url(text)
    if not text.startswith("/"):
        raise ConfigError(
            f"path {text!r} is relative and Spark's default filesystem is {default_fs}; give an "
            "absolute path or a full URL (e.g. hdfs://namenode:8020/data/x)"
        )
    return default_fs.rstrip("/") + text


def _spark_url(url: str) -> str:
    # Spark (Hadoop) and pyarrow spell local URLs alike; s3:// needs Hadoop's s3a connector.
    return url.replace("s3://", "s3a://", 1) if url.startswith("s3://") else url


def exists(fs: pafs.FileSystem, root: str, url: str) -> bool:
    """Whether ``root`` (of ``url``) is there; DatasetError when the storage cannot be reached."""
    import pyarrow.fs as pafs

    return bool(path_info(fs, root, url).type != pafs.FileType.NotFound)


def check_not_empty(df: DataFrame) -> None:
    """ConfigError when ``df`` has no rows (Spark runs a ``limit 1`` job to tell)."""
    if df.isEmpty():
        raise ConfigError(
            "the DataFrame passed to write_dataset has no rows, so there is nothing to train on; "
            "check its source and filters"
        )


def spark_write(df: DataFrame, url: str, mode: str, options: Mapping[str, Any]) -> None:
    """Spark writes ``df`` to ``url`` as Parquet, cut as ``options`` (write_dataset's arguments) say.

    Raises DatasetError, with the first line of Spark's error, when the write fails.
    """
    # num_files None: the DataFrame's own partitions, a file each, cut by Spark's defaults as
    # Petastorm's converter writes them (so that its row groups, and so its shards, are the same).
    as_is = options["num_files"] is None
    writer = (
        (df if as_is else df.repartition(int(options["num_files"])))
        .write.mode(mode)
        .option("parquet.block.size", str(options["row_group_bytes"]))
        .option("compression", str(options["compression"]))
    )
    if not as_is:  # parquet-mr first measures a row group after 100 rows: too late for wide rows.
        writer = writer.option("parquet.page.size.row.check.min", "10")
    if options.get("row_group_rows"):
        writer = writer.option("parquet.block.row.count.limit", str(options["row_group_rows"]))
    try:
        writer.parquet(_spark_url(url))
    except Exception as exc:
        raise DatasetError(
            f"Spark failed to write {redact(url)}: {type(exc).__name__}: {_first_line(exc)}. Check "
            "that every executor can write there (a local path must be on storage the driver and "
            "the executors share) and that the DataFrame computes"
        ) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else repr(exc)


def _array_lengths(
    spark: SparkSession, url: str, files: Sequence[str], array_columns: Sequence[str]
) -> dict[str, int | None]:
    """Each array column's length if every row has the same one (and none is null), else None.

    Spark reads the ``files`` written under ``url`` by name: the cache writes into a hidden
    ``.tmp-...`` directory first, which Spark ignores, with a warning, when given the directory."""
    if not array_columns:
        return {}
    from pyspark.sql import functions as F

    base = _spark_url(url).rstrip("/")
    written = spark.read.parquet(*(f"{base}/{name}" for name in files))
    aggs = []
    for i, name in enumerate(array_columns):
        col = written[name]
        aggs += [
            F.min(F.size(col)).alias(f"lo{i}"),
            F.max(F.size(col)).alias(f"hi{i}"),
            F.count(F.when(col.isNull(), 1)).alias(f"nulls{i}"),
        ]
    row = written.agg(*aggs).collect()[0]
    lengths: dict[str, int | None] = {}
    for i, name in enumerate(array_columns):
        lo, hi, nulls = row[f"lo{i}"], row[f"hi{i}"], row[f"nulls{i}"]
        lengths[name] = int(lo) if lo is not None and lo == hi and lo >= 0 and nulls == 0 else None
    return lengths


def finish_manifest(
    spark: SparkSession,
    fs: pafs.FileSystem,
    root: str,
    url: str,
    array_columns: Sequence[str],
    key: str | None,
) -> Manifest:
    """Writes the manifest of the Parquet just written under ``root``, and returns it.

    The array columns whose every row has one length are recorded with it (Spark reads them
    back to tell); ``key`` is the cache key, or ``None`` for a write to a path.
    """
    base = manifest_from_footers(fs, root, url, None)
    lengths = _array_lengths(spark, url, [f.path for f in base.files], array_columns)
    columns = tuple(
        ColumnSpec(c.name, c.kind, c.dtype, lengths.get(c.name, c.length)) if c.kind == ARRAY else c
        for c in base.columns
    )
    manifest = Manifest(columns=columns, files=base.files, written_by_sparkdl=True, key=key)
    try:
        with fs.open_output_stream(posixpath.join(root, MANIFEST_NAME)) as out:
            out.write(manifest.to_json().encode())
    except Exception as exc:
        raise unreachable(url, exc) from exc
    return manifest
