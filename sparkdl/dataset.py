"""The ETL stage: ``write_dataset`` turns a Spark DataFrame into Parquet laid out for feeding, and
``Dataset`` is the small, picklable handle that ranks open it with.

A dataset is a directory of Parquet files. Next to them sparkdl writes ``_sparkdl_manifest.json``:
the columns (kind, element type, array length), the files, the rows of every row group and the
row counts. The loader plans every epoch from that manifest alone, which is what lets it give
every rank the same number of steps without reading any data first. Directories written by plain
Spark, by pyarrow or by Petastorm have no manifest; ``Dataset`` builds the same manifest from the
Parquet footers when it opens them. The leading underscore keeps Spark and pyarrow from taking the
manifest for data.

Filesystems: local paths and ``file://`` URLs use pyarrow's local filesystem; ``s3://``, ``gs://``,
``hdfs://`` and ``abfs://`` use pyarrow's own filesystems; any other scheme (``ftp://``,
``http://``, ``memory://``, ...) and any URL given ``storage_options`` goes through fsspec.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import tempfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from sparkdl.errors import ConfigError, DatasetError

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq
    from pyspark.sql import Column, DataFrame, SparkSession

    from sparkdl.feed import Batch, Loader

MANIFEST_NAME = "_sparkdl_manifest.json"
CACHE_DIR_CONF = "spark.sparkdl.cacheDir"
_MANIFEST_FORMAT = "sparkdl.dataset"
_MANIFEST_VERSION = 1
_DEFAULT_ROW_GROUP_BYTES = 32 * 1024 * 1024
# Schemes that pyarrow reaches natively; s3a/s3n are Hadoop's names for the same store as s3.
_PYARROW_SCHEMES = {"s3": "s3", "s3a": "s3", "s3n": "s3", "gs": "gs", "gcs": "gs", "hdfs": "hdfs",
                    "viewfs": "viewfs", "abfs": "abfs", "abfss": "abfss"}

# Column kinds, as the loader sees them.
SCALAR = "scalar"
ARRAY = "array"
BINARY = "binary"
STRING = "string"
UNSUPPORTED = "unsupported"


# --------------------------------------------------------------------------------------------
# The manifest
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ColumnSpec:
    """One column as the loader feeds it.

    Attributes:
        name: column name.
        kind: ``"scalar"`` (a number per row), ``"array"`` (a numeric list per row), ``"binary"``,
            ``"string"``, or ``"unsupported"`` (present in the files, but not feedable).
        dtype: numpy name of the value type (of the elements, for arrays); for an unsupported
            column, its Arrow type.
        length: for arrays whose every row has the same length, that length; ``None`` for
            variable-length arrays and for other kinds.
    """

    name: str
    kind: str
    dtype: str
    length: int | None = None

    def describe(self) -> str:
        if self.kind == ARRAY:
            return f"array<{self.dtype}>[{self.length if self.length is not None else 'variable'}]"
        if self.kind == SCALAR:
            return self.dtype
        return self.kind if self.kind != UNSUPPORTED else f"unsupported ({self.dtype})"


@dataclass(frozen=True)
class FileSpec:
    """One Parquet file: its path relative to the dataset root and the rows of its row groups."""

    path: str
    row_groups: tuple[int, ...]
    uncompressed_bytes: int

    @property
    def num_rows(self) -> int:
        return sum(self.row_groups)


@dataclass(frozen=True)
class Manifest:
    """What the loader plans from: columns, files, row groups and row counts."""

    columns: tuple[ColumnSpec, ...]
    files: tuple[FileSpec, ...]
    written_by_sparkdl: bool = False
    key: str | None = None

    @property
    def num_rows(self) -> int:
        return sum(f.num_rows for f in self.files)

    @property
    def uncompressed_bytes(self) -> int:
        return sum(f.uncompressed_bytes for f in self.files)

    def column(self, name: str) -> ColumnSpec:
        for col in self.columns:
            if col.name == name:
                return col
        raise KeyError(name)

    def fingerprint(self) -> str:
        """A short hash of the layout: the same on every rank that sees the same files."""
        layout = [[f.path, list(f.row_groups)] for f in self.files]
        cols = [[c.name, c.kind, c.dtype, c.length] for c in self.columns]
        return hashlib.sha256(json.dumps([layout, cols]).encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": _MANIFEST_FORMAT,
                "version": _MANIFEST_VERSION,
                "written_by": "sparkdl" if self.written_by_sparkdl else None,
                "key": self.key,
                "num_rows": self.num_rows,
                "columns": [
                    {"name": c.name, "kind": c.kind, "dtype": c.dtype, "length": c.length}
                    for c in self.columns
                ],
                "files": [
                    {
                        "path": f.path,
                        "num_rows": f.num_rows,
                        "row_groups": list(f.row_groups),
                        "uncompressed_bytes": f.uncompressed_bytes,
                    }
                    for f in self.files
                ],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        try:
            raw = json.loads(text)
            if raw.get("format") != _MANIFEST_FORMAT or raw.get("version") != _MANIFEST_VERSION:
                raise ValueError(f"format {raw.get('format')!r} version {raw.get('version')!r}")
            return cls(
                columns=tuple(
                    ColumnSpec(c["name"], c["kind"], c["dtype"], c.get("length")) for c in raw["columns"]
                ),
                files=tuple(
                    FileSpec(f["path"], tuple(int(n) for n in f["row_groups"]), int(f["uncompressed_bytes"]))
                    for f in raw["files"]
                ),
                written_by_sparkdl=raw.get("written_by") == "sparkdl",
                key=raw.get("key"),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise DatasetError(
                f"the manifest {where} cannot be read ({type(exc).__name__}: {exc}); it was written "
                f"by another version of sparkdl or damaged. Delete {MANIFEST_NAME} to open the "
                "directory as plain Parquet, or write the dataset again"
            ) from exc


def _column_spec(field: pa.Field, length: int | None = None) -> ColumnSpec:
    """Maps an Arrow field to the loader's view of it; ``length`` is a known array length."""
    import numpy as np
    import pyarrow as pa

    t = field.type

    def numeric(x: pa.DataType) -> bool:
        return bool(pa.types.is_integer(x) or pa.types.is_floating(x) or pa.types.is_boolean(x))

    if numeric(t):
        return ColumnSpec(field.name, SCALAR, np.dtype(t.to_pandas_dtype()).name)
    if (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)) and numeric(
        t.value_type
    ):
        if pa.types.is_fixed_size_list(t):
            length = t.list_size
        return ColumnSpec(field.name, ARRAY, np.dtype(t.value_type.to_pandas_dtype()).name, length)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return ColumnSpec(field.name, BINARY, "bytes")
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return ColumnSpec(field.name, STRING, "str")
    view_types = [getattr(pa.types, n, None) for n in ("is_binary_view", "is_string_view")]
    if view_types[0] is not None and view_types[0](t):
        return ColumnSpec(field.name, BINARY, "bytes")
    if view_types[1] is not None and view_types[1](t):
        return ColumnSpec(field.name, STRING, "str")
    return ColumnSpec(field.name, UNSUPPORTED, str(t))


