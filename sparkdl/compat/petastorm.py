"""Petastorm's Spark converter without Petastorm: ``make_spark_converter`` and
``SparkDatasetConverter`` with the names, defaults and batch format of Petastorm 0.13's
``petastorm.spark``, built on sparkdl's cache and loader. Change one import::

    # from petastorm.spark import SparkDatasetConverter, make_spark_converter
    from sparkdl.compat.petastorm import SparkDatasetConverter, make_spark_converter

    spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, "file:///dbfs/tmp/cache")
    converter = make_spark_converter(df)
    with converter.make_torch_dataloader(batch_size=32, cur_shard=rank, shard_count=size) as loader:
        for batch in loader:                # {column: tensor}, forever unless num_epochs is given
            ...

It runs where Petastorm's does not: Spark 4, pyarrow >= 15 and Spark Connect (never ``df._jdf``).
The files are Petastorm's (a file per partition of the DataFrame, Spark's row groups), and so
are the shards: rank ``r`` of ``W`` reads the row groups ``g`` with ``g % W == r``, counted along
``file_urls`` (sorted by name; Petastorm's are Spark's ``inputFiles()``, in no set order). Where those shards hold unequal rows (Petastorm's ranks would then run out at
different steps and a collective would hang), every shard instead takes an equal share of the
row groups' stream: the same number of batches per epoch on every rank, each row once (a few
repeated to even them out).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import logging
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.common.validate import int_at_least, invalid
from sparkdl._internal.data.decoding.row_transform import (
    RowTransform,
    TransformSpec,
    from_petastorm,
)
from sparkdl._internal.data.decoding.samples import ROW
from sparkdl._internal.data.loader_options import LoaderOptions
from sparkdl._internal.data.writing.cache import hold, release
from sparkdl._internal.fs.storage import redact

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from sparkdl._internal.data.dataset import Dataset
    from sparkdl._internal.data.loader import Loader

__all__ = ["SparkDatasetConverter", "TransformSpec", "make_spark_converter"]

log = logging.getLogger(__name__)

DEFAULT_ROW_GROUP_SIZE_BYTES = 32 * 1024 * 1024
_CODECS = ("uncompressed", "bzip2", "gzip", "lz4", "snappy", "deflate")
# Petastorm names them, but Spark's Parquet writer has no such codec.
_NOT_IN_SPARK = ("bzip2", "deflate")
# Horovod's rank and size, as Petastorm looks for them (Horovod, Open MPI, MPICH).
_HOROVOD_ENV = (("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                ("PMI_RANK", "PMI_SIZE"))
# make_batch_reader keywords that tune Petastorm's own machinery: accepted, without effect.
_NO_EFFECT = frozenset({"reader_pool_type", "results_queue_size", "zmq_copy_buffers", "hdfs_driver", "shard_seed",
                        "cache_type", "cache_location", "cache_size_limit", "cache_row_size_estimate",
                        "cache_extra_settings"})
# Those that change what is read, with what to do instead.
_INSTEAD = {
    "predicate": "filter the DataFrame before make_spark_converter (df.filter(...))",
    "filters": "filter the DataFrame before make_spark_converter (df.filter(...))",
    "rowgroup_selector": "filter the DataFrame before make_spark_converter (df.filter(...))",
    "shuffle_row_drop_partitions": "leave it at 1",
    "filesystem": "pass storage_options instead (credentials, endpoints)",
}


class SparkDatasetConverter:
    """One DataFrame materialized as Parquet, from which to make torch data loaders; picklable.

    Made by :func:`make_spark_converter`. ``len(converter)`` is the number of rows.

    Attributes:
        cache_dir_url: the directory the DataFrame was written to.
        file_urls: its Parquet files.
        dataset_size: its rows.
    """

    PARENT_CACHE_DIR_URL_CONF = "petastorm.spark.converter.parentCacheDirUrl"

    def __init__(self, cache_dir_url: str, file_urls: list[str], dataset_size: int) -> None:
        self.cache_dir_url = cache_dir_url
        self.file_urls = file_urls
        self.dataset_size = dataset_size
        self._dataset: Dataset | None = None

    def __len__(self) -> int:
        return self.dataset_size

    def dataset(self, storage_options: Mapping[str, Any] | None = None) -> Dataset:
        """The :class:`sparkdl.Dataset` of ``cache_dir_url``, for sparkdl's own loader."""
        from sparkdl._internal.data.dataset import Dataset

        if storage_options:
            return Dataset(self.cache_dir_url, storage_options=storage_options)
        if self._dataset is None:
            self._dataset = Dataset(self.cache_dir_url)
        return self._dataset

    def make_torch_dataloader(
        self,
        batch_size: int = 32,
        num_epochs: int | None = None,
        workers_count: int | None = None,
        shuffling_queue_capacity: int = 0,
        data_loader_fn: Any = None,
        **petastorm_reader_kwargs: Any,
    ) -> TorchDataLoaderContext:
        """A context manager whose value iterates over batches, ``{column: tensor}``, as
        ``petastorm.pytorch.DataLoader``'s do.

        Args:
            batch_size: rows per batch (the last of an epoch may hold fewer).
            num_epochs: passes over the shard; None: without end.
            workers_count: threads decoding row groups (sparkdl's ``read_threads``).
            shuffling_queue_capacity: > 0: rows are also shuffled within windows of about this
                many rows (``shuffle_window``); row groups are shuffled unless
                ``shuffle_row_groups=False``.
            data_loader_fn: Petastorm's loader classes only (``petastorm.pytorch.DataLoader``,
                ``BatchedDataLoader``), which this reproduces; another is refused, since no Petastorm
                reader is made to hand it.
            petastorm_reader_kwargs: ``cur_shard`` and ``shard_count`` (default: Horovod's rank
                and size from the environment when set, else one shard of everything, as in
                Petastorm), ``shuffle_row_groups`` (True), ``shuffle_rows``, ``seed`` (default 0:
                the same order in every run), ``schema_fields`` (column names, or fields with a
                ``name``), ``storage_options``; ``transform_spec``: a :class:`TransformSpec` (or
                Petastorm's), whose ``func`` runs one row at a time on decode processes, with the
                row's own random draws (Python's, numpy's and torch's global generators seeded by
                the row); keywords that tune Petastorm's reader pool or cache have no effect;
                ``on_bad_sample`` (sparkdl's: ``"raise"`` or ``"skip"`` a row on which
                ``func`` raises); ``predicate``, ``filters``, ``rowgroup_selector`` and the rest are
                refused with what to do instead.

        Raises:
            ConfigError: (a ``ValueError``) a keyword without an equivalent, or bad shards.
        """
        options = _reader_options(batch_size, num_epochs, workers_count, shuffling_queue_capacity, data_loader_fn,
                                  petastorm_reader_kwargs)
        return TorchDataLoaderContext(self, options)

    def make_tf_dataset(self, batch_size: int | None = None, prefetch: int | None = None, num_epochs: int | None = None,
                        workers_count: int | None = None, shuffling_queue_capacity: int | None = None,
                        **petastorm_reader_kwargs: Any) -> Any:
        """A context manager whose value is a ``tf.data.Dataset`` of batches as Petastorm's: one
        namedtuple of tensors a batch (``batch.features``), ``num_epochs`` passes over the shard
        (None: without end), ``prefetch`` batches ahead (None: TensorFlow's autotuning). The
        shard, the keywords and the refusals are :meth:`make_torch_dataloader`'s; every shard has
        the same batches per epoch. Needs TensorFlow (``backend="tensorflow"`` ranks have it).
        """
        options = _reader_options(batch_size or 32, num_epochs, workers_count, shuffling_queue_capacity or 0, None,
                                  petastorm_reader_kwargs)
        return _tf_dataset(self, options, prefetch)

    def delete(self) -> None:
        """Deletes the converter's files (``cache_dir_url``), unless another process that made the
        same converter (the same DataFrame writes to the same place) still reads them: that one's
        delete, or its exit, deletes them."""
        _let_go(self.cache_dir_url)


