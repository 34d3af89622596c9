"""sparkdl's Arrow reader: windows of rows read from the row groups, cut into batches of tensors.

A window is read piece by piece: numbers go straight into preallocated numpy arrays, so only one
row group's Arrow data is alive at a time; binary, string and variable-length array columns stay
Arrow until a batch is cut from them. The output format is described in
:mod:`sparkdl.data.loader`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkdl.data.files import ParquetFiles, RowGroupReader
from sparkdl.data.manifest import ARRAY, BINARY, SCALAR, STRING, ColumnSpec
from sparkdl.data.plan import EpochPlan, pieces
from sparkdl.errors import DatasetError
from sparkdl.storage import redact

Batch: TypeAlias = dict[str, Any]
"""One batch: ``{column: torch.Tensor | list}``."""

LENGTHS_SUFFIX = "_lengths"
"""A variable-length array column ``x`` comes with ``x + LENGTHS_SUFFIX``, its rows' true lengths."""

# Window columns: numpy for numbers (1-D, or 2-D for fixed arrays), Arrow for everything else.
_Column: TypeAlias = np.ndarray | pa.Array
Window: TypeAlias = dict[str, _Column]
"""Rows shuffled together, by column: numpy for numbers, Arrow for the rest."""
Selection: TypeAlias = slice | np.ndarray
"""The rows of a window that make one batch: a range, or positions."""


@dataclass(frozen=True)
class BatchMaker:
    """How batches come out: which columns, pinned or not, and the user's ``transform``.

    It holds nothing that refers back to a loader, so the reader thread that uses it does not
    keep a dropped loader alive.
    """

    columns: tuple[ColumnSpec, ...]
    pin: bool
    transform: Callable[[Batch], Batch] | None

    def __call__(self, window: Window, sel: Selection) -> Batch:
        """The batch of rows ``sel`` of ``window``, transformed."""
        batch = _make_batch(self.columns, window, sel, self.pin)
        return self.transform(batch) if self.transform is not None else batch


