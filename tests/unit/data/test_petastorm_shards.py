"""Petastorm's shards in sparkdl's loader (``shard_by="row_groups"``, what sparkdl's Petastorm
converter asks for): rank ``r`` of ``W`` reads the row groups ``g`` with ``g % W == r``, the same
rows every epoch, where those shards hold equal rows; elsewhere the equal shares of the stream.
Real Parquet files, explicit ranks, no Spark; on the classic stack, Petastorm's own reader reads
the same files for the baseline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkdl import ConfigError, Dataset
from sparkdl._internal.data.loader import Loader
from sparkdl._internal.data.loader_options import LoaderOptions

B = 10
EVEN = [(200, 50), (200, 50), (200, 50)]  # 12 row groups of 50 rows: even shards at 2, 3, 4 and 6 ranks
UNEVEN = [(200, 50), (130, 50)]  # row groups of 50, 50, 50, 50, 50, 50, 30


def _dataset(root: Path, layout: list[tuple[int, int]]) -> Dataset:
    root.mkdir()
    start = 0
    for i, (rows, group) in enumerate(layout):
        ids = np.arange(start, start + rows, dtype=np.int64)
        pq.write_table(pa.table({"id": ids, "x": ids.astype(np.float32) / 7}), root / f"part-{i:05d}.parquet",
                       row_group_size=group)
        start += rows
    return Dataset(root)


@pytest.fixture(scope="module")
def even(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    return _dataset(tmp_path_factory.mktemp("shards") / "even", EVEN)


@pytest.fixture(scope="module")
def uneven(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    return _dataset(tmp_path_factory.mktemp("shards") / "uneven", UNEVEN)


def _groups(ds: Dataset) -> list[np.ndarray]:
    """The ids of each row group of the dataset, in file order, read with pyarrow alone."""
    out = []
    for path in sorted(Path(ds.url.removeprefix("file://")).glob("part-*.parquet")):
        f = pq.ParquetFile(path)
        out += [f.read_row_group(i, columns=["id"]).column("id").to_numpy() for i in range(f.num_row_groups)]
    return out


def _loader(ds: Dataset, rank: int, world: int, **kw: Any) -> Loader:
    return Loader(ds, LoaderOptions(B, rank=rank, world_size=world, shard_by="row_groups", prefetch=0, **kw))


def _epoch(loader: Loader, epoch: int) -> np.ndarray:
    loader.set_epoch(epoch)
    return np.concatenate([b["id"].numpy() for b in loader])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_rank_reads_its_row_groups_by_index_the_same_rows_every_epoch(even: Dataset, world: int) -> None:
    groups = _groups(even)
    for rank in range(world):
        expected = np.sort(np.concatenate(groups[rank::world]))
        with _loader(even, rank, world, seed=3) as loader:
            assert loader._plan.row_group_shards and len(loader) == len(expected) // B
            epochs = [_epoch(loader, e) for e in range(3)]
        for ids in epochs:
            assert np.array_equal(np.sort(ids), expected)  # each row of the shard once
        # Shuffled within the shard: another order each epoch, the same in every run.
        assert not np.array_equal(epochs[0], epochs[1])
        with _loader(even, rank, world, seed=3) as again:
            assert np.array_equal(_epoch(again, 1), epochs[1])


def test_without_shuffle_a_shard_is_its_row_groups_in_file_order(even: Dataset) -> None:
    groups = _groups(even)
    with _loader(even, 1, 3, shuffle=False) as loader:
        assert np.array_equal(_epoch(loader, 0), np.concatenate(groups[1::3]))


def test_uneven_shards_fall_back_to_equal_shares_of_the_stream(uneven: Dataset) -> None:
    # Petastorm's shards would hold 180 and 150 rows: the ranks would take unequal steps. The
    # equal shares of the stream keep the steps equal and every row read once.
    seen = []
    for rank in range(2):
        with _loader(uneven, rank, 2, shuffle=False) as loader:
            assert not loader._plan.row_group_shards and len(loader) == 17  # 165 rows each
            seen.append(_epoch(loader, 0))
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(330))


def test_drop_last_or_one_rank_keep_the_stream(even: Dataset) -> None:
    with _loader(even, 0, 2, drop_last=True) as loader:
        assert not loader._plan.row_group_shards
    with _loader(even, 0, 1) as loader:
        assert not loader._plan.row_group_shards


def test_a_mid_epoch_resume_continues_the_shard_and_another_world_size_is_refused(even: Dataset) -> None:
    with _loader(even, 1, 2, seed=5) as loader:
        whole = _epoch(loader, 0)
    with _loader(even, 1, 2, seed=5) as loader:
        taken = []
        for batch in loader:
            taken.append(batch["id"].numpy().copy())
            if len(taken) == 7:
                break
        state = json.loads(json.dumps(loader.state_dict()))
    with _loader(even, 1, 2, seed=5) as resumed:
        resumed.load_state_dict(state)
        rest = np.concatenate([b["id"].numpy() for b in resumed])
    assert np.array_equal(np.concatenate([*taken, rest]), whole)
    with _loader(even, 0, 3, seed=5) as other, pytest.raises(ConfigError, match="shards of whole row groups"):
        other.load_state_dict(state)
    with even.loader(B, rank=0, world_size=2, seed=5, prefetch=0) as plain, \
            pytest.raises(ConfigError, match="whole row groups"):
        plain.load_state_dict(state)


def test_an_unknown_shard_by_is_refused(even: Dataset) -> None:
    with pytest.raises(ConfigError, match=r"shard_by must be one of 'rows' .*'row_groups' .*; got 'files'"):
        LoaderOptions(B, shard_by="files")


@pytest.mark.parametrize("world", [2, 3])
def test_the_same_rows_per_shard_as_petastorms_reader(even: Dataset, world: int) -> None:
    petastorm = pytest.importorskip("petastorm")
    for rank in range(world):
        with petastorm.make_batch_reader(even.url, cur_shard=rank, shard_count=world, num_epochs=1,
                                         workers_count=1, shuffle_row_groups=True) as reader:
            theirs = np.sort(np.concatenate([batch.id for batch in reader]))
        with _loader(even, rank, world) as loader:
            ours = np.sort(_epoch(loader, 0))
        assert np.array_equal(ours, theirs), (rank, world)
