"""The loader, without a JVM: Parquet written with pyarrow, deliberately uneven files and row groups."""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import sparkdl
from sparkdl import ConfigError, Dataset, DatasetError
from sparkdl._internal.data.format.manifest import MANIFEST_NAME
from sparkdl._internal.data.loader import Loader
from sparkdl._internal.data.reading.petastorm_reader import _from_petastorm, _rebatch
from sparkdl._internal.data.reading.plan import pieces as _pieces

# (rows, rows per row group) of each file: uneven on purpose, with one empty file.
LAYOUT = [(1000, 300), (37, 10), (1, 1), (0, 1), (2500, 700), (3, 2)]
N = sum(rows for rows, _ in LAYOUT)  # 3541


def _table(ids: np.ndarray) -> pa.Table:
    n = len(ids)
    var_lengths = np.where(ids % 7 == 6, 0, ids % 5)  # null arrays (below) hold no values
    var_offsets = np.concatenate([[0], np.cumsum(var_lengths)]).astype(np.int32)
    var_values = np.concatenate([np.arange(k, dtype=np.int32) for k in var_lengths]) if n else np.zeros(0, np.int32)
    var_mask = pa.array(ids % 7 == 6)  # some null arrays: they come out empty
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "f32": pa.array(ids.astype(np.float32) / 2),
            "i8": pa.array((ids % 100).astype(np.int8)),
            "flag": pa.array(ids % 2 == 0),
            "fixed": pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 3).astype(np.float32)), 3),
            "pair": pa.ListArray.from_arrays(
                pa.array(np.arange(0, 2 * n + 1, 2, dtype=np.int32)), pa.array(np.repeat(ids, 2).astype(np.float64))
            ),
            "var": pa.ListArray.from_arrays(pa.array(var_offsets), pa.array(var_values), mask=var_mask),
            "bin": pa.array([int(i).to_bytes(4, "little") for i in ids], pa.binary()),
            "text": pa.array([f"row-{i}" for i in ids], pa.string()),
        }
    )


