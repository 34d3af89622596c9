"""``write_dataset``: a Spark DataFrame written as Parquet laid out for feeding, with a manifest."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.common.validate import int_at_least, one_of
from sparkdl._internal.data.dataset import Dataset, written
from sparkdl._internal.data.format.scan import path_info
from sparkdl._internal.data.writing import etl
from sparkdl._internal.data.writing.cache import write_cached
from sparkdl._internal.fs.storage import filesystem, redact, unreachable
from sparkdl._internal.spark import spark_api

if TYPE_CHECKING:
    import pyarrow.fs as pafs
    from pyspark.sql import Column, DataFrame

_DEFAULT_ROW_GROUP_BYTES = 8 * 1024 * 1024


def write_dataset(
    df: DataFrame,
    path: str | os.PathLike[str] | None = None,
    *,
    overwrite: bool = False,
    num_files: int | None = None,
    row_group_bytes: int = _DEFAULT_ROW_GROUP_BYTES,
    row_group_rows: int | None = None,
    vector_dtype: str = "float32",
    compression: str = "snappy",
) -> Dataset:
    """Writes ``df`` as Parquet laid out for feeding, with a manifest, and returns its :class:`Dataset`.

    Spark does the work: ML vectors become dense float arrays (``vector_to_array``), the rows are
    spread round-robin over ``num_files`` files of equal size, and each file is cut into row
    groups of about ``row_group_bytes``. The driver then writes the manifest (columns, files,
    row groups, row counts, array lengths) next to the data; a directory with a manifest is
    complete. Besides the write, Spark runs a ``limit 1`` job to refuse an empty DataFrame and,
    when there are array columns, one job that reads them back to record which are of fixed
    length.

    Supported column types: byte, short, int, long, float, double and boolean; arrays of those,
    fixed- or variable-length; Spark ML vectors (``pyspark.ml.linalg`` or ``pyspark.mllib.linalg``),
    dense or sparse; binary; string; timestamps, written as int64 microseconds since the epoch
    (UTC), as ``unix_micros`` gives them; and the struct of Spark's ``image`` source, which the
    loader decodes with ``decode={"image": sparkdl.ImageDecoder(...)}``. Images read with the
    ``binaryFile`` source (``path``, ``modificationTime``, ``length``, ``content``) go as they are;
    the default row groups (8 MiB) then hold about 150 photos of 50 KiB each.

    Cache: with ``path=None`` the data goes under the directory named by the Spark conf
    ``spark.sparkdl.cacheDir`` (default ``<system temp dir>/sparkdl-<uid>/cache``, a directory
    private to this user, which suits local mode; on a cluster point it at storage every executor
    and the driver share). The cache entry is keyed on the DataFrame's canonicalized optimized
    plan and ``semanticHash()``, its schema, its input files (``df.inputFiles()``) with their sizes
    and modification times, the application id when the plan reads an in-memory RDD, and the
    arguments of this call. Writing the same plan over unchanged inputs again returns the existing
    entry without running a job.
    A plan that is not deterministic (``rand()`` without a seed, ``current_timestamp()``) still
    hits the cache; pass a ``path`` to control such writes.

    Example::

        ds = sparkdl.write_dataset(spark.read.table("events").select("label", "features"))
        sparkdl.run(train, ds, num_workers=4)

    Args:
        df: the DataFrame to write.
        path: where to write (local path or a URL Spark can write and the driver can read,
            e.g. ``hdfs://nn:8020/data`` or ``s3a://bucket/data``); ``None``: the cache.
        overwrite: replace what ``path`` holds. Without it, a ``path`` that holds anything is
            an error and nothing is deleted.
        num_files: Parquet files to write, of equal row counts; default: the session's default
            parallelism. A multiple of the number of ranks keeps each rank on few files.
        row_group_bytes: target row-group size (Parquet's ``parquet.block.size``); the loader
            reads whole row groups, so smaller groups mean finer sharding and shuffling, larger
            ones faster scans. The loader's shuffle window spans 4 row groups (at most
            128 MiB) and it holds two windows at a time, so the 8 MiB default keeps a rank's
            feed near 64 MiB. The size is checked every 10 rows at first, so that wide rows
            (images) do not overshoot it by much.
        row_group_rows: at most this many rows per row group (Parquet's
            ``parquet.block.row.count.limit``), whichever of the two limits comes first.
        vector_dtype: ``"float32"`` or ``"float64"``, the element type ML vectors become.
        compression: Parquet codec (``snappy``, ``zstd``, ``gzip``, ``none``...).

    Raises:
        ConfigError: an unsupported column type (all such columns are named with their types),
            an empty DataFrame, a ``path`` that already holds data, a bad argument, or a default
            cache directory that is not private (a symlink, another user's, or writable by others).
        DatasetError: ``path`` (or the cache directory) cannot be reached, or Spark failed to write.
    """
    return write_to(df, path, options=WriteOptions.from_call(locals()))


@dataclass(frozen=True)
class WriteOptions:
    """``write_dataset``'s keywords (documented there) as one object, checked when made."""

    overwrite: bool = False
    num_files: int | None = None
    row_group_bytes: int = _DEFAULT_ROW_GROUP_BYTES
    row_group_rows: int | None = None
    vector_dtype: str = "float32"
    compression: str = "snappy"

    def __post_init__(self) -> None:
        one_of("vector_dtype", self.vector_dtype, {"float32": "half the bytes", "float64": "Spark ML's own"})
        int_at_least("row_group_bytes", self.row_group_bytes, 1024, note=" bytes")
        int_at_least("row_group_rows", self.row_group_rows, 1, allow_none=True, note=" (None: no row limit)")
        int_at_least("num_files", self.num_files, 1, allow_none=True, note=" (None: the session's default parallelism)")

    @classmethod
    def from_call(cls, arguments: dict[str, Any]) -> WriteOptions:
        """The options of a ``write_dataset`` call, from its ``locals()`` taken first thing."""
        return cls(**{f.name: arguments[f.name] for f in dataclasses.fields(cls)})


def write_to(df: DataFrame, path: str | os.PathLike[str] | None, cache: tuple[str, str] | None = None, *,
             options: WriteOptions = WriteOptions(), as_partitions: bool = False) -> Dataset:
    """:func:`write_dataset`; with ``path=None`` and ``cache=(url, conf)``, the cache is the
    directory ``url`` (which Spark and the driver reach), set by the Spark conf ``conf``, instead of
    ``spark.sparkdl.cacheDir``'s. ``as_partitions``: a file per partition of ``df`` (``num_files``
    unused), as Petastorm's converter writes."""
    # Duck-typed, so that Spark Connect DataFrames (another class on pyspark 3.5) pass too.
    if not all(hasattr(df, a) for a in ("sparkSession", "schema", "write", "semanticHash")):
        raise ConfigError(f"df must be a pyspark.sql.DataFrame; got {type(df).__name__}")
    row_group_rows, vector_dtype = options.row_group_rows, options.vector_dtype
    if row_group_rows is not None:
        import pyspark

        if int(pyspark.__version__.split(".")[0]) < 4:
            # Spark 3.5 ships parquet-mr 1.13, which ignores parquet.block.row.count.limit.
            raise ConfigError(
                f"row_group_rows={row_group_rows} needs Spark 4 (its Parquet writer caps row groups by "
                f"row count; pyspark {pyspark.__version__} would silently ignore it); size row groups "
                "with row_group_bytes instead"
            )
    spark = df.sparkSession
    num_files = None if as_partitions else options.num_files or spark_api.of(spark).default_parallelism()
    selected, array_columns = _select_for_feeding(df, vector_dtype)

    written_with = {
        "num_files": num_files,
        "row_group_bytes": options.row_group_bytes,
        "row_group_rows": row_group_rows,
        "vector_dtype": vector_dtype,
        "compression": options.compression,
    }
    if path is None:
        return write_cached(df, selected, array_columns, written_with, *(cache or ()))

    url = etl.qualify(spark, path)
    fs, root = filesystem(url, None)
    _check_target(fs, root, url, options.overwrite)
    etl.check_not_empty(df)
    etl.spark_write(selected, url, "overwrite" if etl.exists(fs, root, url) else "error", written_with)
    manifest = etl.finish_manifest(spark, fs, root, url, array_columns, key=None)
    return written(url, manifest)


IMAGE_FIELDS = frozenset({"origin", "height", "width", "nChannels", "mode", "data"})
"""The fields of the struct that Spark's ``image`` source reads (``spark.read.format("image")``)."""


def _select_for_feeding(df: DataFrame, vector_dtype: str) -> tuple[DataFrame, list[str]]:
    """The DataFrame with vectors made arrays, and the names of its array columns.

    Raises ConfigError naming every column whose type cannot be fed, before any job runs.
    """
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.mllib.linalg import VectorUDT as OldVectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    numeric = (T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.FloatType, T.DoubleType, T.BooleanType)
    columns: list[Column] = []
    arrays: list[str] = []
    bad: list[str] = []
    names = [f.name for f in df.schema.fields]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"the DataFrame has duplicate column names {dupes}; rename them (df.toDF(...)) first")
    for field in df.schema.fields:
        t = field.dataType
        col = df[field.name]
        if isinstance(t, (*numeric, T.BinaryType, T.StringType)):
            columns.append(col)
        elif isinstance(t, T.ArrayType) and isinstance(t.elementType, numeric):
            columns.append(col)
            arrays.append(field.name)
        elif isinstance(t, (VectorUDT, OldVectorUDT)):
            columns.append(vector_to_array(col, vector_dtype).alias(field.name))
            arrays.append(field.name)
        elif isinstance(t, T.TimestampType):  # binaryFile's modificationTime, among others
            columns.append(F.unix_micros(col).alias(field.name))
        elif isinstance(t, T.StructType) and {f.name for f in t.fields} >= IMAGE_FIELDS:
            columns.append(col)  # Spark's image source: decoded by sparkdl.ImageDecoder in the loader
        else:
            bad.append(f"{field.name!r} ({t.simpleString()})")
    if bad:
        raise ConfigError(
            f"write_dataset cannot feed the column(s) {', '.join(bad)} to torch. Supported: byte, "
            "short, int, long, float, double, boolean, arrays of those, ML vectors, binary, "
            "string, timestamps (as microseconds) and the image source's struct. Cast them "
            "(decimals and dates to double or long, e.g. "
            "df.withColumn(name, df[name].cast('double'))), encode them as binary, or drop them"
        )
    return df.select(*columns), arrays


def _check_target(fs: pafs.FileSystem, root: str, url: str, overwrite: bool) -> None:
    import pyarrow.fs as pafs

    info = path_info(fs, root, url)
    if info.type == pafs.FileType.NotFound or overwrite:
        return
    if info.type == pafs.FileType.File:
        held = 1
    else:
        try:
            held = len(fs.get_file_info(pafs.FileSelector(root, recursive=False)))
        except Exception as exc:
            raise unreachable(url, exc) from exc
    if held:
        raise ConfigError(
            f"path {redact(url)!r} already holds data ({held} entr{'y' if held == 1 else 'ies'}); "
            "nothing was written or deleted. Pass overwrite=True to replace it, or choose another "
            "path (or path=None to use the cache)"
        )
