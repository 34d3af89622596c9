"""The loader: one rank's shard of a :class:`~sparkdl.Dataset`, as batches of torch tensors.

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

Resume (:meth:`Loader.state_dict`, :meth:`Loader.load_state_dict`): at the saved world size, the
next iteration yields exactly the batches not yet yielded, in the uninterrupted run's order. At
another world size ``W``, an epoch's start or end is planned for ``W`` as usual; mid-epoch
(``reader="arrow"`` only), the rest of that epoch comes first: the rows the old ranks had not
consumed (each one's rest of its own order), concatenated in old-rank order, and new rank ``r``
takes the ``r``-th of ``W`` equal contiguous ranges of them, with the remainder policy above
(``drop_last=False``: fewer than ``W`` rows seen twice more; ``True``: fewer than
``W * batch_size`` dropped, and straight to the next epoch if no full batch is left). Exact: each
row of the interrupted epoch is seen once (but for those), and all ranks take equal steps.
Changed: the order of the rest differs from an uninterrupted run at either size; ``len(loader)``
is the rest's steps while in it. Its state records the world sizes, so resuming again, at any
size, stays exact (:mod:`sparkdl._internal.data.reading.reshard`). Later epochs are planned for ``W`` as usual.

Output: a ``dict`` from column name to

- a 1-D tensor for numeric columns (int8/16/32/64, float16/32/64, bool);
- a 2-D ``[batch, length]`` tensor for fixed-length numeric arrays (and ML vectors);
- for variable-length numeric arrays, a 2-D tensor padded with zeros to the longest row of the
  batch, plus ``"<name>_lengths"``, an int64 tensor of the true lengths (a null array is empty);
- a list of ``bytes`` for binary columns and of ``str`` for strings (``None`` for nulls), unless
  ``transform`` turns them into tensors;
- for a dataset Petastorm wrote, its ``Unischema``'s ndarray and image columns decoded as
  Petastorm's reader decodes them, stacked (:mod:`~sparkdl._internal.data.decoding.petastorm_codecs`).

Numeric columns must not hold nulls: the loader stops with :class:`~sparkdl.DatasetError` naming
the column.

Device: tensors come out on the CPU, pinned when the device is CUDA (the loop's own
``.to(device)`` then waits on the GPU for the step before it), or, with ``to_device=True``, on
the device, copied on a side CUDA stream while earlier steps compute (:mod:`~sparkdl._internal.data.reading.prefetch`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Generator, Iterator, Mapping
from typing import Any

from sparkdl._internal.common.errors import ConfigError, NotInRunError
from sparkdl._internal.common.validate import int_at_least
from sparkdl._internal.data.decoding.petastorm_codecs import with_codecs
from sparkdl._internal.data.decoding.samples import (
    ROW,
    SampleMap,
    default_workers,
)
from sparkdl._internal.data.loader_options import LoaderOptions
from sparkdl._internal.data.reading.files import ParquetFiles
from sparkdl._internal.data.reading.petastorm_reader import check_petastorm
from sparkdl._internal.data.reading.plan import EpochPlan
from sparkdl._internal.data.reading.prefetch import (
    DeviceCopy,
    Feed,
    Iteration,
    Pump,
    device_and_pin,
)
from sparkdl._internal.data.reading.read import LENGTHS_SUFFIX, Batch, BatchMaker
from sparkdl._internal.data.reading.reshard import STATE_VERSION, Reading, Resume, restore
from sparkdl._internal.data.reading.selection import place, select_columns
from sparkdl._internal.data.reading.spares import Spares
from sparkdl._internal.data.reading.workers import Workers


class Loader:
    """An iterable over one rank's batches of one epoch at a time; made by :meth:`Dataset.loader`.

    Iterating plays the current epoch from the current position. When an iteration runs to its
    end, the loader moves to the next epoch, position 0, so plain repeated ``for`` loops see
    epoch after epoch; with ``prefetch``, the background thread is then preparing that epoch's
    first batches already, so the next loop does not wait for its first window.
    ``set_epoch(e)`` moves to epoch ``e`` (position 0) unless the loader is already in epoch
    ``e``: then it keeps its position, so that a position restored with :meth:`load_state_dict`
    survives the usual ``set_epoch`` call at the top of an epoch loop.

    Shuffle: see the module docstring. The default ``shuffle_window`` is 4 times the rows of the
    largest row group, at most 128 MiB of uncompressed data, and at least one batch. A window is
    then rounded to a multiple of ``batch_size`` and evened out so that the rank's share is cut
    into windows of equal size (``loader.shuffle_window`` tells the result). Memory held is about
    two windows (the one being served and the one being read ahead; their arrays are reused for
    the next windows and epochs, and kept between epochs until :meth:`close`) plus one row group
    per decode thread (``read_threads``) and ``prefetch`` batches (on the device, with ``to_device``). Without shuffle, about two row
    groups' worth is held. With ``workers=N``, each worker process holds its own two windows
    (:mod:`~sparkdl._internal.data.reading.workers`: same batches, order and state as threads).

    Resume: :meth:`state_dict` records the epoch and the batches yielded in it, the same on every
    rank, so rank 0's state restores every rank, at this world size or another (module docstring).

    With ``reader="petastorm"``, batches come from Petastorm's ``make_batch_reader`` with
    ``cur_shard=rank, shard_count=world_size`` and are cut to ``batch_size``; the loader stops
    every rank after ``len(loader)`` batches (computed from the manifest as above), reading its
    shard again from its start if it runs short. That keeps the equal-steps guarantee and the
    output format, but not exact coverage: Petastorm shards by row groups, which may hold
    unequal rows. Resume skips the batches already yielded, which repeats the same batches only
    when Petastorm's own order is deterministic (``petastorm_workers=1``). A plain Parquet list
    column (its lengths not known up front) is read when each row group's rows have one length,
    learnt as batches arrive; a row group of unequal lengths raises
    :class:`~sparkdl.DatasetError` naming the column and the row group.

    ``options`` are those of :meth:`Dataset.loader`, as one checked object
    (:class:`~sparkdl._internal.data.loader_options.LoaderOptions`); ``dataset`` may be any
    :class:`~sparkdl._internal.data.reading.files.ParquetFiles`, of which ``Dataset`` is one. One more,
    for sparkdl's Petastorm converter: ``shard_by="row_groups"``, Petastorm's shards (row group
    ``g`` to rank ``g % world_size``) where they hold equal rows (:class:`EpochPlan`); such a
    state resumes at its own world size only.
    """

    def __init__(self, dataset: ParquetFiles, options: LoaderOptions) -> None:
        o = options
        fns = with_codecs(dataset.manifest, dict(o.decode or {}), o.columns, o.reader)
        if fns and o.reader != "arrow":
            raise ConfigError(
                f"decode={{{', '.join(map(repr, fns))}: ...}} needs reader='arrow' (each sample's randomness "
                "comes from its row in the dataset, which Petastorm's reader does not tell)"
            )
        rank, world_size = _resolve_rank(o.rank, o.world_size)
        selected = select_columns(dataset.manifest, o.columns, set(fns) - {ROW})
        batched = [getattr(f, "device", None) for f in fns.values() if getattr(f, "batched", False)]
        device = o.device if o.device is not None or not batched else batched[0]  # decoded on a device: for it
        target, pin = device_and_pin(device, o.pin_memory, o.to_device, _run_device)
        self._plan = EpochPlan(dataset.manifest, dataset.url, o.batch_size, shuffle=bool(o.shuffle), seed=o.seed,
                               drop_last=bool(o.drop_last), rank=rank, world_size=world_size,
                               shuffle_window=o.shuffle_window, shard_by=o.shard_by)
        if o.reader == "petastorm":
            check_petastorm(self._plan, selected, lengths_known=dataset.manifest.written_by_sparkdl)
        self._files = dataset
        self._spares = Spares()  # shuffle windows' arrays, reused from window to window and epoch to epoch
        self._reader = o.reader
        if o.workers and batched:
            raise ConfigError(f"workers={o.workers} with a decoder on a device ({batched[0]}): worker processes "
                              "cannot use the GPU; decode on the device with workers=0, or on the CPU in the workers")
        self._workers = o.workers
        # In worker processes, each decodes its own batches on its threads.
        self._samples = SampleMap(
            fns, seed=o.seed, worker_kind="threads" if o.workers else o.decode_in,
            workers=o.decode_workers or (max(1, default_workers() // o.workers) if o.workers else default_workers()),
            on_bad_sample=o.on_bad_sample, where=functools.partial(place, dataset.manifest),
        ) if fns else None
        threads = o.read_threads or min(4, max(1, default_workers() // 4))
        # What the reader thread needs, and nothing that refers back to this loader, so that
        # dropping the loader stops its thread.
        self._reading = Reading(dataset, self._plan, BatchMaker(selected, pin, o.transform, self._samples, threads),
                                self._spares, o.reader, o.petastorm_workers, read_ahead=o.prefetch > 0)
        self._resume: Resume | None = None  # the rest of a resharded epoch, while in it
        self._source = self._reading
        self._prefetch = o.prefetch
        self._copy = DeviceCopy(target) if o.to_device else None
        self._pin = pin
        self._epoch = o.epoch
        self._step = 0
        self._active: Iteration | None = None
        self._pump: Pump | Workers | None = None
        self._pump_at: tuple[int, int] | None = None  # its position, once a pass played an epoch to its end

    # -- what the plan gives ---------------------------------------------------------------------

    def __len__(self) -> int:
        """Batches of the current epoch (of its rest, in a resharded one); the same on every rank."""
        return self._resume.steps if self._resume is not None else self._plan.steps

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
        """This rank, 0 .. world_size - 1."""
        return self._plan.rank

    @property
    def world_size(self) -> int:
        """Ranks sharing the dataset."""
        return self._plan.world_size

    @property
    def batch_size(self) -> int:
        """Rows per batch (the last batch of an epoch may have fewer, with ``drop_last=False``)."""
        return self._plan.batch_size

    @property
    def rows_per_rank(self) -> int:
        """Rows each rank sees per epoch (repeats included, dropped rows excluded)."""
        return self._plan.per_rank

    @property
    def skipped(self) -> int:
        """Bad samples left out of the batches taken so far (``on_bad_sample="skip"``), all epochs
        together; not those of batches prepared ahead and not yet taken."""
        return self._samples.skipped.count if self._samples is not None else 0

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
        int_at_least("epoch", epoch, 0)
        if epoch != self._epoch:
            self._close_active()
            self._stop_pump()
            self._epoch, self._step = epoch, 0
            self._set_resume(None)

    # -- resume ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position: plain values, picklable and JSON-able; the same on every rank. ``reshards``
        lists the earlier world sizes (and steps) of an epoch resumed at another one, else ``[]``."""
        p = self._plan
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "step": self._step,
            "steps_per_epoch": len(self),
            "batch_size": p.batch_size,
            "world_size": p.world_size,
            "drop_last": p.drop_last,
            "shuffle": p.shuffle,
            "seed": p.seed,
            "shuffle_window": p.window,
            "requested_shuffle_window": p.requested_window,
            "reader": self._reader,
            "dataset": self._files.manifest.fingerprint(),
            "reshards": self._resume.state() if self._resume is not None else [],
            **({"row_group_shards": True} if p.row_group_shards else {}),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a position from :meth:`state_dict`; the next iteration resumes there.

        The state may come from another world size (see the module docstring).

        Raises:
            ConfigError: the state was taken with other settings (batch size, shuffle, seed,
                window, reader) or on another dataset layout, or mid-epoch at another world
                size with ``reader="petastorm"``.
        """
        at = restore(state, self.state_dict(), self._plan)
        self._close_active()
        self._stop_pump()
        self._epoch, self._step = at.epoch, at.step
        self._set_resume(at.resume)

    def _set_resume(self, resume: Resume | None) -> None:
        self._resume, self._source = resume, dataclasses.replace(self._reading, resume=resume)

    # -- iteration -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the background reader (after ``break``, or after the last epoch, which leaves it
        preparing the next epoch until the loader is dropped or iterated again). The position is
        kept; iterating again resumes from it. The memory kept for shuffle windows is let go too."""
        self._close_active()
        self._stop_pump()
        self._spares.clear()
        if self._samples is not None:
            self._samples.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Batch]:
        self._close_active()
        if self._samples is not None:
            self._samples.ready()
        at = (self._epoch, self._step)
        # After a pass that ran to its end, its pump is under way with this epoch already.
        if (self._prefetch or self._workers) and (self._pump is None or self._pump_at != at):
            self._stop_pump()
            self._pump = (self._start_workers(at) if self._workers
                          else Pump(self._source, *at, self._prefetch, self._copy, self._samples))
        self._pump_at = None
        source: Feed | Iterator[Batch] = (self._pump if self._pump is not None
                                          else _counted(self._source(*at), self._samples))
        self._active = Iteration(source, on_batch=self._consumed, on_end=self._finished, copy=self._copy)
        return self._active

    def _start_workers(self, at: tuple[int, int]) -> Workers:
        # Each worker reads its next unit while it serves one, as the thread path does; pinning
        # and the device copy stay in this process (a forked child must not touch CUDA).
        source = dataclasses.replace(self._source, read_ahead=self._prefetch > 0,
                                     make=dataclasses.replace(self._source.make, pin=False))
        return Workers(source, *at, workers=self._workers, prefetch=max(1, self._prefetch), pin=self._pin,
                       copy=self._copy, samples=self._samples)

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of the loader's worker processes while they run (``workers=N``), else ``[]``."""
        return self._pump.pids if isinstance(self._pump, Workers) else []

    def _stop_pump(self) -> None:
        if self._pump is not None:
            self._pump.close()
            self._pump, self._pump_at = None, None

    def _close_active(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None

    def _consumed(self, it: Iteration) -> None:
        if self._active is it:
            self._step += 1

    def _finished(self, it: Iteration) -> None:
        if self._active is it:
            self._epoch += 1
            self._step = 0
            self._active = None
            self._pump_at = (self._epoch, 0)
            self._set_resume(None)  # the pump, under way with the next epoch, reads it as planned


def _counted(batches: Iterator[Batch], samples: SampleMap | None) -> Iterator[Batch]:
    """``batches`` made as the loop takes them (no prefetch): the bad samples met making each
    count in ``loader.skipped`` at once."""
    if samples is None:
        return batches
    return _counting(batches, samples)


def _counting(batches: Iterator[Batch], samples: SampleMap) -> Generator[Batch, None, None]:
    mark = samples.found.mark()
    try:
        for batch in batches:
            met, mark = samples.found.since(mark)
            if met[0]:
                samples.skipped.merge(*met)
            yield batch
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The given rank and world size (LoaderOptions checked them), else the run's, else torch.distributed's, else 0 of 1."""
    if rank is None or world_size is None:
        from sparkdl._internal.rank.context import context

        try:
            ctx = context()
            return ctx.rank, ctx.world_size
        except NotInRunError:
            pass
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    return int(rank), int(world_size)


def _run_device() -> Any:
    from sparkdl._internal.rank.context import context

    try:
        return context().device
    except NotInRunError:
        return "cpu"


__all__ = ["LENGTHS_SUFFIX", "Batch", "Loader"]