def _write_layout(root: Path, layout: list[tuple[int, int]]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    start = 0
    for i, (rows, group) in enumerate(layout):
        ids = np.arange(start, start + rows, dtype=np.int64)
        pq.write_table(_table(ids), root / f"part-{i:03d}.parquet", row_group_size=group)
        start += rows
    # Metadata files that Spark and Petastorm leave; the loader must skip them.
    (root / "_SUCCESS").write_bytes(b"")
    (root / ".part-000.parquet.crc").write_bytes(b"junk")
    return root


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_layout(tmp_path_factory.mktemp("feed") / "data", LAYOUT)


@pytest.fixture(scope="module")
def ds(data_dir: Path) -> Dataset:
    return Dataset(data_dir)


def _row_group_of(ds: Dataset) -> np.ndarray:
    """Global row-group index of every id (ids were assigned in file, then row-group order)."""
    sizes = [n for f in ds.manifest.files for n in f.row_groups]
    return np.repeat(np.arange(len(sizes)), sizes)


def _epoch_ids(loader: Loader) -> list[np.ndarray]:
    return [b["id"].numpy().copy() for b in loader]


def test_manifest_from_footers_skips_metadata_and_empty_files(ds: Dataset) -> None:
    assert ds.num_rows == N == len(ds)
    assert [f.path for f in ds.manifest.files] == [
        "part-000.parquet", "part-001.parquet", "part-002.parquet", "part-004.parquet", "part-005.parquet"
    ]
    assert ds.manifest.files[0].row_groups == (300, 300, 300, 100)
    assert ds.manifest.files[3].row_groups == (700, 700, 700, 400)
    assert ds.schema == {
        "id": "int64",
        "f32": "float32",
        "i8": "int8",
        "flag": "bool",
        "fixed": "array<float32>[3]",
        "pair": "array<float64>[variable]",
        "var": "array<int32>[variable]",
        "bin": "binary",
        "text": "string",
    }
    assert not ds.manifest.written_by_sparkdl


def test_handle_is_small_and_picklable(ds: Dataset) -> None:
    blob = pickle.dumps(ds)
    assert len(blob) < 4096
    back = pickle.loads(blob)
    assert back.url == ds.url and back.manifest == ds.manifest
    assert back.url.startswith("file:///")
    assert [len(b["id"]) for b in back.loader(1000, shuffle=False, columns=["id"])] == [1000, 1000, 1000, 541]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_equal_steps_and_coverage(ds: Dataset, world_size: int, drop_last: bool) -> None:
    for batch_size in (1, 7, 64, 500):
        for shuffle in (False, True):
            per_rank_ids = []
            sizes = []
            for rank in range(world_size):
                loader = ds.loader(
                    batch_size, rank=rank, world_size=world_size, drop_last=drop_last, shuffle=shuffle,
                    seed=11, columns=["id"],
                )
                batches = _epoch_ids(loader)
                assert len(batches) == len(loader), (rank, batch_size)
                sizes.append([len(b) for b in batches])
                per_rank_ids.append(np.concatenate(batches))
            # Same number of steps and the same batch sizes on every rank, by construction.
            assert all(s == sizes[0] for s in sizes), (batch_size, shuffle)
            every = np.concatenate(per_rank_ids)
            if drop_last:
                steps = N // (world_size * batch_size)
                assert sizes[0] == [batch_size] * steps
                assert len(every) == world_size * batch_size * steps
                assert len(np.unique(every)) == len(every)  # nothing twice
            else:
                per_rank = -(-N // world_size)
                assert sum(sizes[0]) == per_rank
                assert all(s == batch_size for s in sizes[0][:-1])
                assert set(every.tolist()) == set(range(N))  # every row
                assert len(every) - N == world_size * per_rank - N < world_size  # a few repeats only


def test_len_is_known_from_the_manifest_alone(tmp_path: Path) -> None:
    root = _write_layout(tmp_path / "d", [(10, 3), (95, 20)])
    ds = Dataset(root)
    for f in root.glob("*.parquet"):
        f.unlink()  # no data left to read: len() must not need any
    assert len(ds.loader(10, rank=0, world_size=3, drop_last=False)) == 4  # ceil(35 / 10)
    assert len(ds.loader(10, rank=2, world_size=3, drop_last=True)) == 3  # 105 // 30
    assert ds.loader(10, rank=0, world_size=3).rows_per_rank == 35
    with pytest.raises(DatasetError, match="cannot open"):
        next(iter(ds.loader(10, rank=0, world_size=3)))


def test_no_shuffle_is_file_order_split_into_contiguous_ranges(ds: Dataset) -> None:
    got = [np.concatenate(_epoch_ids(ds.loader(100, rank=r, world_size=2, shuffle=False, columns=["id"]))) for r in range(2)]
    half = -(-N // 2)
    assert got[0].tolist() == list(range(half))
    # the padding wraps to the start of the stream
    assert got[1].tolist() == list(range(half, N)) + list(range(2 * half - N))


def test_shuffle_is_deterministic_and_differs_between_epochs_and_seeds(ds: Dataset) -> None:
    def run(seed: int, epoch: int, prefetch: int = 4) -> list[list[int]]:
        loader = ds.loader(64, seed=seed, epoch=epoch, rank=1, world_size=2, columns=["id"], prefetch=prefetch)
        return [b.tolist() for b in _epoch_ids(loader)]

    assert run(3, 0) == run(3, 0) == run(3, 0, prefetch=0)
    assert run(3, 0) != run(3, 1)
    assert run(3, 0) != run(4, 0)
    # Which rows a rank gets changes between epochs too, not only their order.
    assert {i for b in run(3, 0) for i in b} != {i for b in run(3, 1) for i in b}


def test_shuffle_mixes_rows_across_row_groups(ds: Dataset) -> None:
    group_of = _row_group_of(ds)
    loader = ds.loader(64, seed=5, rank=0, world_size=1, columns=["id"], drop_last=True)
    batches = _epoch_ids(loader)
    groups_per_batch = [len(np.unique(group_of[b])) for b in batches]
    # A window spans several row groups and its rows are permuted: nearly every batch mixes groups.
    assert np.mean([g > 1 for g in groups_per_batch]) > 0.9
    assert np.mean(groups_per_batch) >= 3
    # ...and rows within a batch are not runs of consecutive ids.
    first = np.sort(batches[0])
    assert np.mean(np.diff(first) == 1) < 0.5
    assert loader.shuffle_window % 64 == 0 and loader.shuffle_window >= 4 * 300


def test_shuffle_window_bounds_the_mixing(ds: Dataset) -> None:
    loader = ds.loader(10, seed=1, rank=0, world_size=1, columns=["id"], shuffle_window=10)
    assert loader.shuffle_window == 10
    plan = loader.plan(0)  # the stream order of the pieces
    stream = np.concatenate([np.arange(a, z) + _first_id(ds, f, g) for f, g, a, z in plan])
    got = np.concatenate(_epoch_ids(loader))
    # with a one-batch window each batch is a permutation of the next 10 rows of the stream
    for i in range(0, N - 10, 10):
        assert sorted(got[i : i + 10].tolist()) == sorted(stream[i : i + 10].tolist())


def _first_id(ds: Dataset, file_index: int, group: int) -> int:
    before = sum(f.num_rows for f in ds.manifest.files[:file_index])
    return before + sum(ds.manifest.files[file_index].row_groups[:group])


@pytest.mark.parametrize("prefetch", [0, 3])
def test_resume_mid_epoch_gives_exactly_the_unconsumed_batches(ds: Dataset, prefetch: int) -> None:
    kwargs: dict[str, Any] = dict(rank=1, world_size=3, seed=9, drop_last=False, columns=["id", "fixed"], prefetch=prefetch,
                  shuffle_window=256)
    reference = [b.tolist() for b in _epoch_ids(ds.loader(50, epoch=2, **kwargs))]
    next_epoch = [b.tolist() for b in _epoch_ids(ds.loader(50, epoch=3, **kwargs))]
    total = len(reference)
    for consumed in (0, 1, 5, 10, total - 1, total):  # 5 and 10: either side of a window boundary
        loader = ds.loader(50, epoch=2, **kwargs)
        it = iter(loader)
        for _ in range(consumed):
            next(it)
        state = pickle.loads(pickle.dumps(loader.state_dict()))  # as saved in a checkpoint
        del it, loader
        fresh = pickle.loads(pickle.dumps(ds)).loader(50, **kwargs)  # as after a restart
        fresh.load_state_dict(state)
        fresh.set_epoch(2 if consumed < total else 3)  # the usual top-of-epoch call keeps the position
        rest = [b.tolist() for b in _epoch_ids(fresh)]
        if consumed < total:
            assert rest == reference[consumed:], consumed
            assert fresh.epoch == 3 and fresh.step == 0
            assert [b.tolist() for b in _epoch_ids(fresh)] == next_epoch
        else:
            assert rest == next_epoch


def test_state_tracks_consumed_batches_not_prefetched_ones(ds: Dataset) -> None:
    loader = ds.loader(100, rank=0, world_size=1, columns=["id"], prefetch=8)
    it = iter(loader)
    next(it)
    next(it)
    time.sleep(0.2)  # the reader thread has run ahead by now
    assert loader.state_dict()["step"] == 2 and loader.epoch == 0
    for _ in it:
        pass
    assert loader.epoch == 1 and loader.step == 0


def test_resume_refuses_other_settings(ds: Dataset) -> None:
    state = ds.loader(32, rank=0, world_size=2, seed=1).state_dict()
    with pytest.raises(ConfigError, match="batch_size=32"):
        ds.loader(64, rank=0, world_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="seed"):
        ds.loader(32, rank=0, world_size=2, seed=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="state_dict"):
        ds.loader(32, rank=0, world_size=2, seed=1).load_state_dict({"epoch": 0})
    # The state is the same on every rank: rank 0's restores rank 1.
    ds.loader(32, rank=1, world_size=2, seed=1).load_state_dict(state)


def test_repeated_iteration_walks_the_epochs(ds: Dataset) -> None:
    loader = ds.loader(256, seed=2, rank=0, world_size=1, columns=["id"])
    first, second = _epoch_ids(loader), _epoch_ids(loader)
    assert [b.tolist() for b in second] == [b.tolist() for b in _epoch_ids(ds.loader(256, seed=2, epoch=1, rank=0, world_size=1, columns=["id"]))]
    assert [b.tolist() for b in first] != [b.tolist() for b in second]
    loader.set_epoch(0)
    assert [b.tolist() for b in _epoch_ids(loader)] == [b.tolist() for b in first]


def test_every_column_type(ds: Dataset) -> None:
    batch = next(iter(ds.loader(16, shuffle=True, seed=4, rank=0, world_size=1)))
    ids = batch["id"].numpy()
    assert batch["id"].dtype == torch.int64 and batch["id"].shape == (16,)
    assert batch["f32"].dtype == torch.float32 and np.array_equal(batch["f32"].numpy(), ids.astype(np.float32) / 2)
    assert batch["i8"].dtype == torch.int8 and np.array_equal(batch["i8"].numpy(), ids % 100)
    assert batch["flag"].dtype == torch.bool and np.array_equal(batch["flag"].numpy(), ids % 2 == 0)
    assert batch["fixed"].shape == (16, 3) and batch["fixed"].dtype == torch.float32
    assert np.array_equal(batch["fixed"].numpy(), np.repeat(ids, 3).reshape(16, 3).astype(np.float32))
    # A list column without a manifest is variable-length: padded, with lengths.
    assert batch["pair"].shape == (16, 2) and batch["pair"].dtype == torch.float64
    assert batch["pair_lengths"].tolist() == [2] * 16
    lengths = np.where(ids % 7 == 6, 0, ids % 5)
    assert batch["var_lengths"].dtype == torch.int64 and batch["var_lengths"].tolist() == lengths.tolist()
    assert batch["var"].dtype == torch.int32 and batch["var"].shape == (16, lengths.max())
    for row, n in zip(batch["var"].numpy(), lengths, strict=True):
        assert row[:n].tolist() == list(range(n)) and not row[n:].any()
    assert batch["bin"] == [int(i).to_bytes(4, "little") for i in ids]
    assert batch["text"] == [f"row-{i}" for i in ids]
    # Tensors own writable memory: a training step may change them in place.
    batch["fixed"].add_(1)


def test_fixed_lengths_makes_list_columns_two_dimensional(data_dir: Path) -> None:
    ds = Dataset(data_dir, fixed_lengths={"pair": 2})
    assert ds.schema["pair"] == "array<float64>[2]"
    batch = next(iter(ds.loader(8, shuffle=False, rank=0, world_size=1, columns=["id", "pair"])))
    assert set(batch) == {"id", "pair"}
    assert np.array_equal(batch["pair"].numpy(), np.repeat(batch["id"].numpy(), 2).reshape(8, 2))
    wrong = Dataset(data_dir, fixed_lengths={"pair": 3})
    with pytest.raises(DatasetError, match=r"'pair' has arrays of 2 to 2 elements.*recorded as length 3"):
        list(wrong.loader(64, rank=0, world_size=1, columns=["pair"]))
    with pytest.raises(ConfigError, match="not a numeric array"):
        Dataset(data_dir, fixed_lengths={"text": 4})


def test_transform_maps_binary_to_tensors(ds: Dataset) -> None:
    def decode(batch: dict) -> dict:
        raw = np.frombuffer(b"".join(batch.pop("bin")), dtype="<i4")
        return {**batch, "decoded": torch.from_numpy(raw.astype(np.int64))}

    for batch in ds.loader(100, rank=0, world_size=1, columns=["id", "bin"], transform=decode):
        assert torch.equal(batch["decoded"], batch["id"])
        assert "bin" not in batch


def test_nulls_in_numeric_columns_name_the_column(tmp_path: Path) -> None:
    pq.write_table(pa.table({"x": pa.array([1.0, None, 3.0]), "ok": pa.array([1, 2, 3])}), tmp_path / "a.parquet")
    ds = Dataset(tmp_path)
    with pytest.raises(DatasetError, match=r"column 'x' has null values.*fillna"):
        list(ds.loader(2, rank=0, world_size=1))
    # one rank never repeats rows: 3 rows in batches of 2 and 1
    assert [len(b["ok"]) for b in ds.loader(2, rank=0, world_size=1, columns=["ok"])] == [2, 1]


def test_unsupported_columns_are_named_and_can_be_left_out(tmp_path: Path) -> None:
    table = pa.table({"when": pa.array([1, 2], pa.timestamp("us")), "y": pa.array([1, 2])})
    pq.write_table(table, tmp_path / "a.parquet")
    ds = Dataset(tmp_path)
    with pytest.raises(ConfigError, match=r"'when' \(timestamp\[us\]\).*columns=\['y'\]"):
        ds.loader(2, rank=0, world_size=1)
    assert next(iter(ds.loader(2, rank=0, world_size=1, columns=["y"])))["y"].tolist() in ([1, 2], [2, 1])


def test_prefetch_is_bounded_and_stops_with_the_iteration(ds: Dataset) -> None:
    made = []

    def count(batch: dict) -> dict:
        made.append(1)
        return batch

    loader = ds.loader(10, rank=0, world_size=1, columns=["id"], prefetch=3, transform=count)
    it = iter(loader)
    next(it)
    time.sleep(0.5)
    # one handed out, three queued, at most one more finished and waiting to be queued
    assert 4 <= len(made) <= 5
    del it
    loader.set_epoch(5)  # closes the active iteration
    deadline = time.monotonic() + 5
    while any(t.name == "sparkdl-prefetch" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "sparkdl-prefetch" for t in threading.enumerate())


def test_breaking_out_of_a_loop_leaves_no_thread(ds: Dataset) -> None:
    for _ in range(3):
        for _batch in ds.loader(10, rank=0, world_size=1, columns=["id"]):
            break
    deadline = time.monotonic() + 5
    while any(t.name.startswith("sparkdl-") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name.startswith("sparkdl-") for t in threading.enumerate())


def test_close_stops_the_reader_and_keeps_the_position(ds: Dataset) -> None:
    with ds.loader(10, rank=0, world_size=1, columns=["id"], shuffle=False) as loader:
        it = iter(loader)
        assert [next(it)["id"].tolist()[0] for _ in range(3)] == [0, 10, 20]
    assert not any(t.name == "sparkdl-prefetch" and t.is_alive() for t in threading.enumerate())
    assert next(it, None) is None  # a closed iteration is over
    assert loader.step == 3
    assert next(iter(loader))["id"].tolist() == list(range(30, 40))
    loader.close()


def test_reader_errors_reach_the_training_thread(tmp_path: Path) -> None:
    root = _write_layout(tmp_path / "d", [(50, 10), (50, 10)])
    ds = Dataset(root)
    (root / "part-001.parquet").write_bytes(b"not parquet any more")
    with pytest.raises(DatasetError, match="part-001"):
        list(ds.loader(10, shuffle=False, rank=0, world_size=1, columns=["id"]))


def test_rank_and_world_size_come_from_the_run_context(ds: Dataset, monkeypatch: pytest.MonkeyPatch) -> None:
    # What the launcher sets in every rank process (see sparkdl/context.py).
    for key, value in {
        "RUN_ID": "t", "RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "ATTEMPT": "0", "HOST": "127.0.0.1", "BACKEND": "torch", "USE_CUDA": "0",
    }.items():
        monkeypatch.setenv("SPARKDL_" + key, value)
    loader = ds.loader(10)
    assert (loader.rank, loader.world_size) == (2, 3)
    monkeypatch.delenv("SPARKDL_RUN_ID")
    assert (ds.loader(10).rank, ds.loader(10).world_size) == (0, 1)


def test_bad_arguments_say_what_to_do(ds: Dataset) -> None:
    with pytest.raises(ConfigError, match="both rank and world_size"):
        ds.loader(10, rank=1)
    with pytest.raises(ConfigError, match="rank must be below world_size=3; got 3"):
        ds.loader(10, rank=3, world_size=3)
    with pytest.raises(ConfigError, match="batch_size must be an integer >= 1; got 0"):
        ds.loader(0)
    with pytest.raises(ConfigError, match=r"\['nope'\] are not in the dataset"):
        ds.loader(10, columns=["id", "nope"])
    with pytest.raises(ConfigError, match=r"drop_last=True leaves no batch.*drop_last=False"):
        ds.loader(1000, rank=0, world_size=4, drop_last=True)
    with pytest.raises(ConfigError, match=r"reader must be one of 'arrow' .*'petastorm' .*; got 'tfrecord'"):
        ds.loader(10, reader="tfrecord")


def test_petastorm_reader_names_the_stack_it_needs(ds: Dataset) -> None:
    try:
        import petastorm  # noqa: F401
    except Exception:
        pass
    else:
        pytest.skip("petastorm imports here: the classic stack's tests cover reader='petastorm'")
    with pytest.raises(ConfigError, match=r"Petastorm.*classic stack.*pyarrow 14\.0\.2.*reader='arrow'"):
        ds.loader(10, reader="petastorm", rank=0, world_size=1)


@pytest.mark.parametrize("world_size", [1, 3])
def test_petastorm_reader_gives_equal_steps_and_the_same_format(data_dir: Path, world_size: int) -> None:
    pytest.importorskip("petastorm", reason="petastorm runs on the classic stack only", exc_type=ImportError)
    ds = Dataset(data_dir, fixed_lengths={"pair": 2})
    columns = ["id", "f32", "flag", "pair", "bin", "text"]  # what make_batch_reader can read
    for drop_last in (False, True):
        sizes = []
        for rank in range(world_size):
            loader = ds.loader(64, rank=rank, world_size=world_size, reader="petastorm", columns=columns,
                               drop_last=drop_last, seed=1)
            batches = list(loader)
            assert len(batches) == len(loader)
            sizes.append([len(b["id"]) for b in batches])
            for b in batches[:3]:
                ids = b["id"].numpy()
                assert np.array_equal(b["pair"].numpy(), np.repeat(ids, 2).reshape(-1, 2))
                assert b["text"] == [f"row-{i}" for i in ids]
                assert b["bin"] == [int(i).to_bytes(4, "little") for i in ids]
        assert all(s == sizes[0] for s in sizes)
    arrow = next(iter(ds.loader(8, rank=0, world_size=1, columns=columns)))
    peta = next(iter(ds.loader(8, rank=0, world_size=1, columns=columns, reader="petastorm")))
    assert {k: (type(v), getattr(v, "dtype", None), getattr(v, "shape", None)) for k, v in arrow.items()} == {
        k: (type(v), getattr(v, "dtype", None), getattr(v, "shape", None)) for k, v in peta.items()
    }


def test_petastorm_chunks_are_cut_to_exact_batches() -> None:
    # Petastorm yields row-group-sized chunks; the loader cuts them to the planned batch sizes.
    def chunks() -> Iterator[dict[str, pa.Array]]:
        start = 0
        for n in (7, 0, 3, 12, 5):
            yield {"id": pa.array(np.arange(start, start + n))}
            start += n

    got = [pa.concat_arrays(b["id"]).to_pylist() for b in _rebatch(chunks(), [4, 4, 4, 4, 4, 3])]
    assert got == [list(range(i, min(i + 4, 23))) for i in range(0, 23, 4)]
    with pytest.raises(DatasetError, match="ended after"):
        list(_rebatch(chunks(), [20, 20]))


def test_petastorm_columns_convert_like_arrow_ones() -> None:
    from sparkdl._internal.data.format.manifest import ColumnSpec

    fixed = _from_petastorm(ColumnSpec("x", "array", "float32", 2), np.arange(6, dtype=np.float32).reshape(3, 2))
    assert fixed.to_pylist() == [[0, 1], [2, 3], [4, 5]]
    ragged = np.empty(2, dtype=object)
    ragged[:] = [np.array([1, 2], np.int32), np.array([3], np.int32)]
    assert _from_petastorm(ColumnSpec("v", "array", "int32"), ragged).to_pylist() == [[1, 2], [3]]
    assert _from_petastorm(ColumnSpec("s", "string", "str"), np.array(["a", "b"], dtype=object)).to_pylist() == ["a", "b"]


def test_pieces_wrap_around_the_stream() -> None:
    rows = np.array([3, 5, 2])
    order = np.array([2, 0, 1])  # stream: g2[0:2], g0[0:3], g1[0:5]
    assert _pieces(rows, order, 1, 4) == [(2, 1, 2), (0, 0, 3)]
    assert _pieces(rows, order, 8, 5) == [(1, 3, 5), (2, 0, 2), (0, 0, 1)]


def test_missing_or_empty_paths_are_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        Dataset(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "_SUCCESS").write_bytes(b"")
    with pytest.raises(DatasetError, match="holds no Parquet files"):
        Dataset(tmp_path / "empty")
    (tmp_path / "mixed").mkdir()
    pq.write_table(pa.table({"a": [1]}), tmp_path / "mixed" / "a.parquet")
    pq.write_table(pa.table({"b": ["x"]}), tmp_path / "mixed" / "b.parquet")
    with pytest.raises(DatasetError, match="another schema"):
        Dataset(tmp_path / "mixed")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(DatasetError, match="manifest"):
        Dataset(tmp_path / "bad")


def test_single_file_and_file_url(data_dir: Path) -> None:
    one = Dataset(data_dir / "part-000.parquet")
    assert one.num_rows == 1000 and one.files == (one.url,)
    assert sum(len(b["id"]) for b in one.loader(128, rank=0, world_size=1, columns=["id"])) == 1000
    via_url = Dataset(data_dir.as_uri())
    assert via_url.url == Dataset(data_dir).url and via_url.num_rows == N


def test_import_sparkdl_stays_cheap() -> None:
    import subprocess
    import sys

    code = "import sys, sparkdl; print(sorted(m for m in ('pyarrow', 'torch', 'pyspark', 'sparkdl._internal.data.loader') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "pyarrow" not in out.stdout and "torch" not in out.stdout and "sparkdl._internal.data.loader" not in out.stdout
    assert sparkdl.Dataset is Dataset


@pytest.mark.parametrize("shuffle", [False, True])
def test_plain_lists_of_one_length_give_the_same_tensors_as_padding(tmp_path: Path, shuffle: bool) -> None:
    # Two files of plain Parquet lists: length 3 in one, 5 in the other. Windows inside one file
    # see one length (and take the numpy path); windows across both see two (and are padded).
    for part, (start, length) in enumerate([(0, 3), (600, 5)]):
        ids = np.arange(start, start + 600, dtype=np.int64)
        values = (np.repeat(ids, length) * 10 + np.tile(np.arange(length), len(ids))).astype(np.float32)
        offsets = np.arange(0, (len(ids) + 1) * length, length, dtype=np.int32)
        table = pa.table({"id": ids, "v": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))})
        pq.write_table(table, tmp_path / f"part-{part}.parquet", row_group_size=100)
    seen = []
    for window in (100, 1200):  # mostly inside one file; across both
        loader = Dataset(tmp_path).loader(64, shuffle=shuffle, seed=3, rank=0, world_size=1, shuffle_window=window)
        for batch in loader:
            ids = batch["id"].numpy()
            lengths = np.where(ids < 600, 3, 5)
            assert batch["v_lengths"].dtype == torch.int64 and batch["v_lengths"].tolist() == lengths.tolist()
            assert batch["v"].dtype == torch.float32 and batch["v"].shape == (len(ids), lengths.max())
            for row, i, n in zip(batch["v"].numpy(), ids, lengths, strict=True):
                assert row[:n].tolist() == [i * 10 + k for k in range(n)] and not row[n:].any()
            seen.extend(ids.tolist())
    assert sorted(seen) == sorted(list(range(1200)) * 2)


@pytest.mark.parametrize("prefetch", [0, 4])
def test_batches_kept_across_windows_and_epochs_keep_their_values(ds: Dataset, prefetch: int) -> None:
    # Shuffle windows' arrays are reused for later windows and epochs; the batches handed out
    # are copies, so batches a training loop keeps (e.g. for a validation pass) do not change.
    loader = ds.loader(64, seed=5, rank=0, world_size=1, shuffle_window=640, prefetch=prefetch)
    kept = [batch for _ in range(3) for batch in loader]
    assert len(kept) == 3 * len(loader)
    for batch in kept:
        ids = batch["id"].numpy()
        assert np.array_equal(batch["f32"].numpy(), ids.astype(np.float32) / 2)
        assert np.array_equal(batch["fixed"].numpy(), np.repeat(ids, 3).reshape(-1, 3).astype(np.float32))
        assert np.array_equal(batch["pair"].numpy(), np.repeat(ids, 2).reshape(-1, 2).astype(np.float64))


def test_spares_reuse_a_window_array_and_let_go_of_one_that_does_not_fit() -> None:
    from sparkdl._internal.data.reading.spares import Spares

    spares = Spares()
    first = spares.take((100, 3), "float32")
    labels = np.zeros(100, np.int64)
    spares.give({"x": first, "y": labels[:50]})  # a view (a last window): its whole array is kept
    again = spares.take((80, 3), "float32")  # fewer rows: the first rows of a spare
    assert again.shape == (80, 3) and np.shares_memory(again, first)
    assert np.shares_memory(spares.take((100,), "int64"), labels)
    spares.give({"x": again})
    bigger = spares.take((120, 3), "float32")  # no spare fits: all are let go, a new one is made
    assert bigger.shape == (120, 3) and not np.shares_memory(bigger, first)


def test_arrow_to_numpy_reads_the_buffers_of_slices_and_bits() -> None:
    from sparkdl._internal.data.format.arrow import list_lengths, list_values, to_numpy

    for arr in (pa.array(np.arange(10, dtype=np.int8)), pa.array(np.linspace(0, 1, 10, dtype=np.float16)),
                pa.array(np.arange(10, dtype=np.uint32)), pa.array([i % 3 == 0 for i in range(10)])):
        for part in (arr, arr.slice(3), arr.slice(9, 1), arr.slice(10)):
            got = to_numpy(part)
            assert got.dtype == part.type.to_pandas_dtype() and got.tolist() == part.to_pylist()
    lists = pa.array([[1.0], None, [2.0, 3.0], [], [4.0, 5.0, 6.0]], pa.list_(pa.float32()))
    assert list_lengths(lists).tolist() == [1, 0, 2, 0, 3] and list_lengths(lists.slice(2)).tolist() == [2, 0, 3]
    assert list_values(lists.slice(2)).to_pylist() == [2.0, 3.0, 4.0, 5.0, 6.0]
    fixed = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(6, dtype=np.int64)), 2).slice(1)
    assert list_lengths(fixed).tolist() == [2, 2] and list_values(fixed).to_pylist() == [2, 3, 4, 5]