class TorchDataLoaderContext:
    """What ``make_torch_dataloader`` returns: ``with ... as loader`` opens the shard's loader
    and closes it (its threads) on exit."""

    def __init__(self, converter: SparkDatasetConverter, options: _Read) -> None:
        self._converter = converter
        self._options = options
        self._loader: TorchDataLoader | None = None

    def __enter__(self) -> TorchDataLoader:
        self._loader = TorchDataLoader(self._converter, self._options)
        return self._loader

    def __exit__(self, *exc: object) -> None:
        if self._loader is not None:
            self._loader.close()
            self._loader = None


class TorchDataLoader:
    """Batches of one shard, ``{column: tensor}``, epoch after epoch (``num_epochs``, or without end).

    ``steps_per_epoch`` is the same on every shard. Boolean columns come as ``uint8`` tensors, as
    from Petastorm; strings as lists of ``str`` (Petastorm's torch loader refuses them).
    """

    def __init__(self, converter: SparkDatasetConverter, options: _Read) -> None:
        self.num_epochs: int | None = options.num_epochs
        self._loader: Loader = _loader(converter, options)

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch, the same on every shard."""
        return len(self._loader)

    def __len__(self) -> int:
        if self.num_epochs is None:
            raise TypeError("this loader has no length: num_epochs=None runs without end (see steps_per_epoch)")
        return self.num_epochs * len(self._loader)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        import torch

        epochs = range(self.num_epochs) if self.num_epochs is not None else itertools.count()
        for epoch in epochs:
            self._loader.set_epoch(epoch)
            for batch in self._loader:
                yield {name: value.to(torch.uint8) if getattr(value, "dtype", None) == torch.bool else value
                       for name, value in batch.items()}

    def close(self) -> None:
        self._loader.close()


@contextlib.contextmanager
def _tf_dataset(converter: SparkDatasetConverter, options: _Read, prefetch: int | None) -> Iterator[Any]:
    from sparkdl._internal.data.tfdata import named_batches, tf_dataset

    loader = _loader(converter, options)
    try:
        yield named_batches(tf_dataset(loader), options.num_epochs, prefetch)
    finally:
        loader.close()


def _loader(converter: SparkDatasetConverter, options: _Read) -> Loader:
    """sparkdl's loader of the converter's files (:func:`_reader_options`), sharded as Petastorm
    shards where its shards hold equal rows."""
    from sparkdl._internal.data import loader

    return loader.Loader(converter.dataset(options.storage_options), options.loader)


def make_spark_converter(
    df: DataFrame,
    parquet_row_group_size_bytes: int = DEFAULT_ROW_GROUP_SIZE_BYTES,
    compression_codec: str | None = None,
    dtype: str | None = "float32",
) -> SparkDatasetConverter:
    """Writes ``df`` as Parquet under the Spark conf ``petastorm.spark.converter.parentCacheDirUrl``
    (once: the same DataFrame over unchanged inputs reuses its files) and returns its converter.

    Args:
        df: the DataFrame; ML vectors become arrays.
        parquet_row_group_size_bytes: row-group size of the files.
        compression_codec: ``None`` (uncompressed), ``"uncompressed"``, ``"gzip"``, ``"lz4"`` or
            ``"snappy"``.
        dtype: ``"float32"`` (double columns, arrays and vectors become float), ``"float64"``
            (float become double), or None (as they are; vectors become double arrays).

    Raises:
        ConfigError: (a ``ValueError``) the conf is unset, or a bad argument.

    The files are deleted at the driver's exit, as Petastorm's are, or by ``converter.delete()``.
    """
    from sparkdl._internal.data.writing.write import WriteOptions, write_to

    spark = df.sparkSession
    parent = spark.conf.get(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, None)
    if not parent:
        raise ConfigError(
            f"make_spark_converter writes the DataFrame under the Spark conf "
            f"{SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF}, which is unset: set it to a directory the driver "
            "and every executor reach, e.g. spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, "
            "'file:///dbfs/tmp/converter') (or use sparkdl.write_dataset(df), which has a default)"
        )
    codec = (compression_codec or "uncompressed").lower()
    if codec not in _CODECS or codec in _NOT_IN_SPARK:
        raise invalid("compression_codec", compression_codec, "None (uncompressed), 'uncompressed', 'gzip', 'lz4' or 'snappy'"
                      + (" (Spark's Parquet writer has no bzip2 or deflate codec)" if codec in _NOT_IN_SPARK else ""))
    if dtype not in (None, "float32", "float64"):
        raise invalid("dtype", dtype, "'float32', 'float64' or None (floating-point columns as they are)")
    ds = write_to(_with_precision(df, dtype), None, (str(parent), SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF),
                  options=WriteOptions(row_group_bytes=parquet_row_group_size_bytes, vector_dtype=dtype or "float64",
                                       compression=codec), as_partitions=True)
    root = ds.url.rstrip("/")
    converter = SparkDatasetConverter(ds.url, [f"{root}/{f.path}" for f in ds.manifest.files], ds.num_rows)
    converter._dataset = ds
    if ds.url not in _HELD:
        _HELD[ds.url] = hold(ds.url)
    return converter


def _with_precision(df: DataFrame, dtype: str | None) -> DataFrame:
    """``df`` with its floating-point columns (and arrays of them) cast to ``dtype``."""
    if dtype is None:
        return df
    from pyspark.sql import types as T

    source, target = (T.DoubleType, T.FloatType()) if dtype == "float32" else (T.FloatType, T.DoubleType())
    for field in df.schema.fields:
        kind = field.dataType
        if isinstance(kind, source):
            df = df.withColumn(field.name, df[field.name].cast(target))
        elif isinstance(kind, T.ArrayType) and isinstance(kind.elementType, source):
            df = df.withColumn(field.name, df[field.name].cast(T.ArrayType(target)))
    return df


@dataclasses.dataclass(frozen=True)
class _Read:
    """What ``make_torch_dataloader``/``make_tf_dataset`` ask for, in sparkdl's terms."""

    loader: LoaderOptions
    num_epochs: int | None  # None: without end
    storage_options: Any


