"""The epoch plan: from the manifest alone, which rows of which row groups each rank reads.

Nothing here reads data, so every rank computes the same plan before it reads a byte; the
policy (stream order, equal contiguous shares, shuffle windows, ``drop_last``) is described in
:mod:`sparkdl._internal.data.loader`.
"""

from __future__ import annotations

import numpy as np

from sparkdl._internal.common.errors import ConfigError, DatasetError
from sparkdl._internal.data.format.manifest import Manifest
from sparkdl._internal.fs.storage import redact

# Default shuffle window: this many row groups' worth of rows, but no more than this many bytes.
_WINDOW_ROW_GROUPS = 4
_WINDOW_MAX_BYTES = 128 * 1024 * 1024


class EpochPlan:
    """One rank's share of every epoch: its rows, its steps, its shuffle window and its pieces.

    Row group ``g`` is the ``g``-th of the whole dataset, in file order: ``rg_file[g]`` is its
    file, ``rg_index[g]`` its index in that file and ``rg_rows[g]`` its rows.

    ``shard_by="row_groups"`` asks for Petastorm's shards: rank ``r`` reads the row groups ``g``
    with ``g % world_size == r``, the same ones every epoch (shuffled among themselves). It is
    taken where those shards hold the same number of rows and ``drop_last`` is off, so that the
    ranks still take equal steps without repeating a row: the stream then lays each rank's row
    groups side by side, and its equal contiguous share is exactly them
    (``row_group_shards``). Elsewhere the shares are the stream's, as with ``"rows"``.

    Raises:
        DatasetError: the dataset has no rows.
        ConfigError: ``drop_last`` leaves no batch.
    """

    def __init__(
        self,
        manifest: Manifest,
        url: str,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        rank: int,
        world_size: int,
        shuffle_window: int | None,
        shard_by: str = "rows",
    ) -> None:
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.drop_last, self.rank, self.world_size = drop_last, rank, world_size
        self.rg_file = np.array([i for i, f in enumerate(manifest.files) for _ in f.row_groups], dtype=np.int64)
        self.rg_index = np.array([j for f in manifest.files for j in range(len(f.row_groups))], dtype=np.int64)
        self.rg_rows = np.array([n for f in manifest.files for n in f.row_groups], dtype=np.int64)
        self.rg_start = np.cumsum(self.rg_rows) - self.rg_rows  # each row group's first row in the dataset
        total = int(self.rg_rows.sum())
        if total == 0:
            raise DatasetError(f"{redact(url)} has no rows; write some data into it first")
        self.num_rows = total
        b = batch_size
        self.per_rank = share_rows(total, world_size, b, drop_last)
        if self.per_rank == 0:
            raise ConfigError(
                f"drop_last=True leaves no batch: the dataset has {total} rows, fewer than "
                f"world_size * batch_size = {world_size} * {b}. Use a smaller batch_size or "
                "drop_last=False"
            )
        self.steps = _ceil_div(self.per_rank, b)
        self.row_group_shards = shard_by == "row_groups" and world_size > 1 and not drop_last and all(
            int(self.rg_rows[r::world_size].sum()) == self.per_rank for r in range(world_size))
        self.requested_window = shuffle_window
        self.window = self._window_rows(shuffle_window, manifest.uncompressed_bytes)
        # Rows read and held at a time. Without shuffle nothing is mixed, so one row group's worth
        # (in whole batches) is enough, and memory stays near that of a plain row-group reader.
        self.unit = self.window if shuffle else min(self.window, _ceil_div(int(self.rg_rows.max()), b) * b)

    def _window_rows(self, requested: int | None, uncompressed_bytes: int) -> int:
        b, share = self.batch_size, self.per_rank
        if requested is None:
            # The largest row group, so that a window spans several groups however uneven they are.
            largest = int(self.rg_rows.max())
            bytes_per_row = max(1.0, uncompressed_bytes / self.num_rows)
            requested = min(_WINDOW_ROW_GROUPS * largest, int(_WINDOW_MAX_BYTES / bytes_per_row))
        window = _ceil_div(max(requested, b), b) * b
        # Even out the windows of the share, so that the last one is not a small tail (which would
        # mix few row groups); each stays a multiple of the batch size.
        count = _ceil_div(share, window)
        return _ceil_div(_ceil_div(share, count), b) * b

    def row_group_order(self, epoch: int) -> np.ndarray:
        """The order of the row groups in ``epoch``'s stream: file order, or seeded by ``(seed,
        epoch)``; with ``row_group_shards``, rank 0's row groups, then rank 1's, and so on, each
        rank's in file order or seeded by ``(seed, epoch, rank)``."""
        n = len(self.rg_rows)
        if self.row_group_shards:
            shards = [np.arange(r, n, self.world_size) for r in range(self.world_size)]
            if self.shuffle:
                shards = [np.random.default_rng([self.seed, epoch, 0, r]).permutation(g) for r, g in enumerate(shards)]
            return np.concatenate(shards)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch, 0]).permutation(n)

    def window_permutation(self, epoch: int, window: int, n: int, rank: int | None = None) -> np.ndarray:
        """The order of the ``n`` rows of the ``window``-th window of ``rank`` (this rank when
        None) in ``epoch``; a resume at another world size rebuilds the old ranks' orders with it."""
        owner = self.rank if rank is None else rank
        return np.random.default_rng([self.seed, epoch, 1, owner, window]).permutation(n)

    def pieces_of_share(self, epoch: int) -> list[tuple[int, int, int, int]]:
        """This rank's share of ``epoch`` as ``(file index, row group in file, start, stop)`` pieces."""
        share = pieces(self.rg_rows, self.row_group_order(epoch), self.rank * self.per_rank, self.per_rank)
        return [(int(self.rg_file[g]), int(self.rg_index[g]), a, z) for g, a, z in share]


def share_rows(total: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    """Rows per rank when ``world_size`` ranks share a stream of ``total`` rows: ``ceil(total / W)``
    (the stream wraps for the missing ones), or, with ``drop_last``, whole batches only (maybe 0)."""
    if drop_last:
        return (total // (world_size * batch_size)) * batch_size
    return _ceil_div(total, world_size)


def stream_bounds(rows: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Where each row group of ``order`` starts in the stream, and (last) the stream's length."""
    return np.concatenate([[0], np.cumsum(rows[order])])


def pieces(rows: np.ndarray, order: np.ndarray, start: int, count: int,
           bounds: np.ndarray | None = None) -> list[tuple[int, int, int]]:
    """``(row group, start, stop)`` pieces covering stream positions ``[start, start + count)``.

    The stream is the row groups in ``order``, concatenated; positions past its end wrap to its
    start (the ``drop_last=False`` padding). ``bounds``: :func:`stream_bounds` of ``rows`` and
    ``order``, for a caller that asks for many ranges of one stream.
    """
    if bounds is None:
        bounds = stream_bounds(rows, order)
    total = int(bounds[-1])
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