# --------------------------------------------------------------------------------------------
# Filesystems
# --------------------------------------------------------------------------------------------


def _normalize_url(path_or_url: str | os.PathLike[str]) -> str:
    """Absolute ``file://`` URL for local paths (executors have another working directory), else as given."""
    text = os.fspath(path_or_url)
    parts = urlsplit(text)
    if len(parts.scheme) <= 1:  # no scheme (or a Windows drive letter): a local path
        return "file://" + os.path.abspath(text)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(
                f"path {text!r}: a file:// URL names a host ({parts.netloc!r}); use file:///absolute/path"
            )
        return "file://" + os.path.abspath(parts.path or "/")
    return text.rstrip("/") if len(text) > len(parts.scheme) + 3 else text


def _filesystem(url: str, storage_options: Mapping[str, Any] | None) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and the path inside it for a normalized URL."""
    import pyarrow.fs as pafs

    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme == "file":
        return pafs.LocalFileSystem(), parts.path
    if scheme in _PYARROW_SCHEMES and not storage_options:
        native = url.replace(f"{scheme}://", f"{_PYARROW_SCHEMES[scheme]}://", 1)
        try:
            fs, path = pafs.FileSystem.from_uri(native)
        except Exception as exc:
            raise _unreachable(url, exc) from exc
        return fs, path
    try:
        from fsspec.core import url_to_fs
    except ImportError as exc:
        raise ConfigError(
            f"path {url!r} has the scheme {scheme!r}, which pyarrow does not reach by itself and "
            "fsspec is not installed; pip install fsspec (and the fsspec package for the scheme)"
        ) from exc
    try:
        fsspec_fs, path = url_to_fs(url, **dict(storage_options or {}))
    except (ImportError, ValueError) as exc:
        raise ConfigError(
            f"path {url!r}: no filesystem for the scheme {scheme!r} ({type(exc).__name__}: {exc}); "
            "install the fsspec implementation it names, or use a local, file://, s3://, gs:// or "
            "hdfs:// URL"
        ) from exc
    except Exception as exc:
        raise _unreachable(url, exc) from exc
    return pafs.PyFileSystem(pafs.FSSpecHandler(fsspec_fs)), path


def _unreachable(url: str, exc: BaseException) -> DatasetError:
    return DatasetError(
        f"cannot reach {_redact(url)}: {type(exc).__name__}: {exc}. Check the host, port and "
        "credentials of the URL (pass them with storage_options=... where the filesystem needs "
        "them), and that the storage is up and reachable from this machine"
    )


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@", 1)
    return url


def _is_hidden(rel_path: str) -> bool:
    # Spark, Hive and Petastorm keep metadata in _-prefixed and .-prefixed files and folders.
    return any(part.startswith(("_", ".")) for part in rel_path.split("/"))


def _path_info(fs: pafs.FileSystem, path: str, url: str) -> pafs.FileInfo:
    try:
        return fs.get_file_info(path)
    except Exception as exc:
        raise _unreachable(url, exc) from exc


def _list_data_files(fs: pafs.FileSystem, root: str, url: str) -> list[str]:
    """Relative paths of the data files under ``root``, sorted, metadata files left out."""
    import pyarrow.fs as pafs

    try:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    except Exception as exc:
        raise _unreachable(url, exc) from exc
    prefix = root.rstrip("/") + "/"
    rel = []
    for info in infos:
        if info.type != pafs.FileType.File:
            continue
        # fsspec filesystems may drop a leading slash; compare without it.
        path = info.path
        if not path.startswith(prefix) and ("/" + path).startswith(prefix):
            path = "/" + path
        name = path[len(prefix):] if path.startswith(prefix) else posixpath.basename(path)
        if not _is_hidden(name) and info.size:
            rel.append(name)
    return sorted(rel)


def _read_footers(
    fs: pafs.FileSystem, root: str, rel_paths: Sequence[str], url: str
) -> list[tuple[pa.Schema, FileSpec]]:
    import pyarrow.parquet as pq

    def one(rel: str) -> tuple[pa.Schema, FileSpec]:
        full = posixpath.join(root, rel) if rel else root
        try:
            with fs.open_input_file(full) as handle:
                meta = pq.ParquetFile(handle).metadata
                schema = meta.schema.to_arrow_schema()
        except Exception as exc:
            raise DatasetError(
                f"{_redact(url)}: the file {rel or full!r} is not readable Parquet "
                f"({type(exc).__name__}: {exc}); remove it from the directory or rewrite the data"
            ) from exc
        groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
        size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        return schema, FileSpec(rel, tuple(g for g in groups), int(size))

    # fsspec filesystems (wrapped as "py") may share one connection between threads, as ftp does:
    # read their footers one after another.
    if len(rel_paths) <= 1 or fs.type_name.startswith("py"):
        return [one(r) for r in rel_paths]
    with ThreadPoolExecutor(max_workers=min(16, len(rel_paths))) as pool:
        return list(pool.map(one, rel_paths))


def _manifest_from_footers(
    fs: pafs.FileSystem,
    root: str,
    url: str,
    fixed_lengths: Mapping[str, int] | None,
    *,
    single_file: bool = False,
) -> Manifest:
    rel_paths = [""] if single_file else _list_data_files(fs, root, url)
    if not rel_paths:
        raise DatasetError(
            f"{_redact(url)} holds no Parquet files (only metadata files, or nothing); check the "
            "path, or write the data with sparkdl.write_dataset(df, path)"
        )
    footers = _read_footers(fs, root, rel_paths, url)
    schema = footers[0][0]
    for other, spec in footers[1:]:
        if not other.remove_metadata().equals(schema.remove_metadata()):
            raise DatasetError(
                f"{_redact(url)}: the file {spec.path!r} has another schema than "
                f"{footers[0][1].path!r} ({other} vs {schema}); a dataset's files must share one "
                "schema: rewrite them with sparkdl.write_dataset"
            )
    fixed = dict(fixed_lengths or {})
    unknown = sorted(set(fixed) - set(schema.names))
    if unknown:
        raise ConfigError(
            f"fixed_lengths names columns that {_redact(url)} does not have: {unknown}; its columns "
            f"are {schema.names}"
        )
    columns = tuple(_column_spec(field, fixed.get(field.name)) for field in schema)
    for col in columns:
        if col.name in fixed and col.kind != ARRAY:
            raise ConfigError(
                f"fixed_lengths[{col.name!r}]: the column is {col.describe()}, not a numeric array"
            )
    files = tuple(spec for _, spec in footers if spec.num_rows > 0)
    return Manifest(columns=columns, files=files)


# --------------------------------------------------------------------------------------------
# The handle
# --------------------------------------------------------------------------------------------


class Dataset:
    """A Parquet dataset to feed PyTorch from: a small handle that pickles to every rank.

    It opens directories written by :func:`write_dataset`, by plain Spark
    (``df.write.parquet``), by pyarrow, or by Petastorm, and single Parquet files. The manifest
    is read (or, without one, built from the Parquet footers) when the handle is created, and it
    travels with the handle when pickled, so that every rank plans from the very same layout.

    Example::

        ds = sparkdl.Dataset("s3://bucket/features")
        for batch in ds.loader(256, rank=0, world_size=1):
            x, y = batch["features"], batch["label"]

    Args:
        path_or_url: a local path, or a URL (``file://``, ``s3://``, ``gs://``, ``hdfs://``, or
            any scheme fsspec knows, such as ``ftp://user:pw@host:port/path``).
        storage_options: keyword arguments for the fsspec filesystem (credentials, endpoints,
            timeouts). When given, even ``s3://`` and friends go through fsspec.
        fixed_lengths: for datasets not written by sparkdl: ``{"column": length}`` for list
            columns whose every row has that length, so that they come out as 2-D tensors
            rather than padded ones. A row of another length fails the loader with an error.

    Raises:
        DatasetError: the URL cannot be reached, holds no Parquet, or the files disagree.
        ConfigError: a bad argument (unknown scheme, ``fixed_lengths`` on a non-array column).
    """

    def __init__(
        self,
        path_or_url: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        fixed_lengths: Mapping[str, int] | None = None,
    ) -> None:
        self._url = _normalize_url(path_or_url)
        self._storage_options = dict(storage_options) if storage_options else None
        self._fs: pafs.FileSystem | None = None
        fs, root = self._filesystem()
        self._manifest, self._single_file = _open_manifest(fs, root, self._url, fixed_lengths)

    @classmethod
    def _written(cls, url: str, manifest: Manifest) -> Dataset:
        """The handle of a dataset write_dataset has just written, without reading it back."""
        ds = cls.__new__(cls)
        ds.__setstate__({"url": url, "storage_options": None, "manifest": manifest, "single_file": False})
        return ds

    # -- identity ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The dataset's URL (local paths as absolute ``file://`` URLs)."""
        return self._url

    @property
    def manifest(self) -> Manifest:
        """Columns, files, row groups and row counts."""
        return self._manifest

    @property
    def num_rows(self) -> int:
        """Rows in the dataset."""
        return self._manifest.num_rows

    @property
    def columns(self) -> tuple[str, ...]:
        """Column names, in file order."""
        return tuple(c.name for c in self._manifest.columns)

    @property
    def schema(self) -> dict[str, str]:
        """``{column: description}``, e.g. ``{"label": "int64", "features": "array<float32>[32]"}``."""
        return {c.name: c.describe() for c in self._manifest.columns}

    @property
    def files(self) -> tuple[str, ...]:
        """URLs of the data files, in the order the loader numbers rows."""
        if self._single_file:
            return (self._url,)
        return tuple(f"{self._url}/{f.path}" for f in self._manifest.files)

    def __len__(self) -> int:
        return self.num_rows

    def __repr__(self) -> str:
        cols = ", ".join(f"{k}: {v}" for k, v in self.schema.items())
        return (
            f"Dataset({_redact(self._url)!r}, rows={self.num_rows}, files={len(self._manifest.files)}, "
            f"columns={{{cols}}})"
        )

    # -- pickling: plain values only; the filesystem is opened again where the handle lands ----

    def __getstate__(self) -> dict[str, Any]:
        return {
            "url": self._url,
            "storage_options": self._storage_options,
            "manifest": self._manifest,
            "single_file": self._single_file,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._url = state["url"]
        self._storage_options = state["storage_options"]
        self._manifest = state["manifest"]
        self._single_file = state["single_file"]
        self._fs = None

    # -- reading -------------------------------------------------------------------------------

    def _filesystem(self) -> tuple[pafs.FileSystem, str]:
        if self._fs is None:
            self._fs, self._root = _filesystem(self._url, self._storage_options)
        return self._fs, self._root

    def _open_file(self, index: int) -> pq.ParquetFile:
        """The ``index``-th data file of the manifest, opened for reading."""
        import pyarrow.parquet as pq

        fs, root = self._filesystem()
        rel = self._manifest.files[index].path
        full = root if self._single_file else posixpath.join(root, rel)
        try:
            return pq.ParquetFile(fs.open_input_file(full))
        except Exception as exc:
            raise DatasetError(
                f"cannot open {_redact(self._url)}/{rel}: {type(exc).__name__}: {exc}. The dataset "
                "changed since its manifest was taken, or the storage is unreachable"
            ) from exc

    def loader(
        self,
        batch_size: int,
        *,
        epoch: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        columns: Sequence[str] | None = None,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        reader: str = "arrow",
        transform: Callable[[Batch], Batch] | None = None,
        prefetch: int = 4,
        shuffle_window: int | None = None,
        device: Any = None,
        pin_memory: bool | None = None,
        petastorm_workers: int = 2,
    ) -> Loader:
        """This rank's loader: an iterable of ``{column: tensor}`` batches, the same count on every rank.

        See :class:`sparkdl.feed.Loader` for the remainder, shuffle and resume policies.

        Example::

            def train(ds):
                loader = ds.loader(256, seed=7)            # rank/world size from sparkdl.context()
                for epoch in range(10):
                    loader.set_epoch(epoch)
                    for batch in loader:                   # len(loader) steps on every rank
                        loss = model(batch["features"]).sum()

        Args:
            batch_size: rows per batch.
            epoch: the epoch to start with; each full pass moves to the next one.
            shuffle: shuffle row groups and rows, deterministically for ``(seed, epoch)``.
            seed: shuffle seed, an integer >= 0.
            columns: columns to read, in this order (default: every column).
            drop_last: ``True``: every batch is full and the remainder is dropped;
                ``False``: no row is dropped, some rows are repeated to even out the ranks.
            rank, world_size: this rank and the number of ranks; by default from
                :func:`sparkdl.context` in a run, else from an initialized ``torch.distributed``,
                else 0 and 1.
            reader: ``"arrow"`` (sparkdl's reader) or ``"petastorm"`` (Petastorm's
                ``make_batch_reader``, on the classic stack).
            transform: a function from a batch dict to a batch dict, run in the loader's
                background thread (decode images here).
            prefetch: batches prepared ahead in a background thread (0: none, no thread).
            shuffle_window: rows shuffled together (see :class:`~sparkdl.feed.Loader`).
            device: the device batches go to; pins memory when it is CUDA. By default the
                run's device.
            pin_memory: force pinning on or off.
            petastorm_workers: reader threads for ``reader="petastorm"``.
        """
        from sparkdl.feed import Loader

        return Loader(
            self,
            batch_size,
            epoch=epoch,
            shuffle=shuffle,
            seed=seed,
            columns=columns,
            drop_last=drop_last,
            rank=rank,
            world_size=world_size,
            reader=reader,
            transform=transform,
            prefetch=prefetch,
            shuffle_window=shuffle_window,
            device=device,
            pin_memory=pin_memory,
            petastorm_workers=petastorm_workers,
        )


def _open_manifest(
    fs: pafs.FileSystem, root: str, url: str, fixed_lengths: Mapping[str, int] | None
) -> tuple[Manifest, bool]:
    """Reads the sparkdl manifest, or builds one from the footers; returns it and whether ``root`` is a file."""
    import pyarrow.fs as pafs

    info = _path_info(fs, root, url)
    if info.type == pafs.FileType.NotFound:
        raise DatasetError(
            f"{_redact(url)} does not exist; check the path, or write the data first with "
            "sparkdl.write_dataset(df, path)"
        )
    if info.type == pafs.FileType.File:
        return _manifest_from_footers(fs, root, url, fixed_lengths, single_file=True), True
    manifest_path = posixpath.join(root, MANIFEST_NAME)
    if _path_info(fs, manifest_path, url).type == pafs.FileType.File:
        try:
            with fs.open_input_stream(manifest_path) as handle:
                text = handle.read().decode()
        except Exception as exc:
            raise _unreachable(url, exc) from exc
        manifest = Manifest.from_json(text, f"{_redact(url)}/{MANIFEST_NAME}")
        if fixed_lengths:
            raise ConfigError(
                f"fixed_lengths is for datasets without a sparkdl manifest; {_redact(url)} has one, "
                "which already records the array lengths: leave fixed_lengths out"
            )
        return manifest, False
    return _manifest_from_footers(fs, root, url, fixed_lengths), False


# --------------------------------------------------------------------------------------------
# ETL: write_dataset
# --------------------------------------------------------------------------------------------


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
    dense or sparse; binary; string.

    Cache: with ``path=None`` the data goes under the directory named by the Spark conf
    ``spark.sparkdl.cacheDir`` (default ``<system temp dir>/sparkdl-cache``, which suits local
    mode; on a cluster point it at storage every executor and the driver share). The cache entry
    is keyed on the DataFrame's canonicalized optimized plan and ``semanticHash()``, its schema,
    its input files (``df.inputFiles()``) with their sizes and modification times, the
    application id when the plan reads an in-memory RDD, and the arguments of this call. Writing
    the same plan over unchanged inputs again returns the existing entry without running a job.
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
            ones faster scans. The size is checked every 10 rows at first, so that wide rows
            (images) do not overshoot it by much.
        row_group_rows: at most this many rows per row group (Parquet's
            ``parquet.block.row.count.limit``), whichever of the two limits comes first.
        vector_dtype: ``"float32"`` or ``"float64"``, the element type ML vectors become.
        compression: Parquet codec (``snappy``, ``zstd``, ``gzip``, ``none``...).

    Raises:
        ConfigError: an unsupported column type (all such columns are named with their types),
            an empty DataFrame, a ``path`` that already holds data, or a bad argument.
        DatasetError: ``path`` (or the cache directory) cannot be reached, or Spark failed to write.
    """
    # Duck-typed, so that Spark Connect DataFrames (another class on pyspark 3.5) pass too.
    if not all(hasattr(df, a) for a in ("sparkSession", "schema", "write", "semanticHash")):
        raise ConfigError(f"df must be a pyspark.sql.DataFrame; got {type(df).__name__}")
    if vector_dtype not in ("float32", "float64"):
        raise ConfigError(f"vector_dtype={vector_dtype!r}: choose 'float32' or 'float64'")
    if isinstance(row_group_bytes, bool) or not isinstance(row_group_bytes, int) or row_group_bytes < 1024:
        raise ConfigError(f"row_group_bytes={row_group_bytes!r}: give an integer of at least 1024 bytes")
    if row_group_rows is not None and (
        isinstance(row_group_rows, bool) or not isinstance(row_group_rows, int) or row_group_rows < 1
    ):
        raise ConfigError(f"row_group_rows={row_group_rows!r}: give an integer >= 1, or None for no row limit")
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
    if num_files is None:
        num_files = _default_parallelism(spark)
    if isinstance(num_files, bool) or not isinstance(num_files, int) or num_files < 1:
        raise ConfigError(f"num_files={num_files!r}: give an integer >= 1")
    selected, array_columns = _select_for_feeding(df, vector_dtype)

    options = {
        "num_files": num_files,
        "row_group_bytes": row_group_bytes,
        "row_group_rows": row_group_rows,
        "vector_dtype": vector_dtype,
        "compression": compression,
    }
    if path is None:
        return _write_cached(df, selected, array_columns, options)

    url = _qualify(spark, path)
    fs, root = _filesystem(url, None)
    _check_target(fs, root, url, overwrite)
    _check_not_empty(df)
    _spark_write(selected, url, "overwrite" if _exists(fs, root, url) else "errorifexists", options)
    manifest = _finish_manifest(spark, fs, root, url, array_columns, key=None)
    return Dataset._written(url, manifest)


def _default_parallelism(spark: SparkSession) -> int:
    try:
        return max(1, int(spark.sparkContext.defaultParallelism))
    except Exception:  # Spark Connect has no SparkContext
        return max(1, int(spark.conf.get("spark.default.parallelism", None) or 2))


def _select_for_feeding(df: DataFrame, vector_dtype: str) -> tuple[DataFrame, list[str]]:
    """The DataFrame with vectors made arrays, and the names of its array columns.

    Raises ConfigError naming every column whose type cannot be fed, before any job runs.
    """
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.mllib.linalg import VectorUDT as OldVectorUDT
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
        else:
            bad.append(f"{field.name!r} ({t.simpleString()})")
    if bad:
        raise ConfigError(
            f"write_dataset cannot feed the column(s) {', '.join(bad)} to torch. Supported: byte, "
            "short, int, long, float, double, boolean, arrays of those, ML vectors, binary and "
            "string. Cast them (decimals and timestamps to double or long, e.g. "
            "df.withColumn(name, df[name].cast('double'))), encode them as binary, or drop them"
        )
    return df.select(*columns), arrays


def _qualify(spark: SparkSession, path: str | os.PathLike[str]) -> str:
    """A URL that means the same place to Spark (Hadoop) and to pyarrow."""
    text = os.fspath(path)
    if len(urlsplit(text).scheme) > 1:
        return _normalize_url(text)
    default_fs = "file:///"
    try:
        hadoop_conf = spark.sparkContext._jsc.hadoopConfiguration()
        default_fs = hadoop_conf.get("fs.defaultFS") or default_fs
    except Exception:  # Spark Connect: only the session's SQL confs are visible
        default_fs = spark.conf.get("spark.hadoop.fs.defaultFS", None) or default_fs
    if default_fs.startswith("file:"):
        return _normalize_url(text)
    if not text.startswith("/"):
        raise ConfigError(
            f"path {text!r} is relative and Spark's default filesystem is {default_fs}; give an "
            "absolute path or a full URL (e.g. hdfs://namenode:8020/data/x)"
        )
    return default_fs.rstrip("/") + text


def _spark_url(url: str) -> str:
    # Spark (Hadoop) and pyarrow spell local URLs alike; s3:// needs Hadoop's s3a connector.
    return url.replace("s3://", "s3a://", 1) if url.startswith("s3://") else url


def _exists(fs: pafs.FileSystem, root: str, url: str) -> bool:
    import pyarrow.fs as pafs

    return bool(_path_info(fs, root, url).type != pafs.FileType.NotFound)


def _check_target(fs: pafs.FileSystem, root: str, url: str, overwrite: bool) -> None:
    import pyarrow.fs as pafs

    info = _path_info(fs, root, url)
    if info.type == pafs.FileType.NotFound or overwrite:
        return
    if info.type == pafs.FileType.File:
        held = 1
    else:
        try:
            held = len(fs.get_file_info(pafs.FileSelector(root, recursive=False)))
        except Exception as exc:
            raise _unreachable(url, exc) from exc
    if held:
        raise ConfigError(
            f"path {_redact(url)!r} already holds data ({held} entr{'y' if held == 1 else 'ies'}); "
            "nothing was written or deleted. Pass overwrite=True to replace it, or choose another "
            "path (or path=None to use the cache)"
        )


def _check_not_empty(df: DataFrame) -> None:
    if df.isEmpty():
        raise ConfigError(
            "the DataFrame passed to write_dataset has no rows, so there is nothing to train on; "
            "check its source and filters"
        )


def _spark_write(df: DataFrame, url: str, mode: str, options: Mapping[str, Any]) -> None:
    writer = (
        df.repartition(int(options["num_files"]))
        .write.mode(mode)
        .option("parquet.block.size", str(options["row_group_bytes"]))
        # parquet-mr first measures a row group after 100 rows: too late for wide rows.
        .option("parquet.page.size.row.check.min", "10")
        .option("compression", str(options["compression"]))
    )
    if options.get("row_group_rows"):
        writer = writer.option("parquet.block.row.count.limit", str(options["row_group_rows"]))
    try:
        writer.parquet(_spark_url(url))
    except Exception as exc:
        raise DatasetError(
            f"Spark failed to write {_redact(url)}: {type(exc).__name__}: {_first_line(exc)}. Check "
            "that every executor can write there (a local path must be on storage the driver and "
            "the executors share) and that the DataFrame computes"
        ) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else repr(exc)


def _array_lengths(spark: SparkSession, url: str, array_columns: Sequence[str]) -> dict[str, int | None]:
    """Each array column's length if every row has the same one (and none is null), else None."""
    if not array_columns:
        return {}
    from pyspark.sql import functions as F

    written = spark.read.parquet(_spark_url(url))
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


def _finish_manifest(
    spark: SparkSession,
    fs: pafs.FileSystem,
    root: str,
    url: str,
    array_columns: Sequence[str],
    key: str | None,
) -> Manifest:
    lengths = _array_lengths(spark, url, array_columns)
    base = _manifest_from_footers(fs, root, url, None)
    columns = tuple(
        ColumnSpec(c.name, c.kind, c.dtype, lengths.get(c.name, c.length)) if c.kind == ARRAY else c
        for c in base.columns
    )
    manifest = Manifest(columns=columns, files=base.files, written_by_sparkdl=True, key=key)
    try:
        with fs.open_output_stream(posixpath.join(root, MANIFEST_NAME)) as out:
            out.write(manifest.to_json().encode())
    except Exception as exc:
        raise _unreachable(url, exc) from exc
    return manifest


def _cache_dir(spark: SparkSession) -> str:
    configured = spark.conf.get(CACHE_DIR_CONF, None)
    return _qualify(spark, configured) if configured else _normalize_url(
        os.path.join(tempfile.gettempdir(), "sparkdl-cache")
    )


def _cache_key(df: DataFrame, options: Mapping[str, Any]) -> str:
    """What makes two writes the same: see write_dataset's docstring."""
    parts: dict[str, Any] = {
        "version": _MANIFEST_VERSION,
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
        url = _normalize_url(f)
        parts = urlsplit(url)
        by_fs.setdefault(f"{parts.scheme}://{parts.netloc}", []).append((f, url))
    stamps: list[Any] = []
    for group in by_fs.values():
        try:
            fs, _ = _filesystem(group[0][1], None)
            paths = [_filesystem_path(u) for _, u in group]
            infos = fs.get_file_info(paths)
            stamps += [[f, i.size, i.mtime_ns] for (f, _), i in zip(group, infos, strict=True)]
        except Exception:
            stamps += [[f, "unknown", uuid.uuid4().hex] for f, _ in group]
    return stamps


def _filesystem_path(url: str) -> str:
    parts = urlsplit(url)
    return parts.path if parts.scheme == "file" else f"{parts.netloc}{parts.path}"


def _write_cached(
    df: DataFrame, selected: DataFrame, array_columns: Sequence[str], options: Mapping[str, Any]
) -> Dataset:
    import pyarrow.fs as pafs

    spark = df.sparkSession
    cache_url = _cache_dir(spark)
    key = _cache_key(df, options)
    url = f"{cache_url}/{key}"
    fs, root = _filesystem(url, None)
    cache_root = _filesystem(cache_url, None)[1]
    manifest_path = posixpath.join(root, MANIFEST_NAME)
    if _path_info(fs, manifest_path, url).type == pafs.FileType.File:
        cached = Dataset(url)
        if cached.manifest.key == key:
            return cached
    _check_not_empty(df)
    try:
        fs.create_dir(cache_root, recursive=True)
    except Exception as exc:
        raise DatasetError(
            f"cannot create the cache directory {_redact(cache_url)} ({type(exc).__name__}: {exc}); "
            f"set the Spark conf {CACHE_DIR_CONF} to a writable directory, or pass a path"
        ) from exc
    # Write beside the entry, then rename: a reader never sees a half-written entry.
    tmp_url = f"{cache_url}/.tmp-{key}-{uuid.uuid4().hex[:8]}"
    tmp_root = _filesystem(tmp_url, None)[1]
    try:
        _spark_write(selected, tmp_url, "errorifexists", options)
        manifest = _finish_manifest(spark, fs, tmp_root, tmp_url, array_columns, key=key)
        if _exists(fs, root, url):  # a stale entry without a valid manifest, or a racing writer
            if _path_info(fs, manifest_path, url).type == pafs.FileType.File:
                return Dataset(url)
            fs.delete_dir(root)
        fs.move(tmp_root, root)
    finally:
        if _exists(fs, tmp_root, tmp_url):
            fs.delete_dir(tmp_root)
    return Dataset._written(url, manifest)
