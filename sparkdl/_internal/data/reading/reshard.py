"""Resuming an interrupted epoch at another world size: which rows each new rank has left, and
the reader of those rows.

An interrupted epoch is a chain of *levels*. The first is the epoch's plan at the world size that
started it: rank ``r`` of ``W`` owns the rows of its share in its window-permuted order. A level's
ranks stopped after ``step`` steps, so each has the rest of its order left; those rests,
concatenated in rank order, are the *resume stream* of the next level, whose ranks take equal
contiguous ranges of it, with the remainder policy of the plan (``drop_last=False``: ``ceil(M / W)``
rows each, wrapping to the stream's start; ``drop_last=True``: whole batches only). The loader's
own world size is the last level; a state saved in a resumed epoch carries the levels before it,
so a later resume, at any world size, adds one level and knows exactly which rows are left.

Everything here is computed from the manifest and the levels alone, like the plan. A rank's rows
are positions in the epoch's stream (its row groups in ``row_group_order``, concatenated), held as
one int64 array; they are read a unit (``plan.unit`` rows) at a time, each unit from the few
stream ranges that cover its rows, and cut into batches in the order of the positions.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.data.reading.files import ParquetFiles, RowGroupReader
from sparkdl._internal.data.reading.petastorm_reader import petastorm_batches
from sparkdl._internal.data.reading.plan import EpochPlan, pieces, share_rows, stream_bounds
from sparkdl._internal.data.reading.read import (
    Batch,
    BatchMaker,
    Spares,
    Units,
    Window,
    WindowBuilder,
    arrow_units,
    epoch_after_epoch,
    location,
    read_window,
    unit_batches,
    units_batches,
)

STATE_VERSION = 2
"""The version of ``Loader.state_dict``; 1 (before resharding) is still read."""

# Settings a resume needs to be equal; at another world size the evened window differs, so the
# window the user asked for is compared instead.
_SAME = ("batch_size", "drop_last", "shuffle", "seed", "reader", "dataset")


@dataclass(frozen=True)
class Level:
    """One world size's turn at an interrupted epoch: its ``world_size`` ranks took ``step`` steps.

    ``shuffle_window`` is the (evened) window of that world size's plan; the first level's orders
    its rows, the later levels' rows are in resume-stream order already.
    """

    world_size: int
    step: int
    shuffle_window: int

    def state(self) -> dict[str, int]:
        """Plain values for ``Loader.state_dict``."""
        return {"world_size": self.world_size, "step": self.step, "shuffle_window": self.shuffle_window}


@dataclass(frozen=True)
class Position:
    """Where a loader resumes: ``epoch``, ``step``, and the rest of a resharded epoch, if any."""

    epoch: int
    step: int
    resume: Resume | None = None


class Resume:
    """This rank's part of the rest of ``epoch`` after ``levels`` (see the module docstring).

    Raises:
        ConfigError: a level's step is out of range for its rows.
    """

    def __init__(self, plan: EpochPlan, epoch: int, levels: Sequence[Level]) -> None:
        self.plan, self.epoch, self.levels = plan, epoch, tuple(levels)
        self._streams, self.stream_rows = _streams(plan, self.levels)
        self.per_rank = share_rows(self.stream_rows, plan.world_size, plan.batch_size, plan.drop_last)
        self.steps = -(-self.per_rank // plan.batch_size)

    def state(self) -> list[dict[str, int]]:
        """The levels as plain values."""
        return [level.state() for level in self.levels]

    def positions(self) -> np.ndarray:
        """This rank's rows, in order, as positions in the epoch's stream."""
        p, b = self.plan, self.plan.batch_size
        at = (p.rank * self.per_rank + np.arange(self.per_rank, dtype=np.int64)) % self.stream_rows
        # Back through the levels: a row of a level's resume stream is a row of one of its ranks.
        for i in range(len(self.levels) - 1, -1, -1):
            level, (rows, per_rank) = self.levels[i], self._streams[i]
            owner, index = np.divmod(at, per_rank - level.step * b)
            index += level.step * b
            if i == 0 and p.shuffle:
                index = self._permuted(owner, index, per_rank, level.shuffle_window)
            at = (owner * per_rank + index) % rows
        return at

    def _permuted(self, owner: np.ndarray, index: np.ndarray, per_rank: int, window: int) -> np.ndarray:
        """Index ``index`` of rank ``owner``'s window-permuted order, as an index of its share."""
        windows = -(-per_rank // window)
        unit = owner * windows + index // window
        by_unit = np.argsort(unit, kind="stable")
        keys, starts = np.unique(unit[by_unit], return_index=True)
        ends = np.append(starts[1:], len(unit))
        out = np.empty_like(index)
        for key, lo, hi in zip(keys.tolist(), starts.tolist(), ends.tolist(), strict=True):
            rank, k = divmod(key, windows)
            first = k * window
            perm = self.plan.window_permutation(self.epoch, k, min(first + window, per_rank) - first, rank=rank)
            rows = by_unit[lo:hi]
            out[rows] = first + perm[index[rows] - first]
        return out

    def unit_batches(self, start_step: int) -> list[int]:
        """The batches of each unit that :meth:`batches` plays from ``start_step`` on, in order."""
        left, unit, b = (self.per_rank - start_step * self.plan.batch_size, self.plan.unit, self.plan.batch_size)
        return [-(-min(unit, left - lo) // b) for lo in range(0, left, unit)]

    def units(self, files: ParquetFiles, make: BatchMaker, start_step: int, part: tuple[int, int] | None = None) -> Units:
        """This rank's rest of the epoch from ``start_step`` on, as units read with pyarrow; with
        ``part=(i, n)``, every ``n``-th unit from the ``i``-th on.

        Each unit holds its rows and at most ``plan.unit`` rows between them that are read and
        not used (other ranks' or consumed rows), traded for fewer, longer reads.
        """
        plan, b, unit = self.plan, self.plan.batch_size, self.plan.unit
        wanted = self.positions()[start_step * b :]
        order = plan.row_group_order(self.epoch)
        bounds = stream_bounds(plan.rg_rows, order)
        reader = RowGroupReader(files, plan.rg_file, plan.rg_index, plan.rg_rows, make.columns, make.read_threads)

        def read(k: int) -> tuple[Window, np.ndarray]:
            part = wanted[k * unit : (k + 1) * unit]
            starts, stops = covering_ranges(part, unit)
            share = [piece for lo, hi in zip(starts.tolist(), stops.tolist(), strict=True)
                     for piece in pieces(plan.rg_rows, order, lo, hi - lo, bounds)]
            window = read_window(reader, make.columns, share,
                                 WindowBuilder(make.columns, int((stops - starts).sum()), location(files, plan, share)),
                                 plan.rg_start if make.samples is not None else None)
            offsets = np.cumsum(stops - starts) - (stops - starts)
            j = np.searchsorted(starts, part, side="right") - 1
            return window, offsets[j] + part - starts[j]

        keys = range(-(-len(wanted) // unit))
        if part is not None:
            keys = keys[part[0] :: part[1]]
        epoch = self.epoch

        def play(windows: Iterator[tuple[Window, np.ndarray]]) -> Iterator[Callable[[], Batch]]:
            for data, rows in windows:
                for s in range(0, len(rows), b):
                    yield make.start(data, rows[s : s + b], epoch)
                del data, rows

        return Units(keys, read, play, reader)


@dataclass(frozen=True)
class Reading:
    """What plays an epoch's batches (the loader's source, in its reader thread): the files, the
    plan, the batch maker and the reader's settings, and nothing that refers back to the loader,
    so that dropping the loader stops its thread. ``resume``: the rest of a resharded epoch."""

    files: ParquetFiles
    plan: EpochPlan
    make: BatchMaker
    spares: Spares
    reader: str
    petastorm_workers: int
    read_ahead: bool
    resume: Resume | None = None

    def __call__(self, epoch: int, step: int, part: tuple[int, int] | None = None) -> Iterator[Batch]:
        """The batches of ``epoch`` from ``step`` on: the rest of a resharded epoch when ``resume``
        is that epoch's, else from the chosen reader as planned. ``part=(i, n)`` (``reader="arrow"``):
        only those of every ``n``-th unit from the ``i``-th on, counted by :meth:`unit_batches`."""
        if self.reader == "petastorm" and not (self.resume is not None and self.resume.epoch == epoch):
            return petastorm_batches(self.files, self.plan, self.make, self.petastorm_workers, epoch, step)
        return units_batches(self.units(epoch, step, part), self.make, read_ahead=self.read_ahead)

    def units(self, epoch: int, step: int, part: tuple[int, int] | None = None) -> Units:
        """``epoch``'s units from ``step`` on (``reader="arrow"``, or a resharded epoch)."""
        if self.resume is not None and self.resume.epoch == epoch:
            return self.resume.units(self.files, self.make, step, part)
        return arrow_units(self.files, self.plan, self.make, epoch, step, spares=self.spares, part=part)

    def epochs(self, epoch: int, step: int, part: tuple[int, int] | None = None) -> Generator[Batch | None, None, None]:
        """The batches of ``epoch`` from ``step`` on, then of every epoch after it from its
        start, None at the end of each: what the prefetch thread and the loader's workers play.
        With the Arrow reader and ``read_ahead``, the next epoch's first unit is read during this
        one's last (:func:`~sparkdl._internal.data.reading.read.epoch_after_epoch`)."""
        if self.reader != "petastorm":
            yield from epoch_after_epoch(lambda e, s: self.units(e, s, part), epoch, step, self.make, read_ahead=self.read_ahead)
            return
        while True:
            batches = self(epoch, step, part)
            try:
                yield from batches
            finally:
                close = getattr(batches, "close", None)
                if close is not None:
                    close()
            yield None
            epoch, step = epoch + 1, 0

    def unit_batches(self, epoch: int, step: int) -> list[int]:
        """The batches of each unit of ``epoch`` from ``step`` on (``reader="arrow"``), in order."""
        if self.resume is not None and self.resume.epoch == epoch:
            return self.resume.unit_batches(step)
        return unit_batches(self.plan, step)


def covering_ranges(positions: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted ranges ``[start, stop)`` that cover ``positions``: the gaps between them are
    bridged, smallest first, while the bridged rows add up to at most ``budget``."""
    q = np.unique(positions)
    gaps = q[1:] - q[:-1] - 1
    by_size = np.argsort(gaps, kind="stable")
    bridged = np.zeros(len(gaps), dtype=bool)
    bridged[by_size[np.cumsum(gaps[by_size]) <= budget]] = True
    cut = np.flatnonzero(~bridged)
    return q[np.concatenate([[0], cut + 1])], q[np.concatenate([cut, [len(q) - 1]])] + 1


def restore(state: object, mine: Mapping[str, Any], plan: EpochPlan) -> Position:
    """Where a loader with ``plan`` (and ``mine``, its own state) resumes from ``state``.

    Raises:
        ConfigError: the state is not a loader's, was taken with other settings or on another
            dataset layout, or resharding needs a reader that this loader does not use.
    """
    version = state.get("version") if isinstance(state, Mapping) else None
    if not isinstance(state, Mapping) or version not in (1, STATE_VERSION):
        raise ConfigError(
            "load_state_dict got something that is not a state from Loader.state_dict() of this "
            f"sparkdl version (version {version!r})"
        )
    same = state.get("world_size") == mine["world_size"]
    if bool(state.get("row_group_shards")) != bool(mine.get("row_group_shards")) or (mine.get("row_group_shards")
                                                                                    and not same):
        raise ConfigError(
            f"cannot resume: the saved state was taken on {state.get('world_size')!r} shards of "
            f"{'whole row groups' if state.get('row_group_shards') else 'equal rows'} and this loader reads "
            f"{mine['world_size']!r} of {'whole row groups' if mine.get('row_group_shards') else 'equal rows'} "
            "(Petastorm's shards, shard_by='row_groups', resume on as many shards as they were taken on); "
            "create the loader with the settings and the number of ranks of the run that saved the state"
        )
    keys = _SAME + (("world_size", "shuffle_window") if same else ())
    if not same and "requested_shuffle_window" in state:
        keys += ("requested_shuffle_window",)
    for key in keys:
        if state.get(key) != mine[key]:
            what = "dataset layout (files, row groups, columns)" if key == "dataset" else key
            raise ConfigError(
                f"cannot resume: the saved state has {what}={state.get(key)!r} and this loader "
                f"{mine[key]!r}; create the loader with the settings (and on the data) of the "
                "run that saved the state"
            )
    epoch, step, window, world = (_int(state.get(k)) for k in ("epoch", "step", "shuffle_window", "world_size"))
    if epoch is None or step is None or window is None or world is None or min(epoch, window - 1, world - 1) < 0:
        raise ConfigError(f"the saved state has epoch={state.get('epoch')!r}, step={state.get('step')!r}, "
                          f"world_size={state.get('world_size')!r}, shuffle_window={state.get('shuffle_window')!r}; "
                          "expected integers from Loader.state_dict()")
    levels = _levels(state.get("reshards") or [])
    _, rows = _streams(plan, levels)
    steps = -(-share_rows(rows, world, plan.batch_size, plan.drop_last) // plan.batch_size)
    if not 0 <= step <= steps:
        raise ConfigError(f"the saved state has epoch={epoch!r}, step={step!r}, out of range for {steps} steps")
    if step == steps:
        return Position(epoch + 1, 0)
    if not levels and (same or step == 0):
        return Position(epoch, step)
    if mine["reader"] != "arrow":
        raise ConfigError(
            f"resuming mid-epoch (epoch {epoch}, step {step} of {steps}) at another world size "
            f"({world} -> {mine['world_size']}) needs reader='arrow'; with reader={mine['reader']!r}, "
            "resume at the saved world size or from a checkpoint taken at an epoch's end"
        )
    resume = Resume(plan, epoch, levels if same else (*levels, Level(world, step, window)))
    if resume.per_rank == 0:  # drop_last, and less than a batch per rank left
        return Position(epoch + 1, 0)
    return Position(epoch, step if same else 0, resume)


def _streams(plan: EpochPlan, levels: Sequence[Level]) -> tuple[list[tuple[int, int]], int]:
    """For each level, the rows of the stream it shares and the rows of each of its ranks; and
    the rows of the resume stream the last one leaves."""
    b, rows, out = plan.batch_size, plan.num_rows, []
    for level in levels:
        per_rank = share_rows(rows, level.world_size, b, plan.drop_last)
        if not 0 <= level.step * b < per_rank:
            raise ConfigError(
                f"the saved state's reshards have step={level.step} at world_size={level.world_size}, "
                f"out of range for {-(-per_rank // b)} steps; it does not come from this dataset's loader"
            )
        out.append((rows, per_rank))
        rows = level.world_size * (per_rank - level.step * b)
    return out, rows


def _levels(saved: object) -> tuple[Level, ...]:
    fields = ("world_size", "step", "shuffle_window")
    levels = []
    for x in saved if isinstance(saved, list) else [None]:
        world, step, window = (_int(x.get(f)) if isinstance(x, Mapping) else None for f in fields)
        if world is None or step is None or window is None or min(world - 1, step, window - 1) < 0:
            raise ConfigError(f"the saved state has reshards={saved!r}; expected a list of {{{', '.join(fields)}}} dicts")
        levels.append(Level(world, step, window))
    return tuple(levels)


def _int(value: object) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
