"""sparkdl's Arrow reader: windows of rows read from the row groups, cut into batches of tensors.

A window is read piece by piece: numbers go straight into preallocated numpy arrays, so only one
row group's Arrow data is alive at a time (one per decode thread: ``RowGroupReader``); binary, string and variable-length array columns stay
Arrow until a batch is cut from them. The output format is described in
:mod:`sparkdl._internal.data.loader`.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import numpy as np
import pyarrow as pa

from sparkdl._internal.common.errors import DatasetError
from sparkdl._internal.data.decoding.samples import SampleMap
from sparkdl._internal.data.format.arrow import list_lengths, list_values, to_numpy
from sparkdl._internal.data.format.manifest import ARRAY, SCALAR, ColumnSpec
from sparkdl._internal.data.reading.files import ParquetFiles, RowGroupReader
from sparkdl._internal.data.reading.plan import EpochPlan, pieces
from sparkdl._internal.data.reading.spares import Spares, new_array
from sparkdl._internal.fs.storage import redact

T = TypeVar("T")

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


ROWS = "\x00rows"
"""The window column of each row's place in the dataset (kept only when samples are decoded)."""


@dataclass(frozen=True)
class BatchMaker:
    """How batches come out: which columns, pinned or not, the per-sample ``samples`` functions
    (``decode=``) and the user's ``transform``.

    It holds nothing that refers back to a loader, so the reader thread that uses it does not
    keep a dropped loader alive.
    """

    columns: tuple[ColumnSpec, ...]
    pin: bool
    transform: Callable[[Batch], Batch] | None
    samples: SampleMap | None = None
    # Threads that decode a window's row groups (RowGroupReader): the loader's read_threads.
    read_threads: int = 1

    @property
    def ahead(self) -> int:
        """Batches to start before the first is taken (decoding runs on workers meanwhile)."""
        return self.samples.AHEAD if self.samples is not None else 0

    def start(self, window: Window, sel: Selection, epoch: int) -> Callable[[], Batch]:
        """Starts the batch of rows ``sel`` of ``window``; calling what it returns gives the batch,
        decoded and transformed. The window may be reused once this returns."""
        batch = _make_batch(self.columns, window, sel, self.pin and self.samples is None)
        if self.samples is None:
            return functools.partial(self._finish, batch)
        pending = self.samples.start(batch, np.asarray(window[ROWS][sel]), epoch)
        return lambda: self._finish(pending.result(), pinned=not self.pin)

    def __call__(self, window: Window, sel: Selection, epoch: int) -> Batch:
        """The batch of rows ``sel`` of ``window``, decoded and transformed."""
        return self.start(window, sel, epoch)()

    def _finish(self, batch: Batch, pinned: bool = True) -> Batch:
        if not pinned:
            pin_batch(batch)
        return self.transform(batch) if self.transform is not None else batch


def in_turn(started: Iterator[Callable[[], T]], ahead: int) -> Iterator[T]:
    """The results of ``started`` batches in order, with up to ``ahead`` more started meanwhile."""
    if ahead <= 0:
        for s in started:
            yield s()
        return
    waiting: collections.deque[Callable[[], T]] = collections.deque()
    for s in started:
        waiting.append(s)
        if len(waiting) > ahead:
            yield waiting.popleft()()
    while waiting:
        yield waiting.popleft()()


@dataclass(frozen=True)
class Units:
    """One epoch's share as units: each of ``keys`` is read into a window by ``read`` (in the
    read-ahead thread), and ``play`` starts the batches of the windows it is given, in the order
    of ``keys``; ``reader`` is closed when the epoch ends."""

    keys: Sequence[int]
    read: Callable[[int], Any]
    play: Callable[[Iterator[Any]], Iterator[Callable[[], Batch]]]
    reader: RowGroupReader


