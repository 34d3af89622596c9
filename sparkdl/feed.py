"""The feed stage: one rank's shard of a :class:`~sparkdl.Dataset`, as batches of torch tensors.

Every epoch is planned from the manifest alone (rows per row group), so every rank knows, before
it reads a byte, how many rows and batches it gets; the plan is the same on every rank because
the manifest travels inside the pickled ``Dataset``. How an epoch is planned:

1. The row groups of all files are put in an order: file order, or, with ``shuffle``, a
   permutation seeded by ``(seed, epoch)``. Concatenated in that order they form the epoch's
   stream of ``N`` rows.
2. Rank ``r`` of ``W`` takes the ``r``-th of ``W`` equal, contiguous ranges of that stream, so
   every rank reads about ``1/W`` of the data and nothing else.
3. With ``shuffle``, each rank's range is cut into windows of ``shuffle_window`` rows (a multiple
   of the batch size that spans several row groups), and the rows of each window are permuted
   (seeded by ``(seed, epoch, rank, window)``). Batches are consecutive runs of that order.

The remainder policy (``drop_last``):

- ``drop_last=True``: each rank gets ``floor(N / (W * batch_size))`` full batches. The last
  ``N mod (W * batch_size)`` rows of the epoch's stream are dropped; with ``shuffle`` they are
  other rows every epoch.
- ``drop_last=False`` (the default, like ``torch.utils.data.DistributedSampler``): each rank gets
  ``ceil(N / W)`` rows; the stream wraps around to its start for the ``W * ceil(N / W) - N`` (< W)
  rows that are missing, so those rows are seen twice. The last batch of every rank has
  ``ceil(N / W) - (len - 1) * batch_size`` rows, the same on every rank.

Either way ``len(loader)`` is the same on every rank, by construction.

Output: a ``dict`` from column name to

- a 1-D tensor for numeric columns (int8/16/32/64, float16/32/64, bool);
- a 2-D ``[batch, length]`` tensor for fixed-length numeric arrays (and ML vectors);
- for variable-length numeric arrays, a 2-D tensor padded with zeros to the longest row of the
  batch, plus ``"<name>_lengths"``, an int64 tensor of the true lengths (a null array is empty);
- a list of ``bytes`` for binary columns and of ``str`` for strings (``None`` for nulls), unless
  ``transform`` turns them into tensors.

Numeric columns must not hold nulls: the loader stops with :class:`~sparkdl.DatasetError` naming
the column.
"""

from __future__ import annotations

import contextlib
import inspect
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkdl.dataset import ARRAY, BINARY, SCALAR, STRING, UNSUPPORTED, ColumnSpec, Dataset, _redact
from sparkdl.errors import ConfigError, DatasetError, NotInRunError

if TYPE_CHECKING:
    import pyarrow.parquet as pq

Batch: TypeAlias = dict[str, Any]
"""One batch: ``{column: torch.Tensor | list}``."""

LENGTHS_SUFFIX = "_lengths"
_STATE_VERSION = 1
# Default shuffle window: this many row groups' worth of rows, but no more than this many bytes.
_WINDOW_ROW_GROUPS = 4
_WINDOW_MAX_BYTES = 128 * 1024 * 1024
_CLASSIC_STACK = "pyspark 3.5, pyarrow 14.0.2, numpy 1.26 and petastorm 0.12.1"

# Window columns: numpy for numbers (1-D, or 2-D for fixed arrays), Arrow for everything else.
_Column: TypeAlias = np.ndarray | pa.Array
_Window: TypeAlias = dict[str, _Column]
_Selection: TypeAlias = slice | np.ndarray


