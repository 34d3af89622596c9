"""A dataset's files as a loader reads them, and the reader of their row groups.

:class:`ParquetFiles` is the part of a :class:`~sparkdl.Dataset` that ranks read through: the
URL, the manifest, and the filesystem, opened again wherever the object is unpickled.
``Dataset`` is the public handle built on it; the loader needs only this part, so the reading
side does not depend on the handle, nor on ``write_dataset``.
"""

from __future__ import annotations

import collections
import itertools
import posixpath
import threading
from collections.abc import Generator, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from sparkdl._internal.common.errors import DatasetError
from sparkdl._internal.data.format.manifest import ColumnSpec, Manifest
from sparkdl._internal.fs.storage import filesystem, redact

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq


class ParquetFiles:
    """Where a dataset's Parquet files are, their manifest, and how to open them.

    Pickles to plain values (URL, storage options, manifest); the filesystem is opened again,
    on first use, where the object lands.

    Args:
        url: the dataset's URL, as :func:`sparkdl._internal.fs.storage.normalize_url` gives it.
        storage_options: keyword arguments for an fsspec filesystem, or ``None``.
        manifest: the layout every rank plans from.
        single_file: ``url`` is one Parquet file rather than a directory.
        opened: the filesystem and root path of ``url``, when the caller has them already.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None,
        manifest: Manifest,
        *,
        single_file: bool,
        opened: tuple[pafs.FileSystem, str] | None = None,
    ) -> None:
        self._url = url
        self._storage_options = dict(storage_options) if storage_options else None
        self._manifest = manifest
        self._single_file = single_file
        self._fs: pafs.FileSystem | None = None
        if opened is not None:
            self._fs, self._root = opened

    @property
    def url(self) -> str:
        """The dataset's URL (local paths as absolute ``file://`` URLs)."""
        return self._url

    @property
    def manifest(self) -> Manifest:
        """Columns, files, row groups and row counts."""
        return self._manifest

    @property
    def files(self) -> tuple[str, ...]:
        """URLs of the data files, in the order the loader numbers rows."""
        if self._single_file:
            return (self._url,)
        return tuple(f"{self._url}/{f.path}" for f in self._manifest.files)

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
            self._fs, self._root = filesystem(self._url, self._storage_options)
        return self._fs, self._root

    def _open_file(self, index: int) -> pq.ParquetFile:
        """The ``index``-th data file of the manifest, opened for reading."""
        import pyarrow.parquet as pq

        fs, root = self._filesystem()
        rel = self._manifest.files[index].path
        full = root if self._single_file else posixpath.join(root, rel)
        # pyarrow >= 15 pre-buffers by default: each open file keeps the raw column chunks of the
        # row group it read last until its next read. A local read gains nothing from that, and
        # the open files would hold a row group each.
        options = {"pre_buffer": False} if fs.type_name == "local" else {}
        try:
            return pq.ParquetFile(fs.open_input_file(full), **options)
        except Exception as exc:
            raise DatasetError(
                f"cannot open {redact(self._url)}/{rel}: {type(exc).__name__}: {exc}. The dataset "
                "changed since its manifest was taken, or the storage is unreachable"
            ) from exc