def arrow_batches(
    files: ParquetFiles, plan: EpochPlan, make: BatchMaker, epoch: int, start_step: int, *, read_ahead: bool
) -> Iterator[Batch]:
    """This rank's batches of ``epoch`` from step ``start_step`` on, read with pyarrow.

    With ``read_ahead``, one thread reads and decodes the next window while this one's batches
    are served.
    """
    columns = make.columns
    order = plan.row_group_order(epoch)
    window, per_rank, b = plan.window, plan.per_rank, plan.batch_size
    first = start_step * b
    windows = range(first // window, -(-per_rank // window))
    reader = RowGroupReader(files, plan.rg_file, plan.rg_index, plan.rg_rows, columns)
    base = plan.rank * per_rank

    def read(k: int) -> Window:
        lo, hi = k * window, min((k + 1) * window, per_rank)
        share = pieces(plan.rg_rows, order, base + lo, hi - lo)
        builder = WindowBuilder(columns, hi - lo, _where(files, plan, share))
        for g, a, z in share:
            part = reader.row_group(g).slice(a, z - a)
            builder.add({c.name: part.column(c.name).chunks for c in columns}, z - a)
        return builder.finish()

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparkdl-read") if read_ahead else None
    try:
        pending: Future[Window] | None = None
        for i, k in enumerate(windows):
            if pool is None:
                data = read(k)
            else:
                data = (pending or pool.submit(read, k)).result()
                pending = pool.submit(read, windows[i + 1]) if i + 1 < len(windows) else None
            n = min((k + 1) * window, per_rank) - k * window
            perm = plan.window_permutation(epoch, k, n) if plan.shuffle else None
            s = max(first - k * window, 0)
            while s < n:
                e = min(s + b, n)
                yield make(data, perm[s:e] if perm is not None else slice(s, e))
                s = e
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _where(files: ParquetFiles, plan: EpochPlan, share: Sequence[tuple[int, int, int]]) -> str:
    specs = files.manifest.files
    names = sorted({specs[int(plan.rg_file[g])].path for g, _, _ in share})
    return f"in {redact(files.url)}: {', '.join(names)}" if names[0] else f"in {redact(files.url)}"


class WindowBuilder:
    """Builds one window piece by piece: numbers go straight into preallocated numpy arrays (so
    only one row group's Arrow data is alive at a time), the rest is kept as Arrow chunks."""

    def __init__(self, columns: Sequence[ColumnSpec], rows: int, where: str) -> None:
        self._columns = columns
        self._where = where
        self._pos = 0
        self._numbers: dict[str, np.ndarray] = {}
        self._chunks: dict[str, list[pa.Array]] = {}
        for c in columns:
            if c.kind == SCALAR:
                self._numbers[c.name] = np.empty(rows, dtype=np.dtype(c.dtype))
            elif c.kind == ARRAY and c.length is not None:
                self._numbers[c.name] = np.empty((rows, c.length), dtype=np.dtype(c.dtype))
            else:
                self._chunks[c.name] = []

    def add(self, parts: Mapping[str, Sequence[pa.Array]], rows: int) -> None:
        """Appends ``rows`` rows given as Arrow chunks per column."""
        lo, hi = self._pos, self._pos + rows
        for c in self._columns:
            chunks = parts[c.name]
            if c.name in self._chunks:
                self._chunks[c.name].extend(chunks)
                continue
            out = self._numbers[c.name][lo:hi]
            at = 0
            for chunk in chunks:
                values = _scalars(c, chunk, self._where) if c.kind == SCALAR else _fixed_arrays(c, chunk, self._where)
                out[at : at + len(chunk)] = values
                at += len(chunk)
        self._pos = hi

    def finish(self) -> Window:
        """The window; DatasetError when an array column holds null elements."""
        window: Window = dict(self._numbers)
        for name, chunks in self._chunks.items():
            merged = chunks[0] if len(chunks) == 1 else pa.concat_arrays(chunks)
            c = next(c for c in self._columns if c.name == name)
            if c.kind == ARRAY and merged.flatten().null_count:
                raise DatasetError(
                    f"column {c.name!r} has arrays with null elements ({self._where}); torch tensors "
                    "cannot hold nulls: fill them before writing, or leave the column out with columns=[...]"
                )
            window[name] = merged
        return window


def _null_error(c: ColumnSpec, where: str) -> DatasetError:
    return DatasetError(
        f"column {c.name!r} has null values ({where}); torch tensors cannot hold nulls: fill them "
        "before writing (e.g. df.fillna / df.na.drop) or leave the column out with columns=[...]"
    )


def _scalars(c: ColumnSpec, chunk: pa.Array, where: str) -> np.ndarray:
    """A numeric chunk as numpy (a zero-copy view when it can be; the caller copies it)."""
    if chunk.null_count:
        raise _null_error(c, where)
    return chunk.to_numpy(zero_copy_only=False)


def _fixed_arrays(c: ColumnSpec, chunk: pa.Array, where: str) -> np.ndarray:
    """A chunk of fixed-length lists as a ``[rows, length]`` numpy view, its lengths checked."""
    length = int(c.length or 0)
    if chunk.null_count:
        raise _null_error(c, where)
    if not pa.types.is_fixed_size_list(chunk.type) and len(chunk):
        lengths = pc.list_value_length(chunk).to_numpy(zero_copy_only=False)
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo != length or hi != length:
            raise DatasetError(
                f"column {c.name!r} has arrays of {lo} to {hi} elements ({where}), but is recorded "
                f"as length {length}; the files changed after the manifest was taken, or "
                "fixed_lengths is wrong for this column"
            )
    values = chunk.flatten()
    if values.null_count:
        raise _null_error(c, where)
    return values.to_numpy(zero_copy_only=False).reshape(len(chunk), length)


def _padded(arr: pa.Array, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """A list array as a zero-padded ``[rows, longest]`` array and its lengths, with no per-row Python."""
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    values = arr.flatten().to_numpy(zero_copy_only=False)
    n = len(lengths)
    out = np.zeros((n, int(lengths.max()) if n else 0), dtype=np.dtype(dtype))
    if values.size:
        starts = np.cumsum(lengths) - lengths
        rows = np.repeat(np.arange(n), lengths)
        cols = np.arange(values.size) - np.repeat(starts, lengths)
        out[rows, cols] = values
    return out, lengths


def _make_batch(columns: Sequence[ColumnSpec], window: Window, sel: Selection, pin: bool) -> Batch:
    import torch

    batch: Batch = {}
    for c in columns:
        data = window[c.name]
        if isinstance(data, np.ndarray):
            batch[c.name] = torch.from_numpy(data[sel])
            continue
        part = data.slice(sel.start, sel.stop - sel.start) if isinstance(sel, slice) else data.take(pa.array(sel))
        if c.kind == ARRAY:
            values, lengths = _padded(part, c.dtype)
            batch[c.name] = torch.from_numpy(values)
            batch[c.name + LENGTHS_SUFFIX] = torch.from_numpy(lengths)
        elif c.kind in (BINARY, STRING):
            batch[c.name] = part.to_pylist()
    if pin:
        for k, v in batch.items():
            if isinstance(v, torch.Tensor):
                batch[k] = v.pin_memory()
    return batch