def test_feeding_numbers_and_arrays_does_not_import_pandas(data_dir: Path) -> None:
    import subprocess
    import sys

    # pyarrow's own to_numpy loads pandas (about 50 MiB); the loader reads Arrow buffers itself.
    code = (
        "import sys, sparkdl\n"
        f"ds = sparkdl.Dataset({str(data_dir)!r})\n"
        "for shuffle in (True, False):\n"
        "    for b in ds.loader(64, shuffle=shuffle, rank=0, world_size=1, columns=['id', 'f32', 'flag', 'fixed', 'pair']):\n"
        "        pass\n"
        "print('pandas' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def _copy(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else list(v) for k, v in batch.items()}


def _all_columns(loader: Loader) -> list[dict[str, Any]]:
    return [_copy(batch) for batch in loader]


def test_row_groups_decoded_on_several_threads_give_the_same_batches_and_resume(ds: Dataset) -> None:
    kw: dict[str, Any] = dict(rank=0, world_size=2, seed=4, drop_last=False, shuffle_window=1500)
    reference = [_all_columns(ds.loader(64, epoch=e, read_threads=1, **kw)) for e in (0, 1)]
    seen: set[str] = set()
    loader = ds.loader(64, read_threads=3, **kw)
    for epoch, expected in enumerate(reference):
        loader.set_epoch(epoch)
        got = []
        for batch in loader:
            seen |= {t.name for t in threading.enumerate() if t.name.startswith("sparkdl-decode")}
            got.append(_copy(batch))
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
            assert a.keys() == b.keys()
            for k in a:
                assert (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]), k
    assert len(seen) > 1, seen  # the windows' row groups were decoded on more than one thread
    loader.close()
    deadline = time.monotonic() + 10
    while any(t.name.startswith("sparkdl-decode") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("sparkdl-decode")]
    # A position saved mid-epoch (7 batches in, inside the second window) resumes to the same batches.
    partial = ds.loader(64, read_threads=3, **kw)
    taken = iter(partial)
    for _ in range(7):
        next(taken)
    resumed = ds.loader(64, read_threads=3, **kw)
    resumed.load_state_dict(pickle.loads(pickle.dumps(partial.state_dict())))
    partial.close()
    rest = _all_columns(resumed)
    assert len(rest) == len(reference[0]) - 7
    assert all(torch.equal(a["id"], b["id"]) and torch.equal(a["f32"], b["f32"])
               for a, b in zip(rest, reference[0][7:], strict=True))


def test_a_row_group_that_fails_in_a_decode_thread_names_the_file(tmp_path: Path) -> None:
    root = _write_layout(tmp_path / "d", [(400, 50)])
    ds = Dataset(root)
    path = next(root.glob("part-*.parquet"))
    pq.write_table(_table(np.arange(400, dtype=np.int64)), path, row_group_size=80)  # rewritten after opening
    with pytest.raises(DatasetError, match=r"row group \d+ has \d+ rows, the manifest 50; the files changed"):
        for _ in ds.loader(32, read_threads=3, seed=0):
            pass
    with pytest.raises(ConfigError, match=r"read_threads must be an integer >= 1 or None.*; got 0"):
        ds.loader(32, read_threads=0)
