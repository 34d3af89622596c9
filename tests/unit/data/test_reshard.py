"""Resuming the loader at another world size: the rest of the interrupted epoch is covered exactly
once across the new ranks, in the documented order, with equal steps; later epochs are planned
for the new size. Real Parquet files, explicit ranks, no Spark."""

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
from sparkdl._internal.data.reading.reshard import covering_ranges

B = 20
EVEN = [(700, 64), (900, 150), (800, 37)]  # 2400 rows: no padding at 2, 3 or 4 ranks for the steps used
UNEVEN = [(701, 64), (913, 150), (757, 37)]  # 2371 rows


def _dataset(root: Path, layout: list[tuple[int, int]]) -> Dataset:
    root.mkdir()
    start = 0
    for i, (rows, group) in enumerate(layout):
        ids = np.arange(start, start + rows, dtype=np.int64)
        table = pa.table({"id": ids, "twice": ids * 2, "text": [f"row-{i}" for i in ids]})
        pq.write_table(table, root / f"part-{i}.parquet", row_group_size=group)
        start += rows
    return Dataset(root)


@pytest.fixture(scope="module")
def even(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    return _dataset(tmp_path_factory.mktemp("reshard") / "even", EVEN)


@pytest.fixture(scope="module")
def uneven(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    return _dataset(tmp_path_factory.mktemp("reshard") / "uneven", UNEVEN)


def _ids(loader: Loader) -> list[np.ndarray]:
    out = []
    for batch in loader:
        ids = batch["id"].numpy().copy()
        assert np.array_equal(batch["twice"].numpy(), ids * 2) and batch["text"] == [f"row-{i}" for i in ids]
        out.append(ids)
    return out


def _take(loader: Loader, steps: int) -> list[np.ndarray]:
    """The first ``steps`` batches, leaving the loop with ``break`` (the reader may be ahead)."""
    out: list[np.ndarray] = []
    if steps:
        for batch in loader:
            out.append(batch["id"].numpy().copy())
            if len(out) == steps:
                break
    return out


def _saved(state: dict[str, Any]) -> dict[str, Any]:
    """As in a checkpoint: plain values only."""
    return json.loads(json.dumps(state))


def _interrupt(ds: Dataset, world: int, steps: int, **kw: Any) -> tuple[list[np.ndarray], dict[str, Any]]:
    """``world`` ranks play ``steps`` steps of epoch 0: their batches, and the (common) state."""
    consumed, states = [], []
    for rank in range(world):
        loader = ds.loader(B, rank=rank, world_size=world, **kw)
        consumed += _take(loader, steps)
        states.append(_saved(loader.state_dict()))
        loader.close()
    assert all(s == states[0] for s in states)
    return consumed, states[0]


def _resume(ds: Dataset, world: int, state: dict[str, Any], **kw: Any) -> list[Loader]:
    loaders = [ds.loader(B, rank=rank, world_size=world, **kw) for rank in range(world)]
    for loader in loaders:
        loader.load_state_dict(state)
    return loaders


def _rest_stream(ds: Dataset, world: int, steps: int, **kw: Any) -> np.ndarray:
    """The old ranks' unconsumed rows in old-rank order, from uninterrupted runs of epoch 0."""
    rests = [np.concatenate(_ids(ds.loader(B, rank=r, world_size=world, **kw)))[steps * B :] for r in range(world)]
    return np.concatenate(rests)


def _counts(ds: Dataset, batches: list[np.ndarray]) -> np.ndarray:
    return np.bincount(np.concatenate(batches), minlength=ds.num_rows)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize(("old", "new", "steps", "prefetch"), [(4, 2, 7, 3), (2, 4, 13, 0), (2, 4, 0, 2)])
def test_the_rest_of_the_epoch_is_covered_once_at_the_new_world_size(
    even: Dataset, shuffle: bool, old: int, new: int, steps: int, prefetch: int
) -> None:
    kw: dict[str, Any] = dict(shuffle=shuffle, seed=3, shuffle_window=140, prefetch=prefetch)  # evened: 120 at 4 ranks, 140 at 2
    consumed, state = _interrupt(even, old, steps, **kw)
    assert state["step"] == steps and state["world_size"] == old and state["reshards"] == []
    # The old orders are rebuilt with the old (evened) window, not the new one.
    assert state["shuffle_window"] != even.loader(B, rank=0, world_size=new, shuffle_window=140).shuffle_window
    loaders = _resume(even, new, state, **kw)
    rest = [_ids(loader) for loader in loaders]
    # Every id exactly once across the old ranks' first steps and the new ranks' rest.
    assert np.array_equal(_counts(even, consumed + [b for r in rest for b in r]), np.ones(even.num_rows))
    assert len({len(r) for r in rest}) == 1
    if steps:
        # In the documented order: new rank r takes the r-th range of the old ranks' rests.
        stream = _rest_stream(even, old, steps, **kw)
        share = len(stream) // new
        for rank, batches in enumerate(rest):
            assert [len(b) for b in batches[:-1]] == [B] * (len(batches) - 1)
            assert np.array_equal(np.concatenate(batches), stream[rank * share : (rank + 1) * share])
    # The next epoch is the new world size's, as planned.
    for rank, loader in enumerate(loaders):
        assert loader.epoch == 1 and loader.step == 0 and loader.state_dict()["reshards"] == []
        fresh = even.loader(B, rank=rank, world_size=new, epoch=1, **kw)
        assert len(loader) == len(fresh)
        assert [b.tolist() for b in _ids(loader)] == [b.tolist() for b in _ids(fresh)]


def test_a_resumed_epoch_reports_its_own_steps_and_position(even: Dataset) -> None:
    kw: dict[str, Any] = dict(seed=5, shuffle_window=100)
    _, state = _interrupt(even, 4, 9, **kw)
    loader = _resume(even, 2, state, **kw)[1]
    planned = even.loader(B, rank=1, world_size=2, **kw)
    expected = (4 * (600 - 9 * B)) // 2 // B  # the old ranks' rests, halved: 42 batches
    loader.set_epoch(0)  # the usual top-of-epoch call keeps the position
    assert len(loader) == expected != len(planned) and loader.epoch == 0 and loader.step == 0
    _take(loader, 5)
    saved = _saved(loader.state_dict())
    assert saved["step"] == 5 and saved["steps_per_epoch"] == expected and saved["world_size"] == 2
    assert saved["reshards"] == [{"world_size": 4, "step": 9, "shuffle_window": state["shuffle_window"]}]
    assert saved["requested_shuffle_window"] == 100
    # set_epoch to another epoch leaves the resumed one: the epoch is planned again from its start.
    loader.set_epoch(1)
    loader.set_epoch(0)
    assert len(loader) == len(planned) and loader.state_dict()["reshards"] == []
    assert [b.tolist() for b in _ids(loader)] == [b.tolist() for b in _ids(planned)]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("old", "new", "steps"), [(3, 4, 5), (4, 3, 11), (2, 5, 1)])
def test_uneven_rests_follow_the_remainder_policy(uneven: Dataset, drop_last: bool, old: int, new: int, steps: int) -> None:
    kw: dict[str, Any] = dict(drop_last=drop_last, seed=1, shuffle_window=90)
    n = uneven.num_rows
    consumed, state = _interrupt(uneven, old, steps, **kw)
    loaders = _resume(uneven, new, state, **kw)
    steps_new = [len(loader) for loader in loaders]
    rest = [_ids(loader) for loader in loaders]
    assert [len(r) for r in rest] == steps_new and len(set(steps_new)) == 1
    assert len({len(r[-1]) for r in rest}) == 1  # the same last batch on every rank
    per_old = -(-n // old) if not drop_last else n // (old * B) * B
    left = old * (per_old - steps * B)  # the resume stream
    counts = _counts(uneven, consumed + [b for r in rest for b in r])
    if drop_last:
        per_new = left // (new * B) * B
        assert counts.max() == 1 and all(len(b) == B for r in rest for b in r)
        assert (n - old * per_old) + (left - new * per_new) == (counts == 0).sum()
        assert left - new * per_new < new * B
    else:
        per_new = -(-left // new)
        assert counts.min() == 1 and counts.max() <= 2
        assert (counts == 2).sum() == (old * per_old - n) + (new * per_new - left)
        assert new * per_new - left < new
    assert sum(len(b) for b in rest[0]) == per_new


def test_drop_last_with_no_full_batch_left_goes_to_the_next_epoch(even: Dataset) -> None:
    kw: dict[str, Any] = dict(drop_last=True, seed=2)
    steps = len(even.loader(B, rank=0, world_size=2, **kw))
    _, state = _interrupt(even, 2, steps - 1, **kw)  # 2 ranks * 1 batch left, for 4 ranks
    for rank, loader in enumerate(_resume(even, 4, state, **kw)):
        assert (loader.epoch, loader.step) == (1, 0)
        fresh = even.loader(B, rank=rank, world_size=4, epoch=1, **kw)
        assert [b.tolist() for b in _ids(loader)] == [b.tolist() for b in _ids(fresh)]


def test_a_chain_of_reshards_stays_exact(even: Dataset) -> None:
    kw: dict[str, Any] = dict(seed=4, shuffle_window=80)
    consumed, state = _interrupt(even, 4, 6, **kw)  # 4 * (600 - 120) = 1920 rows left
    second = _resume(even, 2, state, **kw)  # 960 each
    reference = [_ids(loader) for loader in _resume(even, 2, state, **kw)]
    for loader in second:
        consumed += _take(loader, 11)
    saved = _saved(second[0].state_dict())
    assert [level["world_size"] for level in saved["reshards"]] == [4] and saved["step"] == 11
    # A second resume at the same world size gives exactly the batches not yet yielded.
    again = _resume(even, 2, saved, **kw)
    for loader, ref in zip(again, reference, strict=True):
        assert [b.tolist() for b in _ids(loader)] == [b.tolist() for b in ref[11:]]
    # Then at 3 ranks: 2 * (960 - 220) = 1480 rows, no multiple of 3: 2 are seen twice.
    third = _resume(even, 3, saved, **kw)
    rest = [_ids(loader) for loader in third]
    assert len({len(r) for r in rest}) == 1
    counts = _counts(even, consumed + [b for r in rest for b in r])
    assert counts.min() == 1 and (counts == 2).sum() == 3 * -(-1480 // 3) - 1480
    # A third change, inside the resumed-again epoch, keeps the whole chain.
    fourth = _resume(even, 3, saved, **kw)
    taken = [b for loader in fourth for b in _take(loader, 4)]
    chain = _saved(fourth[0].state_dict())
    assert [(lv["world_size"], lv["step"]) for lv in chain["reshards"]] == [(4, 6), (2, 11)]
    last = [_ids(loader) for loader in _resume(even, 4, chain, **kw)]
    counts = _counts(even, consumed + taken + [b for r in last for b in r])
    assert counts.min() == 1 and len({len(r) for r in last}) == 1
    assert (counts == 2).sum() == (3 * -(-1480 // 3) - 1480) + (4 * -(-(3 * (494 - 80)) // 4) - 3 * (494 - 80))


def test_petastorm_refuses_a_mid_epoch_reshard(even: Dataset) -> None:
    pytest.importorskip("petastorm", reason="Petastorm is on the classic stack only (.venv-classic)")
    state = even.loader(B, rank=0, world_size=4, reader="petastorm", seed=1).state_dict()
    boundary = even.loader(B, rank=0, world_size=2, reader="petastorm", seed=1)
    boundary.load_state_dict(state)  # an epoch's start is fine
    assert (boundary.epoch, boundary.step, boundary.state_dict()["reshards"]) == (0, 0, [])
    with pytest.raises(ConfigError, match=r"mid-epoch.*another world size.*4 -> 2.*reader='arrow'"):
        even.loader(B, rank=0, world_size=2, reader="petastorm", seed=1).load_state_dict({**state, "step": 3})


def test_other_settings_are_still_refused(even: Dataset) -> None:
    state = _saved(even.loader(B, rank=0, world_size=4, seed=1, shuffle_window=100).state_dict())
    with pytest.raises(ConfigError, match="batch_size=20"):
        even.loader(2 * B, rank=0, world_size=2, seed=1, shuffle_window=100).load_state_dict(state)
    with pytest.raises(ConfigError, match="requested_shuffle_window=100"):
        even.loader(B, rank=0, world_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="seed=1"):
        even.loader(B, rank=0, world_size=2, seed=2, shuffle_window=100).load_state_dict(state)
    with pytest.raises(ConfigError, match="reshards"):
        even.loader(B, rank=0, world_size=2, seed=1, shuffle_window=100).load_state_dict(
            {**state, "step": 2, "reshards": [{"world_size": 0}]})
    with pytest.raises(ConfigError, match="out of range"):
        even.loader(B, rank=0, world_size=2, seed=1, shuffle_window=100).load_state_dict(
            {**state, "step": 2, "reshards": [{"world_size": 4, "step": 999, "shuffle_window": 100}]})
    # A state from before resharding (version 1, no requested window) still loads, at any size.
    old = {k: v for k, v in state.items() if k not in ("requested_shuffle_window", "reshards")}
    loader = even.loader(B, rank=0, world_size=2, seed=1)
    loader.load_state_dict({**old, "version": 1, "step": 3})
    assert len(loader) == 4 * (600 - 3 * B) // 2 // B


def test_state_is_plain_and_survives_weights_only_loading(even: Dataset, tmp_path: Path) -> None:
    import torch

    _, state = _interrupt(even, 4, 3)
    loader = _resume(even, 3, state)[0]
    _take(loader, 2)
    saved = loader.state_dict()
    assert json.loads(json.dumps(saved)) == saved
    torch.save({"loader": saved}, tmp_path / "ckpt.pt")
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["loader"] == saved


def test_covering_ranges_bound_the_rows_read_in_vain() -> None:
    rng = np.random.default_rng(0)
    positions = rng.choice(100_000, 3_000, replace=False)
    for budget in (0, 50, 3_000, 10**9):
        starts, stops = covering_ranges(positions, budget)
        assert np.all(starts[1:] > stops[:-1]) and np.all(stops > starts)
        inside = np.searchsorted(starts, positions, side="right") - 1
        assert np.all(positions < stops[inside])
        assert (stops - starts).sum() - len(positions) <= budget
    assert len(covering_ranges(positions, 10**9)[0]) == 1
    assert len(covering_ranges(positions, 0)[0]) == len(np.unique(positions)) - np.sum(np.diff(np.sort(positions)) == 1)


def test_resharding_with_decode_threads_gives_the_batches_of_one_thread(uneven: Dataset) -> None:
    kw: dict[str, Any] = dict(seed=5, drop_last=True, shuffle_window=300)
    _, state = _interrupt(uneven, 2, 9, **kw)
    rests = []
    for threads in (1, 3):
        per_rank = []
        for rank in range(3):
            loader = uneven.loader(B, rank=rank, world_size=3, read_threads=threads, **kw)
            loader.load_state_dict(state)
            per_rank.append(_ids(loader))
            loader.close()
        rests.append(per_rank)
    assert [[b.tolist() for b in r] for r in rests[0]] == [[b.tolist() for b in r] for r in rests[1]]
    assert sum(len(b) for r in rests[0] for b in r) > 0