class RowGroupReader:
    """Reads row groups, keeping the last one (windows often split a row group) and a few open files.

    Row group ``g`` is the ``g``-th of the whole dataset: ``rg_file[g]`` is its file,
    ``rg_index[g]`` its index in that file and ``rg_rows[g]`` the rows the manifest records.
    With ``threads`` > 1, :meth:`tables` decodes that many row groups at a time, each thread
    with files of its own: decoding a Parquet column runs on one core, which a GPU outruns.
    """

    _OPEN_FILES = 8

    def __init__(
        self,
        files: ParquetFiles,
        rg_file: np.ndarray,
        rg_index: np.ndarray,
        rg_rows: np.ndarray,
        columns: Sequence[ColumnSpec],
        threads: int = 1,
    ) -> None:
        self._source = files
        self._rg_file, self._rg_index, self._rg_rows = rg_file, rg_index, rg_rows
        self._columns = columns
        self._names = [c.name for c in columns]
        self._files: dict[int, pq.ParquetFile] = {}
        self._last: tuple[int, pa.Table] | None = None
        self._last_file = 0
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()

    def row_group(self, g: int) -> pa.Table:
        """Row group ``g``'s selected columns; DatasetError when it cannot be read or changed."""
        if self._last is not None and self._last[0] == g:
            return self._last[1]
        self._last = None  # let the previous group go before the next is decoded beside it
        table = self._read(g)
        self._last = (g, table)
        return table

    def tables(self, groups: Sequence[int]) -> Generator[tuple[int, pa.Table], None, None]:
        """``(g, table)`` for each of ``groups`` (distinct), in order. With ``threads`` > 1 the
        next groups are decoded meanwhile, at most ``threads`` of them, so that many row groups'
        Arrow data is alive at a time instead of one. The last group stays for the next call, which
        may begin with it (a window that ends inside a row group)."""
        todo = list(groups)
        if self._last is not None and todo and todo[0] == self._last[0]:
            yield self._last
            todo = todo[1:]
        if self._threads <= 1 or len(todo) <= 1:
            for g in todo:
                yield g, self.row_group(g)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="sparkdl-decode")
        self._last = None
        pending: collections.deque[tuple[int, Future[pa.Table]]] = collections.deque()
        rest = iter(todo)
        try:
            for g in itertools.islice(rest, self._threads):
                pending.append((g, self._pool.submit(self._decode, g)))
            while pending:
                g, future = pending.popleft()
                table = future.result()
                if (after := next(rest, None)) is not None:
                    pending.append((after, self._pool.submit(self._decode, after)))
                self._last = (g, table)
                yield g, table
                del table
        finally:
            for _, future in pending:
                future.cancel()

    def pieces(self, share: Sequence[tuple[int, int, int]]) -> Iterator[tuple[pa.Table, int, int]]:
        """``(table, start, stop)`` for the ``(row group, start, stop)`` pieces of ``share``, in
        order; the pieces of one row group are adjacent (they come from stream ranges)."""
        tables = self.tables(list(dict.fromkeys(g for g, _, _ in share)))
        current: tuple[int, pa.Table] | None = None
        try:
            for g, a, z in share:
                if current is None or current[0] != g:
                    current = None  # let it go before the next is taken
                    current = next(tables)
                yield current[1], a, z
        finally:
            tables.close()

    def close(self) -> None:
        """Ends the decode threads (a thread that is decoding ends after that group)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _decode(self, g: int) -> pa.Table:
        """Row group ``g``, read in a decode thread by that thread's own reader."""
        reader = getattr(self._local, "reader", None)
        if reader is None:
            reader = self._local.reader = RowGroupReader(
                self._source, self._rg_file, self._rg_index, self._rg_rows, self._columns
            )
        return reader._read(g)

    def _read(self, g: int) -> pa.Table:
        f = int(self._rg_file[g])
        self._last_file = f
        handle = self._files.pop(f, None) or self._source._open_file(f)
        self._files[f] = handle  # most recently used last
        while len(self._files) > self._OPEN_FILES:
            self._files.pop(next(iter(self._files)))
        try:
            table = handle.read_row_group(int(self._rg_index[g]), columns=self._names, use_threads=True)
        except Exception as exc:
            raise DatasetError(
                f"cannot read row group {int(self._rg_index[g])} of {self.where()}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if table.num_rows != int(self._rg_rows[g]):
            raise DatasetError(
                f"{self.where()}: row group {int(self._rg_index[g])} has {table.num_rows} rows, the "
                f"manifest {int(self._rg_rows[g])}; the files changed after the Dataset was opened. "
                "Open it again (or rewrite it) and restart"
            )
        return table

    def where(self) -> str:
        """The file last read, for messages."""
        f = self._source.manifest.files[self._last_file].path
        return f"{redact(self._source.url)}/{f}" if f else redact(self._source.url)