class Loader:
    """An iterable over one rank's batches of one epoch at a time; made by :meth:`Dataset.loader`.

    Iterating plays the current epoch from the current position. When an iteration runs to its
    end, the loader moves to the next epoch, position 0, so plain repeated ``for`` loops see
    epoch after epoch. ``set_epoch(e)`` moves to epoch ``e`` (position 0) unless the loader is
    already in epoch ``e``: then it keeps its position, so that a position restored with
    :meth:`load_state_dict` survives the usual ``set_epoch`` call at the top of an epoch loop.

    Shuffle: see the module docstring. The default ``shuffle_window`` is 4 times the rows of the
    largest row group, at most 128 MiB of uncompressed data, and at least one batch. A window is
    then rounded to a multiple of ``batch_size`` and evened out so that the rank's share is cut
    into windows of equal size (``loader.shuffle_window`` tells the result). Memory held is about
    three windows (the one being served, the one being read ahead, one row group) plus
    ``prefetch`` batches, the same in every epoch.

    Resume: :meth:`state_dict` records the epoch and the number of batches this loader has
    yielded in it; after :meth:`load_state_dict` the next iteration yields exactly the batches
    that were not yet yielded, in the same order as the uninterrupted run. Every rank takes the
    same number of steps, so rank 0's state restores every rank.

    With ``reader="petastorm"``, batches come from Petastorm's ``make_batch_reader`` with
    ``cur_shard=rank, shard_count=world_size`` and are cut to ``batch_size``; the loader stops
    every rank after ``len(loader)`` batches (computed from the manifest as above), reading its
    shard again from its start if it runs short. That keeps the equal-steps guarantee and the
    output format, but not exact coverage: Petastorm shards by row groups, which may hold
    unequal rows. Resume skips the batches already yielded, which repeats the same batches only
    when Petastorm's own order is deterministic (``petastorm_workers=1``).
    """

    def __init__(
        self,
        dataset: Dataset,
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
    ) -> None:
        _check_int("batch_size", batch_size, 1)
        _check_int("epoch", epoch, 0)
        _check_int("seed", seed, 0)
        _check_int("prefetch", prefetch, 0)
        _check_int("petastorm_workers", petastorm_workers, 1)
        if shuffle_window is not None:
            _check_int("shuffle_window", shuffle_window, 1)
        if reader not in ("arrow", "petastorm"):
            raise ConfigError(f"reader={reader!r}: choose 'arrow' (sparkdl's reader) or 'petastorm'")
        if transform is not None and not callable(transform):
            raise ConfigError(f"transform must be callable (batch dict -> batch dict); got {type(transform).__name__}")
        rank, world_size = _resolve_rank(rank, world_size)
        # The plan holds everything the reader thread needs and nothing that refers back to this
        # loader, so that dropping the loader stops its thread.
        self._plan = _Plan(
            dataset,
            batch_size,
            shuffle=bool(shuffle),
            seed=seed,
            columns=_select_columns(dataset, columns),
            drop_last=bool(drop_last),
            rank=rank,
            world_size=world_size,
            reader=reader,
            transform=transform,
            shuffle_window=shuffle_window,
            pin=_resolve_pin(device, pin_memory),
            petastorm_workers=petastorm_workers,
        )
        self._prefetch = prefetch
        self._epoch = epoch
        self._step = 0
        self._active: _Iteration | None = None

    # -- what the plan gives ---------------------------------------------------------------------

    def __len__(self) -> int:
        """Batches per epoch; the same on every rank."""
        return self._plan.steps

    @property
    def epoch(self) -> int:
        """The epoch the next iteration plays."""
        return self._epoch

    @property
    def step(self) -> int:
        """Batches of the current epoch already yielded."""
        return self._step

    @property
    def rank(self) -> int:
        return self._plan.rank

    @property
    def world_size(self) -> int:
        return self._plan.world_size

    @property
    def batch_size(self) -> int:
        return self._plan.batch_size

    @property
    def rows_per_rank(self) -> int:
        """Rows each rank sees per epoch (repeats included, dropped rows excluded)."""
        return self._plan.per_rank

    @property
    def shuffle_window(self) -> int:
        """Rows shuffled together (also the unit of reading)."""
        return self._plan.window

    def plan(self, epoch: int) -> list[tuple[int, int, int, int]]:
        """This rank's share of ``epoch`` as ``(file index, row group, start, stop)`` pieces.

        The pieces are in stream order, before the shuffle window permutes rows among them.
        """
        return self._plan.pieces_of_share(epoch)

    def set_epoch(self, epoch: int) -> None:
        """Moves to ``epoch`` at position 0, unless the loader is already in ``epoch``."""
        _check_int("epoch", epoch, 0)
        if epoch != self._epoch:
            self._close_active()
            self._epoch = epoch
            self._step = 0

    # -- resume ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position: plain values, picklable and JSON-able; the same on every rank."""
        p = self._plan
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "step": self._step,
            "steps_per_epoch": p.steps,
            "batch_size": p.batch_size,
            "world_size": p.world_size,
            "drop_last": p.drop_last,
            "shuffle": p.shuffle,
            "seed": p.seed,
            "shuffle_window": p.window,
            "reader": p.reader,
            "dataset": p.ds.manifest.fingerprint(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a position from :meth:`state_dict`; the next iteration resumes there.

        Raises:
            ConfigError: the state was taken with other settings (batch size, world size,
                shuffle, seed, window, reader) or on another dataset layout.
        """
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            raise ConfigError(
                "load_state_dict got something that is not a state from Loader.state_dict() of this "
                f"sparkdl version (version {state.get('version') if isinstance(state, Mapping) else None!r})"
            )
        mine = self.state_dict()
        for key in ("batch_size", "world_size", "drop_last", "shuffle", "seed", "shuffle_window", "reader", "dataset"):
            if state.get(key) != mine[key]:
                what = "dataset layout (files, row groups, columns)" if key == "dataset" else key
                raise ConfigError(
                    f"cannot resume: the saved state has {what}={state.get(key)!r} and this loader "
                    f"{mine[key]!r}; create the loader with the settings (and on the data) of the "
                    "run that saved the state"
                )
        epoch, step, steps = state.get("epoch"), state.get("step"), self._plan.steps
        if not isinstance(epoch, int) or not isinstance(step, int) or epoch < 0 or not 0 <= step <= steps:
            raise ConfigError(f"the saved state has epoch={epoch!r}, step={step!r}, out of range for {steps} steps")
        self._close_active()
        self._epoch, self._step = (epoch + 1, 0) if step == steps else (epoch, step)

    # -- iteration -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the background reader of an unfinished iteration (``break`` out of a loop keeps it
        waiting, with its prefetched batches, until the loader is dropped or iterated again).
        The position is kept; iterating again resumes from it."""
        self._close_active()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Batch]:
        self._close_active()
        if self._plan.reader == "petastorm":
            batches = self._plan.petastorm_batches(self._epoch, self._step)
        else:
            batches = self._plan.arrow_batches(self._epoch, self._step, read_ahead=self._prefetch > 0)
        self._active = _Iteration(self, batches, self._prefetch)
        return self._active

    def _close_active(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None

    def _consumed(self, it: _Iteration) -> None:
        if self._active is it:
            self._step += 1

    def _finished(self, it: _Iteration) -> None:
        if self._active is it:
            self._epoch += 1
            self._step = 0
            self._active = None


class _Plan:
    """The fixed part of a loader: the layout, the settings, and how to make an epoch's batches."""

    def __init__(
        self,
        ds: Dataset,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int,
        columns: tuple[ColumnSpec, ...],
        drop_last: bool,
        rank: int,
        world_size: int,
        reader: str,
        transform: Callable[[Batch], Batch] | None,
        shuffle_window: int | None,
        pin: bool,
        petastorm_workers: int,
    ) -> None:
        self.ds, self.batch_size, self.shuffle, self.seed = ds, batch_size, shuffle, seed
        self.columns, self.drop_last, self.rank, self.world_size = columns, drop_last, rank, world_size
        self.reader, self.transform, self.pin, self.petastorm_workers = reader, transform, pin, petastorm_workers
        manifest = ds.manifest
        self.rg_file = np.array([i for i, f in enumerate(manifest.files) for _ in f.row_groups], dtype=np.int64)
        self.rg_index = np.array([j for f in manifest.files for j in range(len(f.row_groups))], dtype=np.int64)
        self.rg_rows = np.array([n for f in manifest.files for n in f.row_groups], dtype=np.int64)
        total = int(self.rg_rows.sum())
        if total == 0:
            raise DatasetError(f"{_redact(ds.url)} has no rows; write some data into it first")
        self.num_rows = total
        b = batch_size
        if drop_last:
            self.per_rank = (total // (world_size * b)) * b
            if self.per_rank == 0:
                raise ConfigError(
                    f"drop_last=True leaves no batch: the dataset has {total} rows, fewer than "
                    f"world_size * batch_size = {world_size} * {b}. Use a smaller batch_size or "
                    "drop_last=False"
                )
            self.steps = self.per_rank // b
        else:
            self.per_rank = -(-total // world_size)
            self.steps = -(-self.per_rank // b)
        self.window = self._window_rows(shuffle_window)
        if reader == "petastorm":
            _petastorm_make_batch_reader()  # fail now, not in the first step, when it cannot run
            ragged = [c.name for c in columns if c.kind == ARRAY and c.length is None]
            if ragged:
                raise ConfigError(
                    f"reader='petastorm' cannot read the variable-length array column(s) {ragged}: "
                    "Petastorm's make_batch_reader needs every list in a column to have one length. "
                    "Use reader='arrow', or leave them out with columns=[...]"
                )
            if len(self.rg_rows) < world_size:
                raise ConfigError(
                    f"reader='petastorm' shards by row groups and the dataset has {len(self.rg_rows)} "
                    f"for world_size={world_size}; write it with more row groups (smaller "
                    "row_group_bytes or more num_files) or use reader='arrow'"
                )

    def _window_rows(self, requested: int | None) -> int:
        b, share = self.batch_size, self.per_rank
        if requested is None:
            # The largest row group, so that a window spans several groups however uneven they are.
            largest = int(self.rg_rows.max())
            bytes_per_row = max(1.0, self.ds.manifest.uncompressed_bytes / self.num_rows)
            requested = min(_WINDOW_ROW_GROUPS * largest, int(_WINDOW_MAX_BYTES / bytes_per_row))
        window = _ceil_div(max(requested, b), b) * b
        # Even out the windows of the share, so that the last one is not a small tail (which would
        # mix few row groups); each stays a multiple of the batch size.
        count = _ceil_div(share, window)
        return _ceil_div(_ceil_div(share, count), b) * b

    def row_group_order(self, epoch: int) -> np.ndarray:
        n = len(self.rg_rows)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch, 0]).permutation(n)

    def window_permutation(self, epoch: int, window: int, n: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch, 1, self.rank, window]).permutation(n)

    def pieces_of_share(self, epoch: int) -> list[tuple[int, int, int, int]]:
        pieces = _pieces(self.rg_rows, self.row_group_order(epoch), self.rank * self.per_rank, self.per_rank)
        return [(int(self.rg_file[g]), int(self.rg_index[g]), a, z) for g, a, z in pieces]

    def arrow_batches(self, epoch: int, start_step: int, *, read_ahead: bool) -> Iterator[Batch]:
        order = self.row_group_order(epoch)
        window, per_rank, b = self.window, self.per_rank, self.batch_size
        first = start_step * b
        windows = range(first // window, -(-per_rank // window))
        reader = _RowGroupReader(self.ds, self.rg_file, self.rg_index, self.rg_rows, self.columns)
        base = self.rank * per_rank

        def read(k: int) -> _Window:
            lo, hi = k * window, min((k + 1) * window, per_rank)
            pieces = _pieces(self.rg_rows, order, base + lo, hi - lo)
            builder = _WindowBuilder(self.columns, hi - lo, self._where(pieces))
            for g, a, z in pieces:
                part = reader.row_group(g).slice(a, z - a)
                builder.add({c.name: part.column(c.name).chunks for c in self.columns}, z - a)
            return builder.finish()

        # One thread reads and decodes the next window while this one's batches are served.
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparkdl-read") if read_ahead else None
        try:
            pending: Future[_Window] | None = None
            for i, k in enumerate(windows):
                if pool is None:
                    data = read(k)
                else:
                    data = (pending or pool.submit(read, k)).result()
                    pending = pool.submit(read, windows[i + 1]) if i + 1 < len(windows) else None
                n = min((k + 1) * window, per_rank) - k * window
                perm = self.window_permutation(epoch, k, n) if self.shuffle else None
                s = max(first - k * window, 0)
                while s < n:
                    e = min(s + b, n)
                    yield self._batch(data, perm[s:e] if perm is not None else slice(s, e))
                    s = e
        finally:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    def _where(self, pieces: Sequence[tuple[int, int, int]]) -> str:
        files = self.ds.manifest.files
        names = sorted({files[int(self.rg_file[g])].path for g, _, _ in pieces})
        return f"in {_redact(self.ds.url)}: {', '.join(names)}" if names[0] else f"in {_redact(self.ds.url)}"

    def _batch(self, window: _Window, sel: _Selection) -> Batch:
        batch = _make_batch(self.columns, window, sel, self.pin)
        return self.transform(batch) if self.transform is not None else batch

    def petastorm_batches(self, epoch: int, start_step: int) -> Iterator[Batch]:
        make_batch_reader = _petastorm_make_batch_reader()
        kwargs: dict[str, Any] = {
            "schema_fields": [c.name for c in self.columns],
            "reader_pool_type": "thread",
            "workers_count": self.petastorm_workers,
            "num_epochs": None,  # a short shard is read again; the loader stops at len(loader)
            "cur_shard": self.rank,
            "shard_count": self.world_size,
            "shuffle_row_groups": self.shuffle,
        }
        accepted = inspect.signature(make_batch_reader).parameters
        optional = {"seed": self.seed * 1_000_003 + epoch, "shard_seed": self.seed, "shuffle_rows": self.shuffle}
        kwargs.update({k: v for k, v in optional.items() if k in accepted})
        sizes = [self.batch_size] * (self.steps - 1) + [self.per_rank - (self.steps - 1) * self.batch_size]
        with make_batch_reader(self.ds.url, **kwargs) as reader:
            missing = [c.name for c in self.columns if c.name not in reader.schema.fields]
            if missing:
                raise ConfigError(
                    f"Petastorm's make_batch_reader skips the column(s) {missing} of "
                    f"{_redact(self.ds.url)} (it reads numbers, strings, binary and lists written as "
                    "Parquet LIST, not Arrow fixed-size lists); use reader='arrow', or leave them "
                    "out with columns=[...]"
                )
            chunks = (
                {c.name: _from_petastorm(c, np.asarray(getattr(raw, c.name))) for c in self.columns}
                for raw in reader
            )
            for step, data in enumerate(_rebatch(chunks, sizes)):
                if step >= start_step:
                    builder = _WindowBuilder(self.columns, sizes[step], f"in {_redact(self.ds.url)} (petastorm)")
                    builder.add(data, sizes[step])
                    yield self._batch(builder.finish(), slice(0, sizes[step]))


# ------------------------------------------------------------------------------------------------
# Planning helpers (pure functions)
# ------------------------------------------------------------------------------------------------


def _pieces(rows: np.ndarray, order: np.ndarray, start: int, count: int) -> list[tuple[int, int, int]]:
    """``(row group, start, stop)`` pieces covering stream positions ``[start, start + count)``.

    The stream is the row groups in ``order``, concatenated; positions past its end wrap to its
    start (the ``drop_last=False`` padding).
    """
    total = int(rows.sum())
    bounds = np.concatenate([[0], np.cumsum(rows[order])])
    out: list[tuple[int, int, int]] = []
    pos, end = start, start + count
    while pos < end:
        p = pos % total
        k = int(np.searchsorted(bounds, p, side="right")) - 1
        g = int(order[k])
        offset = p - int(bounds[k])
        take = min(int(rows[g]) - offset, end - pos)
        out.append((g, offset, offset + take))
        pos += take
    return out


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"{name}={value!r}: give an integer >= {minimum}")


def _select_columns(dataset: Dataset, columns: Sequence[str] | None) -> tuple[ColumnSpec, ...]:
    manifest = dataset.manifest
    if isinstance(columns, str):
        columns = [columns]
    names = list(columns) if columns is not None else [c.name for c in manifest.columns]
    if not names:
        raise ConfigError("columns=[] selects nothing; name at least one column, or leave columns out for all")
    known = {c.name for c in manifest.columns}
    missing = [n for n in names if n not in known]
    if missing:
        raise ConfigError(f"columns {missing} are not in the dataset; its columns are {sorted(known)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"columns={names} names a column twice")
    specs = tuple(manifest.column(n) for n in names)
    bad = [f"{c.name!r} ({c.dtype})" for c in specs if c.kind == UNSUPPORTED]
    if bad:
        feedable = [c.name for c in manifest.columns if c.kind != UNSUPPORTED]
        raise ConfigError(
            f"the column(s) {', '.join(bad)} cannot be fed to torch (supported: numbers, numeric "
            f"arrays, binary, strings); pass columns=[...] without them, e.g. columns={feedable}"
        )
    for c in specs:
        if c.kind == ARRAY and c.length is None and c.name + LENGTHS_SUFFIX in names:
            raise ConfigError(
                f"the variable-length column {c.name!r} comes with a {c.name + LENGTHS_SUFFIX!r} tensor, "
                "and the dataset has a column of that name too; leave one of them out with columns=[...]"
            )
    return specs


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if (rank is None) != (world_size is None):
        raise ConfigError(
            f"pass both rank and world_size, or neither (got rank={rank!r}, world_size={world_size!r}); "
            "without them they come from sparkdl.context() or torch.distributed"
        )
    if rank is None or world_size is None:
        from sparkdl.context import context

        try:
            ctx = context()
            return ctx.rank, ctx.world_size
        except NotInRunError:
            pass
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    _check_int("world_size", world_size, 1)
    _check_int("rank", rank, 0)
    if rank >= world_size:
        raise ConfigError(f"rank={rank} must be below world_size={world_size}")
    return int(rank), int(world_size)


def _resolve_pin(device: Any, pin_memory: bool | None) -> bool:
    import torch

    if pin_memory is not None:
        return bool(pin_memory) and torch.cuda.is_available()
    if device is None:
        from sparkdl.context import context

        try:
            device = context().device
        except NotInRunError:
            return False
    return bool(torch.device(device).type == "cuda" and torch.cuda.is_available())


# ------------------------------------------------------------------------------------------------
# Reading and converting
# ------------------------------------------------------------------------------------------------


class _RowGroupReader:
    """Reads row groups, keeping the last one (windows often split a row group) and a few open files."""

    _OPEN_FILES = 8

    def __init__(
        self,
        dataset: Dataset,
        rg_file: np.ndarray,
        rg_index: np.ndarray,
        rg_rows: np.ndarray,
        columns: Sequence[ColumnSpec],
    ) -> None:
        self._ds = dataset
        self._rg_file, self._rg_index, self._rg_rows = rg_file, rg_index, rg_rows
        self._names = [c.name for c in columns]
        self._files: dict[int, pq.ParquetFile] = {}
        self._last: tuple[int, pa.Table] | None = None
        self._last_file = 0

    def row_group(self, g: int) -> pa.Table:
        if self._last is not None and self._last[0] == g:
            return self._last[1]
        f = int(self._rg_file[g])
        self._last_file = f
        handle = self._files.pop(f, None) or self._ds._open_file(f)
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
        self._last = (g, table)
        return table

    def where(self) -> str:
        f = self._ds.manifest.files[self._last_file].path
        return f"{_redact(self._ds.url)}/{f}" if f else _redact(self._ds.url)


class _WindowBuilder:
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

    def finish(self) -> _Window:
        window: _Window = dict(self._numbers)
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


def _make_batch(columns: Sequence[ColumnSpec], window: _Window, sel: _Selection, pin: bool) -> Batch:
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


# ------------------------------------------------------------------------------------------------
# Petastorm
# ------------------------------------------------------------------------------------------------


def _petastorm_make_batch_reader() -> Callable[..., Any]:
    try:
        from petastorm import make_batch_reader
    except Exception as exc:  # ImportError, or AttributeError from a pyarrow it does not know
        raise ConfigError(
            f"reader='petastorm' needs Petastorm, which cannot be imported here "
            f"({type(exc).__name__}: {exc}; installed pyarrow {pa.__version__}). Petastorm runs only "
            f"on the classic stack: {_CLASSIC_STACK}. Use reader='arrow' on this stack"
        ) from exc
    return make_batch_reader


def _from_petastorm(c: ColumnSpec, values: np.ndarray) -> pa.Array:
    """One column of a Petastorm batch (numpy) as Arrow, so both readers share the conversions."""
    if c.kind == ARRAY:
        element = pa.from_numpy_dtype(np.dtype(c.dtype))
        if values.dtype != object and values.ndim == 2:
            flat = pa.array(np.ascontiguousarray(values).reshape(-1), type=element)
            return pa.FixedSizeListArray.from_arrays(flat, values.shape[1])
        return pa.array([None if v is None else np.asarray(v) for v in values], type=pa.list_(element))
    if c.kind in (BINARY, STRING):
        return pa.array(list(values), type=pa.binary() if c.kind == BINARY else pa.string())
    return pa.array(values)


def _rebatch(chunks: Iterator[dict[str, pa.Array]], sizes: Sequence[int]) -> Iterator[dict[str, list[pa.Array]]]:
    """Cuts a stream of column chunks into batches of exactly ``sizes[0], sizes[1], ...`` rows."""
    held: list[dict[str, pa.Array]] = []
    have = 0
    for size in sizes:
        while have < size:
            chunk = next(chunks, None)
            if chunk is None:
                raise DatasetError(
                    f"Petastorm's reader ended after {have} rows while a batch of {size} was due; "
                    "the dataset changed, or the shard is empty"
                )
            n = len(next(iter(chunk.values())))
            if n:
                held.append(chunk)
                have += n
        out: dict[str, list[pa.Array]] = {k: [] for k in held[0]}
        need = size
        while need:
            chunk = held[0]
            n = len(next(iter(chunk.values())))
            take = min(n, need)
            for k, v in chunk.items():
                out[k].append(v.slice(0, take))
            if take == n:
                held.pop(0)
            else:
                held[0] = {k: v.slice(take) for k, v in chunk.items()}
            need -= take
            have -= take
        yield out


# ------------------------------------------------------------------------------------------------
# Prefetch
# ------------------------------------------------------------------------------------------------


class _End:
    pass


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = _End()
_Item: TypeAlias = Batch | _End | _Failure


def _pump(batches: Iterator[Batch], out: queue.Queue[_Item], stop: threading.Event) -> None:
    """The background thread: moves batches into the bounded queue until done or told to stop."""

    def put(item: _Item) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        for batch in batches:
            if not put(batch):
                return
        put(_END)
    except BaseException as exc:  # handed to the consumer, which raises it in the training thread
        put(_Failure(exc))
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


class _Iteration:
    """One pass over an epoch; with ``prefetch`` > 0 a background thread prepares the batches."""

    _JOIN_S = 5.0

    def __init__(self, loader: Loader, batches: Iterator[Batch], prefetch: int) -> None:
        # Weak: the loader holds its active iteration, and must stay collectable by refcount.
        self._loader_ref: weakref.ref[Loader] | None = weakref.ref(loader)
        self._closed = False
        self._stop = threading.Event()
        self._batches: Iterator[Batch] | None = None
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=max(1, prefetch))
        if prefetch > 0:
            # The thread holds the generator, the queue and the event, never this object, so
            # dropping the iteration stops the thread.
            self._thread = threading.Thread(
                target=_pump, args=(batches, self._queue, self._stop), name="sparkdl-prefetch", daemon=True
            )
            self._thread.start()
        else:
            self._batches = batches

    def __iter__(self) -> _Iteration:
        return self

    def __next__(self) -> Batch:
        if self._closed:
            raise StopIteration
        item = self._next_item()
        loader = self._loader_ref() if self._loader_ref is not None else None
        if isinstance(item, _End):
            self.close()
            if loader is not None:
                loader._finished(self)
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        if loader is not None:
            loader._consumed(self)
        return item

    def _next_item(self) -> _Item:
        if self._batches is not None:
            try:
                return next(self._batches)
            except StopIteration:
                return _END
            except BaseException as exc:
                return _Failure(exc)
        thread = self._thread
        while True:
            try:
                return self._queue.get(timeout=0.5)
            except queue.Empty:
                # Bounded by the reader thread's life: it always leaves an item before it ends.
                if thread is None or not thread.is_alive():
                    try:
                        return self._queue.get_nowait()
                    except queue.Empty:
                        return _Failure(DatasetError("the loader's reader thread ended without a result"))

    def close(self) -> None:
        """Stops the background thread and drops prepared batches."""
        if self._closed:
            return
        self._closed = True
        self._loader_ref = None
        self._stop.set()
        if self._batches is not None:
            close = getattr(self._batches, "close", None)
            if close is not None:
                close()
            self._batches = None
        if self._thread is not None:
            while True:  # drain so a blocked put returns at once
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            if self._thread is not threading.current_thread():
                self._thread.join(self._JOIN_S)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


__all__ = ["LENGTHS_SUFFIX", "Batch", "Loader"]
