"""Keeping a device fed, without a GPU: ``to_device`` and the read-ahead into the next epoch.

On a CPU machine the copy machinery still runs: the prefetch thread starts each batch's copy and
the training thread takes it. The ``meta`` device makes that visible (a tensor moved there keeps
its shape and dtype but no data), and ``cpu`` must give exactly the batches of the plain loader.
The CUDA side (side stream, events, ``record_stream``) runs in ``tools/gpu-check`` on a GPU.

After an epoch ends, the prefetch thread goes on into the next one, so the next loop does not
wait for its first window; the batches and positions must be those of a loader that did not.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from sparkdl import ConfigError, Dataset

ROWS = 1000


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    root = tmp_path_factory.mktemp("feed-device")
    for i, (start, stop) in enumerate([(0, 370), (370, ROWS)]):
        ids = np.arange(start, stop, dtype=np.int64)
        x = np.repeat(ids, 4).astype(np.float32) / 3
        pq.write_table(
            pa.table({
                "id": ids,
                "x": pa.FixedSizeListArray.from_arrays(pa.array(x), 4),
                "text": pa.array([f"row-{j}" for j in ids]),
            }),
            root / f"part-{i}.parquet",
            row_group_size=90,
        )
    return Dataset(root)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            if not (isinstance(b[k], torch.Tensor) and v.dtype == b[k].dtype and torch.equal(v, b[k])):
                return False
        elif v != b[k]:
            return False
    return True


KW: dict[str, Any] = dict(rank=1, world_size=3, seed=4, shuffle_window=180, drop_last=False)


@pytest.mark.parametrize("prefetch", [0, 3])
def test_to_device_on_cpu_gives_the_plain_loaders_batches_and_positions(ds: Dataset, prefetch: int) -> None:
    plain = ds.loader(32, prefetch=prefetch, **KW)
    moved = ds.loader(32, prefetch=prefetch, device="cpu", to_device=True, **KW)
    for epoch in range(2):
        plain.set_epoch(epoch)
        moved.set_epoch(epoch)
        pairs = list(zip(plain, moved, strict=True))
        assert len(pairs) == len(plain) == len(moved)
        assert all(_same(a, b) for a, b in pairs)
    assert moved.state_dict() == plain.state_dict()


@pytest.mark.parametrize("prefetch", [0, 3])
def test_to_device_resumes_with_exactly_the_unconsumed_batches(ds: Dataset, prefetch: int) -> None:
    expected = list(ds.loader(32, prefetch=prefetch, **KW))
    first = ds.loader(32, prefetch=prefetch, device="cpu", to_device=True, **KW)
    plain = ds.loader(32, prefetch=prefetch, **KW)
    it, plain_it = iter(first), iter(plain)
    for _ in range(5):
        next(it)
        next(plain_it)
    # Batches prepared (and copied) ahead are not counted: the position is the consumed ones.
    state = first.state_dict()
    assert state == plain.state_dict()
    assert state["step"] == 5
    first.close()
    plain.close()
    again = ds.loader(32, prefetch=prefetch, device="cpu", to_device=True, **KW)
    again.load_state_dict(state)
    rest = list(again)
    assert len(rest) == len(expected) - 5
    assert all(_same(a, b) for a, b in zip(rest, expected[5:], strict=True))
    assert again.state_dict()["epoch"] == 1 and again.state_dict()["step"] == 0


def test_every_tensor_goes_to_the_device_and_lists_stay(ds: Dataset) -> None:
    # "meta" keeps shapes and dtypes but no data: proof that the copy path moved each tensor.
    loader = ds.loader(64, prefetch=2, device="meta", to_device=True, **KW)
    plain = ds.loader(64, prefetch=2, **KW)
    for a, b in zip(loader, plain, strict=True):
        assert a["id"].device.type == "meta" and a["x"].device.type == "meta"
        assert a["x"].shape == b["x"].shape and a["x"].dtype == b["x"].dtype
        assert a["text"] == b["text"]
    assert loader.state_dict() == plain.state_dict()


def test_without_to_device_batches_stay_on_the_cpu(ds: Dataset) -> None:
    batch = next(iter(ds.loader(64, device="meta", **KW)))
    assert batch["x"].device.type == "cpu"


def test_an_error_in_the_transform_still_reaches_the_training_thread(ds: Dataset) -> None:
    def bad(batch: dict[str, Any]) -> dict[str, Any]:
        raise ValueError("decode failed")

    loader = ds.loader(64, prefetch=2, device="cpu", to_device=True, transform=bad, **KW)
    with pytest.raises(ValueError, match="decode failed"):
        next(iter(loader))
    assert loader.state_dict()["step"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_to_device_on_cuda_without_cuda_is_refused_up_front(ds: Dataset) -> None:
    with pytest.raises(ConfigError, match="to_device=True with device='cuda'"):
        ds.loader(64, device="cuda", to_device=True, **KW)
    # Without to_device a CUDA device only asks for pinning, which a CPU build skips.
    assert next(iter(ds.loader(64, device="cuda", **KW)))["x"].device.type == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tools/gpu-check runs it there)")
def test_to_device_on_cuda_gives_the_same_values_ready_on_the_current_stream(ds: Dataset) -> None:
    plain = list(ds.loader(64, **KW))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # the loop's own stream may be any stream
        got = []
        for b in ds.loader(64, device="cuda", to_device=True, **KW):
            assert b["x"].is_cuda
            got.append({k: (v * 1).cpu() if isinstance(v, torch.Tensor) else v for k, v in b.items()})
    assert all(_same(a, b) for a, b in zip(plain, got, strict=True))


def _ids(loader: Any) -> list[list[int]]:
    return [b["id"].tolist() for b in loader]


def _prefetch_threads() -> int:
    return sum(t.name == "sparkdl-prefetch" and t.is_alive() for t in threading.enumerate())


def test_the_next_epoch_is_prepared_while_the_last_one_ends_and_is_the_same(ds: Dataset) -> None:
    made: list[int] = []

    def count(batch: dict[str, Any]) -> dict[str, Any]:
        made.append(int(batch["id"][0]))
        return batch

    loader = ds.loader(32, prefetch=3, transform=count, **KW)
    first = _ids(loader)
    deadline = time.monotonic() + 5
    while len(made) < len(first) + 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    # Epoch 1's first batches are ready before the loop asks for them, and no more than prefetch.
    assert len(first) + 3 <= len(made) <= len(first) + 4
    assert loader.epoch == 1 and loader.step == 0
    second = _ids(loader)
    assert second == _ids(ds.loader(32, epoch=1, prefetch=0, **KW))
    assert second != first
    assert loader.state_dict() == {**ds.loader(32, epoch=2, **KW).state_dict()}
    loader.close()
    deadline = time.monotonic() + 5
    while _prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _prefetch_threads() == 0


@pytest.mark.parametrize("move", ["set_epoch", "load_state_dict"])
def test_moving_elsewhere_after_an_epoch_drops_what_was_prepared(ds: Dataset, move: str) -> None:
    loader = ds.loader(32, prefetch=3, device="cpu", to_device=True, **KW)
    _ids(loader)  # epoch 0 to its end: epoch 1 is being prepared
    if move == "set_epoch":
        loader.set_epoch(3)
        want = _ids(ds.loader(32, epoch=3, prefetch=0, **KW))
    else:
        other = ds.loader(32, prefetch=0, **KW)
        it = iter(other)
        for _ in range(4):
            next(it)
        loader.load_state_dict(other.state_dict())
        want = [b["id"].tolist() for b in it]
    assert _ids(loader) == want
    loader.close()


def test_an_error_while_reading_ahead_is_raised_in_the_next_epoch(ds: Dataset) -> None:
    calls: list[int] = []

    def fail_in_epoch_1(batch: dict[str, Any]) -> dict[str, Any]:
        calls.append(1)
        if len(calls) > steps:  # runs in the prefetch thread, before epoch 1 is asked for
            raise ValueError("bad row in epoch 1")
        return batch

    loader = ds.loader(32, prefetch=2, transform=fail_in_epoch_1, **KW)
    steps = len(loader)
    assert len(_ids(loader)) == steps  # epoch 0 is whole: the failure belongs to epoch 1
    with pytest.raises(ValueError, match="bad row in epoch 1"):
        next(iter(loader))
    assert (loader.epoch, loader.step) == (1, 0)
    loader.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_the_next_epochs_first_window_is_read_while_this_epochs_last_is_served(
        ds: Dataset, workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The last batch of epoch 0 is made only once epoch 1's first window is being read: were that
    # read left until epoch 0 ends (the loop then waits for a whole window at each epoch's
    # start), the batch would wait in vain and fail.
    from sparkdl._internal.data.reading import read as read_module

    reading_next = threading.Event()
    reads: list[int] = []
    real_read_window = read_module.read_window

    def read_window(*args: Any, **kwargs: Any) -> Any:
        reads.append(1)
        if len(reads) == units + 1:  # epoch 1's first
            reading_next.set()
        return real_read_window(*args, **kwargs)

    made: list[int] = []

    def last_waits(batch: dict[str, Any]) -> dict[str, Any]:
        made.append(1)
        if len(made) == steps and not reading_next.wait(5):
            raise AssertionError("epoch 1's first window was not read during epoch 0's last unit")
        return batch

    monkeypatch.setattr(read_module, "read_window", read_window)
    loader = ds.loader(32, prefetch=2, transform=last_waits, workers=workers, **KW)
    steps, units = len(loader), len(loader._source.unit_batches(0, 0))
    assert units > 1
    first, second = _ids(loader), _ids(loader)
    assert first == _ids(ds.loader(32, prefetch=0, **KW))
    assert second == _ids(ds.loader(32, epoch=1, prefetch=0, **KW))
    loader.close()