def _reader_options(batch_size: int, num_epochs: int | None, workers_count: int | None, capacity: int,
                    data_loader_fn: Any, kwargs: dict[str, Any]) -> _Read:
    """The loader's options (with ``num_epochs`` and ``storage_options``) for Petastorm's keywords."""
    if data_loader_fn is not None and not (
        getattr(data_loader_fn, "__module__", "") == "petastorm.pytorch"
        and getattr(data_loader_fn, "__name__", "") in ("DataLoader", "BatchedDataLoader")
    ):
        raise ConfigError(
            f"data_loader_fn={data_loader_fn!r}: it would build a loader on a Petastorm reader, which sparkdl's "
            "converter does not make. Leave it out (the batches are dicts of tensors, as petastorm.pytorch's "
            "DataLoader gives) and wrap the loader the context manager returns"
        )
    int_at_least("num_epochs", num_epochs, 1, allow_none=True, note=" (None: without end)")
    for name in kwargs:
        if name in _INSTEAD and kwargs[name] not in (None, 1):
            raise ConfigError(f"make_torch_dataloader({name}=...) has no equivalent in sparkdl's converter: {_INSTEAD[name]}")
        if name not in _INSTEAD and name not in _NO_EFFECT and name not in (
            "cur_shard", "shard_count", "shuffle_row_groups", "shuffle_rows", "seed", "schema_fields", "storage_options",
            "transform_spec", "on_bad_sample",
        ):
            raise ConfigError(
                f"make_torch_dataloader({name}=...) is not a keyword of Petastorm's make_batch_reader that sparkdl's "
                "converter knows; leave it out"
            )
    rank, size = _shard(kwargs.get("cur_shard"), kwargs.get("shard_count"))
    shuffle = bool(kwargs.get("shuffle_row_groups", True) or kwargs.get("shuffle_rows") or capacity)
    fields = kwargs.get("schema_fields")
    seed = kwargs.get("seed")
    spec = kwargs.get("transform_spec")
    # A TransformSpec's func runs on decode processes, one row at a time, its draws the row's
    # (sparkdl._internal.data.decoding.row_transform); its fields are the batch.
    decoding = {"decode": {ROW: RowTransform(from_petastorm(spec))}, "decode_in": "processes",
                "on_bad_sample": kwargs.get("on_bad_sample", "raise")} if spec is not None else {}
    options = LoaderOptions(
        batch_size, rank=rank, world_size=size, shuffle=shuffle, seed=0 if seed is None else seed,
        shuffle_window=capacity if shuffle and capacity and capacity > batch_size else None,
        columns=None if fields is None else [getattr(f, "name", f) for f in fields], read_threads=workers_count,
        shard_by="row_groups", **decoding,
    )
    return _Read(options, num_epochs, kwargs.get("storage_options"))