def arrow_units(
    files: ParquetFiles,
    plan: EpochPlan,
    make: BatchMaker,
    epoch: int,
    start_step: int,
    *,
    spares: Spares | None = None,
    part: tuple[int, int] | None = None,
) -> Units:
    """This rank's share of ``epoch`` from step ``start_step`` on, as units to read with pyarrow.

    With ``part=(i, n)``, only every ``n``-th unit from the ``i``-th on (a loader worker's part,
    :mod:`sparkdl._internal.data.reading.workers`); :func:`unit_batches` counts the batches of
    each unit.

    The share is read in units of ``plan.unit`` rows (the shuffle window, or about one row group
    without shuffle). A unit is let go as soon as its last batch is cut. With shuffle, batches
    are copies, so a served window's arrays go to ``spares`` and the window after next is read
    into them: the same memory serves every window of every epoch, with no pages to fault in
    again and nothing for the allocator to hold on to.
    """
    columns = make.columns
    order = plan.row_group_order(epoch)
    unit, per_rank, b = plan.unit, plan.per_rank, plan.batch_size
    first = start_step * b
    keys = range(first // unit, -(-per_rank // unit))
    if part is not None:
        keys = keys[part[0] :: part[1]]
    reader = RowGroupReader(files, plan.rg_file, plan.rg_index, plan.rg_rows, columns, make.read_threads)
    base = plan.rank * per_rank
    spare = spares if plan.shuffle else None

    def read(k: int) -> Window:
        lo, hi = k * unit, min((k + 1) * unit, per_rank)
        share = pieces(plan.rg_rows, order, base + lo, hi - lo)
        return read_window(reader, columns, share, WindowBuilder(columns, hi - lo, location(files, plan, share), spare),
                           plan.rg_start if make.samples is not None else None)

    def play(windows: Iterator[Window]) -> Iterator[Callable[[], Batch]]:
        for k, data in zip(keys, windows, strict=True):
            n = min((k + 1) * unit, per_rank) - k * unit
            perm = plan.window_permutation(epoch, k, n) if plan.shuffle else None
            s = max(first - k * unit, 0)
            while s < n:
                e = min(s + b, n)
                yield make.start(data, perm[s:e] if perm is not None else slice(s, e), epoch)
                s = e
            if spare is not None:
                spare.give(data)
            del data, perm

    return Units(keys, read, play, reader)


def units_batches(units: Units, make: BatchMaker, *, read_ahead: bool) -> Iterator[Batch]:
    """The batches of one epoch's ``units``; with ``read_ahead``, the next unit read meanwhile."""
    windows = read_in_turn(units.read, units.keys, read_ahead=read_ahead)
    yield from played(units.play(windows), make, windows, units.reader)


class _Later:
    """A read not started: it runs when its result is asked for (no read-ahead)."""

    def __init__(self, read: Callable[[int], Any], key: int) -> None:
        self._read, self._key = read, key

    def result(self) -> Any:
        return self._read(self._key)


def epoch_after_epoch(units_of: Callable[[int, int], Units], epoch: int, step: int, make: BatchMaker, *,
                      read_ahead: bool) -> Generator[Batch | None, None, None]:
    """The batches of ``epoch`` from ``step`` on, then of each epoch after it from its start,
    with None at the end of each; ``units_of(epoch, step)`` gives an epoch's units.

    With ``read_ahead``, one thread reads the next unit while this one's batches are served, and
    during an epoch's last unit, the next epoch's first: an epoch does not begin by waiting for a
    read (it took a loader worker 40-50 ms here, a shuffle window, while the loop waited), and no
    more is held than in the middle of an epoch (the unit served and the one read). Closing the
    generator stops the thread and closes the readers.
    """
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparkdl-read") if read_ahead else None

    def submit(units: Units, i: int) -> Any:
        key = units.keys[i]
        return pool.submit(units.read, key) if pool is not None else _Later(units.read, key)

    def begin(e: int, s: int) -> list[Any]:
        """[epoch ``e``'s units from step ``s``, the read of its first unit (None without units)]."""
        units = units_of(e, s)
        return [units, submit(units, 0) if units.keys else None]

    units: Units | None = None
    following: list[Any] = []  # [units, first read] of the next epoch, or [error] if they could not be made
    try:
        units, first = begin(epoch, step)
        while True:
            following.clear()

            def windows(units: Units = units, current: Any = first, then: int = epoch + 1) -> Iterator[Any]:
                n = len(units.keys)
                for i in range(n):
                    if i + 1 < n:
                        pending = submit(units, i + 1)
                    else:  # the last unit: the next epoch's first is read while it is served
                        try:
                            following.extend(begin(then, 0))
                        except Exception as exc:  # raised when that epoch begins, not before this one ends
                            following.append(exc)
                        pending = None
                    window = current.result()
                    current = pending  # the future served last is let go before the read after next starts
                    yield window
                    del window

            try:
                yield from in_turn(units.play(windows()), make.ahead)
            finally:
                units.reader.close()
            yield None
            if not following:  # an epoch without units: the next one's are made now
                following.extend(begin(epoch + 1, 0))
            if isinstance(following[0], Exception):
                raise following[0]
            units, first = following
            epoch += 1
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if following and isinstance(following[0], Units):
            following[0].reader.close()
        if units is not None:
            units.reader.close()


def unit_batches(plan: EpochPlan, start_step: int) -> list[int]:
    """The batches of each unit of :func:`arrow_units` from ``start_step`` on, in order
    (a unit is a multiple of the batch size, so no batch spans two)."""
    unit, per_rank, b, first = plan.unit, plan.per_rank, plan.batch_size, start_step * plan.batch_size
    return [-(-(min((k + 1) * unit, per_rank) - max(first, k * unit)) // b)
            for k in range(first // unit, -(-per_rank // unit))]


def played(started: Iterator[Callable[[], Batch]], make: BatchMaker, windows: Any, reader: RowGroupReader) -> Iterator[Batch]:
    """The batches ``started`` begins, ``make.ahead`` under way at a time; the windows read
    ahead and the row-group reader end with it, however the iteration ends."""
    try:
        yield from in_turn(started, make.ahead)
    finally:
        windows.close()
        reader.close()


def read_window(reader: RowGroupReader, columns: Sequence[ColumnSpec], share: Sequence[tuple[int, int, int]],
                builder: WindowBuilder, rg_start: np.ndarray | None = None) -> Window:
    """The rows of the ``(row group, start, stop)`` pieces ``share``, in order, as one window:
    one row group's Arrow data alive at a time (one per decode thread with ``read_threads``).
    With ``rg_start`` (each row group's first row in the dataset), the window also holds each
    row's place in the dataset, as ``ROWS``."""
    for table, a, z in reader.pieces(share):
        part = table.slice(a, z - a)
        builder.add({c.name: part.column(c.name).chunks for c in columns}, z - a)
        del part, table
    window = builder.finish()
    if rg_start is not None:
        window[ROWS] = np.concatenate([np.arange(rg_start[g] + a, rg_start[g] + z, dtype=np.int64)
                                       for g, a, z in share] or [np.empty(0, np.int64)])
    return window


def read_in_turn(read: Callable[[int], T], keys: Sequence[int], *, read_ahead: bool) -> Generator[T, None, None]:
    """``read(k)`` for each of ``keys``, in order. With ``read_ahead``, one thread reads the next
    while the caller serves this one; closing the generator stops it."""
    if not read_ahead:
        for k in keys:
            yield read(k)
        return
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparkdl-read")
    try:
        pending: Future[T] | None = None
        for i, k in enumerate(keys):
            # The future served last is let go here, before the read after next starts.
            current = pending or pool.submit(read, k)
            pending = pool.submit(read, keys[i + 1]) if i + 1 < len(keys) else None
            yield current.result()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def location(files: ParquetFiles, plan: EpochPlan, share: Sequence[tuple[int, int, int]]) -> str:
    """Where ``(row group, start, stop)`` pieces are, for messages: the dataset and its files."""
    specs = files.manifest.files
    names = sorted({specs[int(plan.rg_file[g])].path for g, _, _ in share})
    return f"in {redact(files.url)}: {', '.join(names)}" if names[0] else f"in {redact(files.url)}"


class WindowBuilder:
    """Builds one window piece by piece: numbers go straight into preallocated numpy arrays (so
    only one row group's Arrow data is alive at a time), the rest is kept as Arrow chunks.

    An array column whose length the manifest does not know (plain Parquet lists) is watched as
    its chunks arrive: when every row of the window has one length, the window holds it as a
    ``[rows, length]`` numpy array, as if the length had been declared, and batches are cut from
    it without Arrow ``take`` or padding. Its batches are the same tensors either way.
    """

    def __init__(self, columns: Sequence[ColumnSpec], rows: int, where: str, spare: Spares | None = None) -> None:
        self._columns = columns
        self._empty = spare.take if spare is not None else new_array
        self._rows = rows
        self._where = where
        self._pos = 0
        self._numbers: dict[str, np.ndarray] = {}
        self._chunks: dict[str, list[pa.Array]] = {}
        # Variable-length array columns: None before their first row, then the one length of all
        # their rows so far (held in numpy), or -1 once two lengths or a null row came (Arrow).
        self._uniform: dict[str, int | None] = {}
        for c in columns:
            if c.kind == SCALAR:
                self._numbers[c.name] = self._empty((rows,), c.dtype)
            elif c.kind == ARRAY and c.length is not None:
                self._numbers[c.name] = self._empty((rows, c.length), c.dtype)
            else:
                self._chunks[c.name] = []
                if c.kind == ARRAY:
                    self._uniform[c.name] = None

    def add(self, parts: Mapping[str, Sequence[pa.Array]], rows: int) -> None:
        """Appends ``rows`` rows given as Arrow chunks per column."""
        lo, hi = self._pos, self._pos + rows
        for c in self._columns:
            chunks = parts[c.name]
            if c.name in self._uniform:
                self._add_list(c, chunks, lo)
                continue
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

    def _add_list(self, c: ColumnSpec, chunks: Sequence[pa.Array], at: int) -> None:
        """A variable-length array column: into numpy while every row has one length, else Arrow."""
        for chunk in chunks:
            n = len(chunk)
            known = self._uniform[c.name]
            if known != -1 and n:
                length = _one_length(chunk)
                if length is not None and known in (None, length):
                    if known is None:
                        self._uniform[c.name] = length
                        self._numbers[c.name] = self._empty((self._rows, length), c.dtype)
                    rows = _as_matrix(chunk, length, lambda: _null_elements(c, self._where))
                    self._numbers[c.name][at : at + n] = rows
                    at += n
                    continue
                self._back_to_arrow(c.name, at, chunk.type)
            if self._uniform[c.name] == -1:
                self._chunks[c.name].append(chunk)
            at += n

    def _back_to_arrow(self, name: str, rows: int, list_type: pa.DataType) -> None:
        # A second length (or a null row) arrived: the rows so far go back to Arrow, once.
        self._uniform[name] = -1
        held = self._numbers.pop(name, None)
        if held is not None and rows:
            length = held.shape[1]
            offsets = pa.array(np.arange(0, (rows + 1) * length, length, dtype=np.int64))
            flat = pa.array(held[:rows].reshape(-1))
            self._chunks[name].append(pa.LargeListArray.from_arrays(offsets, flat).cast(list_type))

    def finish(self) -> Window:
        """The window; DatasetError when an array column holds null elements."""
        window: Window = dict(self._numbers)
        for name, chunks in self._chunks.items():
            if name in window:
                continue  # a list column whose rows all had one length: numpy already
            c = next(c for c in self._columns if c.name == name)
            if c.kind == ARRAY and any(chunk.flatten().null_count for chunk in chunks):
                raise _null_elements(c, self._where)
            window[name] = chunks[0] if len(chunks) == 1 else pa.concat_arrays(chunks)
        return window


def _one_length(chunk: pa.Array) -> int | None:
    """The one length of every row of a list chunk, or None (two lengths, or a null row)."""
    if chunk.null_count:
        return None
    lengths = list_lengths(chunk)
    low, high = int(lengths.min()), int(lengths.max())
    return None if low != high else low


def _null_elements(c: ColumnSpec, where: str) -> DatasetError:
    return DatasetError(
        f"column {c.name!r} has arrays with null elements ({where}); torch tensors "
        "cannot hold nulls: fill them before writing, or leave the column out with columns=[...]"
    )


def _null_error(c: ColumnSpec, where: str) -> DatasetError:
    return DatasetError(
        f"column {c.name!r} has null values ({where}); torch tensors cannot hold nulls: fill them "
        "before writing (e.g. df.fillna / df.na.drop) or leave the column out with columns=[...]"
    )


def _scalars(c: ColumnSpec, chunk: pa.Array, where: str) -> np.ndarray:
    """A numeric chunk as numpy (a zero-copy view when it can be; the caller copies it)."""
    if chunk.null_count:
        raise _null_error(c, where)
    return to_numpy(chunk)


def _fixed_arrays(c: ColumnSpec, chunk: pa.Array, where: str) -> np.ndarray:
    """A chunk of fixed-length lists as a ``[rows, length]`` numpy view, its lengths checked."""
    length = int(c.length or 0)
    if chunk.null_count:
        raise _null_error(c, where)
    if not pa.types.is_fixed_size_list(chunk.type) and len(chunk):
        lengths = list_lengths(chunk)
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo != length or hi != length:
            raise DatasetError(
                f"column {c.name!r} has arrays of {lo} to {hi} elements ({where}), but is recorded "
                f"as length {length}; the files changed after the manifest was taken, or "
                "fixed_lengths is wrong for this column"
            )
    return _as_matrix(chunk, length, lambda: _null_error(c, where))


def _as_matrix(chunk: pa.Array, length: int, null_error: Callable[[], DatasetError]) -> np.ndarray:
    """A chunk of lists that all hold ``length`` elements as a ``[rows, length]`` numpy view;
    ``null_error()`` is raised when an element is null. The chunk has no null rows."""
    values = list_values(chunk)
    if values.null_count:
        raise null_error()
    return to_numpy(values).reshape(len(chunk), length)


def _padded(arr: pa.Array, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """A list array as a zero-padded ``[rows, longest]`` array and its lengths, with no per-row Python."""
    lengths = list_lengths(arr)
    values = to_numpy(arr.flatten())
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
            values = data[sel]
            batch[c.name] = torch.from_numpy(values)
            if c.kind == ARRAY and c.length is None:
                # A variable-length column whose rows in this window all have one length: the
                # same tensors as padding would give.
                batch[c.name + LENGTHS_SUFFIX] = torch.full((len(values),), values.shape[1], dtype=torch.int64)
            continue
        part = data.slice(sel.start, sel.stop - sel.start) if isinstance(sel, slice) else data.take(pa.array(sel))
        if c.kind == ARRAY:
            values, lengths = _padded(part, c.dtype)
            batch[c.name] = torch.from_numpy(values)
            batch[c.name + LENGTHS_SUFFIX] = torch.from_numpy(lengths)
        else:  # binary, strings; structs and the like when a decode function takes them
            batch[c.name] = part.to_pylist()
    if pin:
        pin_batch(batch)
    return batch


def pin_batch(batch: Batch) -> None:
    """Pins the batch's CPU tensors in place of them (in the dict)."""
    import torch

    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.device.type == "cpu":
            batch[k] = v.pin_memory()

