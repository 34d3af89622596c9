"""The loader's worker processes (``workers=N``): the thread path's batches, order and resume
state, errors by name, and no process left behind however the loop or the rank ends."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from sparkdl import ConfigError, Dataset, DatasetError

# (rows, rows per row group) of each file: uneven, with an empty file.
LAYOUT = [(700, 200), (37, 10), (0, 1), (1300, 450), (3, 2)]


def _write(root: Path, layout: list[tuple[int, int]]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    start = 0
    for i, (rows, group) in enumerate(layout):
        ids = np.arange(start, start + rows, dtype=np.int64)
        lengths = ids % 4
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        values = np.concatenate([np.arange(k, dtype=np.float32) for k in lengths]) if rows else np.zeros(0, np.float32)
        table = pa.table({
            "id": pa.array(ids),
            "x": pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 4).astype(np.float32)), 4),
            "flag": pa.array(ids % 3 == 0),
            "var": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
            "text": pa.array([f"row-{i}" for i in ids], pa.string()),
        })
        pq.write_table(table, root / f"part-{i:03d}.parquet", row_group_size=group)
        start += rows
    return root


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    return Dataset(_write(tmp_path_factory.mktemp("workers") / "data", LAYOUT))


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if list(a) != list(b):
        return False
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def _epochs(loader: Any, epochs: int) -> list[list[dict[str, Any]]]:
    with loader:
        return [list(loader) for _ in range(epochs)]


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_batch_equals_the_thread_path(ds: Dataset, workers: int, shuffle: bool, drop_last: bool) -> None:
    kwargs: dict[str, Any] = dict(shuffle=shuffle, drop_last=drop_last, seed=3, rank=1, world_size=2, shuffle_window=300)
    threads = _epochs(ds.loader(64, **kwargs), 2)
    procs = _epochs(ds.loader(64, workers=workers, **kwargs), 2)
    assert [len(e) for e in procs] == [len(e) for e in threads]
    for e, (want, got) in enumerate(zip(threads, procs, strict=True)):
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            assert _same(a, b), (e, i)


def test_batches_kept_by_the_loop_stay_intact(ds: Dataset) -> None:
    # Slots are reused only once a batch's tensors are let go: a loop that keeps them all
    # (list(loader)) must still see every batch as it was handed out.
    kept = list(ds.loader(32, shuffle=True, seed=1, rank=0, world_size=1, workers=2, prefetch=2))
    again = list(ds.loader(32, shuffle=True, seed=1, rank=0, world_size=1))
    assert all(_same(a, b) for a, b in zip(kept, again, strict=True))
    ids = torch.cat([b["id"] for b in kept])
    assert sorted(ids.tolist()) == list(range(sum(r for r, _ in LAYOUT)))


def test_more_batches_kept_than_the_return_ring_holds(ds: Dataset) -> None:
    # 510 batches held at once from one worker: their slots go back past the shared ring (256),
    # by message, and the next epoch reuses them ...
    kwargs: dict[str, Any] = dict(shuffle=False, rank=0, world_size=1, columns=["id"])
    loader = ds.loader(4, workers=1, **kwargs)
    with loader:
        first = list(loader)
        assert len(first) == 510
        ids = torch.cat([b["id"] for b in first]).tolist()
        del first
        second = [b["id"].clone() for b in loader]
        # ... and unmaps the slots beyond the few it keeps, so memory goes back as on threads.
        assert len(loader._pump._mapped.maps[0]) < 20  # type: ignore[union-attr]
    assert ids == list(range(2040)) and torch.cat(second).tolist() == ids


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_resume_mid_epoch_equals_the_uninterrupted_run(ds: Dataset, workers: int) -> None:
    kwargs: dict[str, Any] = dict(rank=0, world_size=2, seed=5, shuffle_window=256, columns=["id", "x"], workers=workers)
    reference = [b["id"].tolist() for b in ds.loader(50, epoch=1, **kwargs)]
    nxt = [b["id"].tolist() for b in ds.loader(50, epoch=2, **kwargs)]
    for consumed in (1, 6, len(reference) - 1):
        loader = ds.loader(50, epoch=1, **kwargs)
        it = iter(loader)
        for _ in range(consumed):
            next(it)
        state = pickle.loads(pickle.dumps(loader.state_dict()))
        loader.close()
        assert state == {**ds.loader(50, epoch=1, **{**kwargs, "workers": 0}).state_dict(), "step": consumed}
        fresh = ds.loader(50, **kwargs)
        fresh.load_state_dict(state)
        fresh.set_epoch(1)
        with fresh:
            assert [b["id"].tolist() for b in fresh] == reference[consumed:]
            assert [b["id"].tolist() for b in fresh] == nxt


def _squares(batch: dict[str, Any]) -> dict[str, Any]:
    # Module-level, as a user's transform usually is; it runs in the workers.
    return {"sq": batch["id"] ** 2, "half": batch["x"][:, ::2], "tag": [t.upper() for t in batch["text"]],
            "pid": torch.tensor(os.getpid())}


def test_transform_and_to_device_run_as_on_threads(ds: Dataset) -> None:
    kwargs: dict[str, Any] = dict(rank=0, world_size=1, seed=4, transform=_squares, to_device=True, device="cpu")
    threads = list(ds.loader(100, **kwargs))
    loader = ds.loader(100, workers=2, **kwargs)
    with loader:
        procs = list(loader)
    assert len(procs) == len(threads)
    for a, b in zip(threads, procs, strict=True):
        assert torch.equal(a["sq"], b["sq"]) and torch.equal(a["half"], b["half"]) and a["tag"] == b["tag"]
        assert int(b["pid"]) != os.getpid()  # the transform ran in a worker


def _odd_tensors(batch: dict[str, Any]) -> dict[str, Any]:
    return {"bf16": batch["x"].to(torch.bfloat16), "empty": torch.zeros((len(batch["id"]), 0)),
            "strided": batch["x"].t()[:2], "scalar": batch["id"].sum()}


def test_tensors_of_any_dtype_shape_and_layout_cross_as_they_are(ds: Dataset) -> None:
    threads = list(ds.loader(64, rank=0, world_size=1, transform=_odd_tensors))
    loader = ds.loader(64, rank=0, world_size=1, transform=_odd_tensors, workers=2)
    with loader:
        procs = list(loader)
    for a, b in zip(threads, procs, strict=True):
        for k in a:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def test_resume_at_another_world_size(ds: Dataset) -> None:
    kwargs: dict[str, Any] = dict(seed=2, shuffle_window=256, columns=["id"])
    old = ds.loader(40, rank=0, world_size=3, **kwargs)
    it = iter(old)
    for _ in range(4):
        next(it)
    state = old.state_dict()
    old.close()
    for rank in range(2):
        threads = ds.loader(40, rank=rank, world_size=2, **kwargs)
        procs = ds.loader(40, rank=rank, world_size=2, workers=2, **kwargs)
        threads.load_state_dict(state)
        procs.load_state_dict(state)
        with procs:
            assert [b["id"].tolist() for b in procs] == [b["id"].tolist() for b in threads]


def test_a_resharded_rest_shorter_than_the_workers_then_whole_epochs(ds: Dataset) -> None:
    # The rest of the old epoch fills one unit: worker 1 has none in it, and must still be there
    # for the next epoch's units.
    kwargs: dict[str, Any] = dict(seed=2, shuffle_window=256, columns=["id"])
    old = ds.loader(40, rank=0, world_size=3, **kwargs)
    it = iter(old)
    for _ in range(len(old) - 2):
        next(it)
    state = old.state_dict()
    old.close()
    threads = ds.loader(40, rank=1, world_size=2, **kwargs)
    procs = ds.loader(40, rank=1, world_size=2, workers=2, **kwargs)
    threads.load_state_dict(state)
    procs.load_state_dict(state)
    with procs:
        for _ in range(2):
            assert [b["id"].tolist() for b in procs] == [b["id"].tolist() for b in threads]


def test_a_workers_error_is_the_thread_paths_named_error(tmp_path: Path) -> None:
    pq.write_table(pa.table({"x": pa.array([1.0, None, 3.0] * 40), "ok": pa.array(range(120))}),
                   tmp_path / "a.parquet", row_group_size=30)
    ds = Dataset(tmp_path)
    with pytest.raises(DatasetError, match=r"column 'x' has null values.*fillna") as threads:
        list(ds.loader(10, rank=0, world_size=1, shuffle=False))
    with pytest.raises(DatasetError, match=r"column 'x' has null values.*fillna") as procs:
        list(ds.loader(10, rank=0, world_size=1, shuffle=False, workers=2))
    assert str(procs.value) == str(threads.value)


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_an_error_comes_after_every_batch_made_before_it(ds: Dataset, workers: int) -> None:
    # A worker that fails has published the batches before its error: the loop gets them all,
    # in order, then the error, as on threads (each worker's batches and error share one order).
    kwargs: dict[str, Any] = dict(shuffle=True, seed=3, rank=0, world_size=1, shuffle_window=160)
    expected = [b["id"].tolist() for b in ds.loader(16, **kwargs)]
    bad = expected[6][0]

    def fail_on_the_seventh(batch: dict[str, Any]) -> dict[str, Any]:
        if int(batch["id"][0]) == bad:
            raise ValueError("bad batch")
        return batch

    got: list[list[int]] = []
    with pytest.raises(ValueError, match="bad batch"):
        for b in ds.loader(16, transform=fail_on_the_seventh, workers=workers, prefetch=4, **kwargs):
            got.append(b["id"].tolist())
    # With several workers the others may run ahead, but no batch after the failed one arrives.
    assert got == expected[:6]


def test_a_decode_functions_error_names_the_row(tmp_path: Path) -> None:
    pq.write_table(pa.table({"b": pa.array([bytes([i]) for i in range(60)])}), tmp_path / "a.parquet")
    ds = Dataset(tmp_path)

    def decode(value: bytes, rng: Any) -> np.ndarray:
        if value[0] == 42:
            raise ValueError("not an image")
        return np.frombuffer(value, dtype=np.uint8)

    with pytest.raises(DatasetError, match=r"column 'b', row 42 .*not an image"):
        list(ds.loader(8, rank=0, world_size=1, shuffle=False, decode={"b": decode}, workers=2))
    loader = ds.loader(8, rank=0, world_size=1, shuffle=False, decode={"b": decode}, workers=2, on_bad_sample="skip")
    with loader:
        rows = torch.cat([b["b"].flatten() for b in loader]).tolist()
    assert rows == [i for i in range(60) if i != 42] and loader.skipped == 1


@pytest.mark.parametrize("prefetch", [0, 8])
def test_skipped_counts_the_bad_samples_of_the_batches_taken(tmp_path: Path, prefetch: int) -> None:
    # The prefetch thread decodes the next epoch's batches (row 42's among them) before the loop
    # asks for them; loader.skipped counts one bad sample per epoch taken all the same.
    pq.write_table(pa.table({"b": pa.array([bytes([i]) for i in range(60)])}), tmp_path / "a.parquet")

    def decode(value: bytes, rng: Any) -> np.ndarray:
        if value[0] == 42:
            raise ValueError("not an image")
        return np.frombuffer(value, dtype=np.uint8)

    loader = Dataset(tmp_path).loader(8, rank=0, world_size=1, shuffle=False, decode={"b": decode},
                                      on_bad_sample="skip", prefetch=prefetch)
    with loader:
        assert len(list(loader)) == 8
        if prefetch:  # the thread has met epoch 1's bad sample, ahead of the loop
            found = loader._samples.found  # type: ignore[union-attr]
            deadline = time.monotonic() + 10
            while found.count < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert found.count == 2
        assert loader.skipped == 1
        assert len(list(loader)) == 8 and loader.skipped == 2


def test_a_killed_worker_is_named(ds: Dataset) -> None:
    loader = ds.loader(16, rank=0, world_size=1, workers=2, prefetch=1)
    it = iter(loader)
    next(it)
    for pid in loader.worker_pids:
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(DatasetError, match=r"worker process \d \(pid \d+\) was killed by signal 9"):
        for _ in it:
            pass
    loader.close()


def _gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_break_and_close_end_the_workers_promptly(ds: Dataset) -> None:
    loader = ds.loader(16, rank=0, world_size=1, workers=3, shuffle_window=160)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    pids = loader.worker_pids
    assert len(pids) == 3 and all(_alive(p) for p in pids)
    started = time.monotonic()
    loader.close()
    assert _gone(pids, 3.0) and time.monotonic() - started < 3.0
    assert loader.worker_pids == []
    # Iterating again resumes from the position with fresh workers.
    assert len(list(loader)) == len(loader) - 3
    loader.close()


def test_a_dropped_loader_ends_its_workers(ds: Dataset) -> None:
    loader = ds.loader(16, rank=0, world_size=1, workers=2, shuffle_window=160)
    it = iter(loader)
    next(it)
    pids = loader.worker_pids
    del it, loader  # no close(): dropping the loader is enough
    assert _gone(pids, 5.0)


def test_workers_end_with_a_rank_killed_by_sigkill(ds: Dataset, tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys, time
        from sparkdl import Dataset
        loader = Dataset({str(ds.url)!r}).loader(8, rank=0, world_size=1, workers=2, prefetch=1)
        it = iter(loader)
        next(it)
        print(*loader.worker_pids, flush=True)
        time.sleep(120)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    rank = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert rank.stdout is not None
        pids = [int(p) for p in rank.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        rank.send_signal(signal.SIGKILL)
        rank.wait(10)
        assert _gone(pids, 10.0), [p for p in pids if _alive(p)]
    finally:
        rank.kill()
        rank.wait(10)


def test_options_say_what_workers_need(ds: Dataset) -> None:
    with pytest.raises(ConfigError, match=r"workers must be .*0.*got -1"):
        ds.loader(8, workers=-1)
    with pytest.raises(ConfigError, match=r"workers.*reader='arrow'"):
        ds.loader(8, workers=2, reader="petastorm")