def _shard(cur_shard: Any, shard_count: Any) -> tuple[int, int]:
    """This loader's shard: the given one, else Horovod's rank and size, else all of it."""
    if cur_shard is None and shard_count is None:
        for rank_var, size_var in _HOROVOD_ENV:
            rank, size = os.environ.get(rank_var), os.environ.get(size_var)
            if rank is not None and size is not None:
                return int(rank), int(size)
        return 0, 1
    if not (isinstance(cur_shard, int) and isinstance(shard_count, int) and 0 <= cur_shard < shard_count):
        raise invalid("cur_shard, shard_count", (cur_shard, shard_count), "both, with 0 <= cur_shard < shard_count "
                      "(e.g. cur_shard=hvd.rank(), shard_count=hvd.size()), or neither")
    return cur_shard, shard_count


def _delete(url: str) -> None:
    from sparkdl._internal.fs.storage import filesystem

    fs, root = filesystem(url, None)
    with contextlib.suppress(FileNotFoundError):
        fs.delete_dir(root)


# The entries this process made a converter of, and its mark on each (sparkdl._internal.data.writing.cache.hold).
_HELD: dict[str, str] = {}


def _let_go(url: str) -> None:
    """Deletes ``url`` unless another process holds it; this process's hold ends either way."""
    mark = _HELD.pop(url, None)
    others = release(url, mark) if mark is not None else release(url, "")
    if others:
        log.info("sparkdl: the converter's files at %s are kept: still read by %s", redact(url), ", ".join(others))
        return
    _delete(url)


@atexit.register
def _delete_at_exit() -> None:
    # Best effort, as Petastorm's: the files of every converter this process made, unless
    # another process made the same converter (the cache is shared) and still reads them.
    for url in sorted(_HELD):
        try:
            _let_go(url)
        except Exception as exc:  # at exit, nothing is left to handle it
            log.warning("sparkdl: could not delete the converter's files at %s: %s", redact(url), exc)
