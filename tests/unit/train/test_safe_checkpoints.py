"""Checkpoints without Spark run no code unless the user asks (issue 17): a file planted in the
checkpoint directory is refused unrun by ``CheckpointStore.load`` and loads only with the opt-in;
TrainState, as rank 0 of 1 in this process, refuses at save, not at resume, what a weights-only
restore would refuse, and restores a checkpoint of the earlier format only with the opt-in.
TrainState across real ranks, and saved TorchModels, are in tests/integration/test_safe_loading.py.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from resources.safe_loading import Planted, _plain_draws, plant_checkpoint

import sparkdl


class Custom:
    """A user's own class: pickles by reference, so a weights-only load refuses it."""


def test_a_planted_checkpoint_is_refused_unrun_and_loads_only_with_the_opt_in(tmp_path: Path) -> None:
    import torch

    store = sparkdl.CheckpointStore(tmp_path / "ckpt")
    store.save({"global_step": 1, "w": torch.ones(3)})
    marker = tmp_path / "marker"
    # Without a commit record it is no checkpoint: skipped, unread.
    plant_checkpoint(tmp_path / "ckpt", 2, {"global_step": 2, "x": Planted(str(marker))}, record=False)
    assert store.newest_good() == (1, [(2, "it has no commit record (its save stopped before it committed)")])
    assert store.load()["global_step"] == 1 and not marker.exists()
    # With a record that matches it (an attacker can write one too), it is refused by name, unrun.
    plant_checkpoint(tmp_path / "ckpt", 2, {"global_step": 2, "x": Planted(str(marker))})

    with pytest.raises(sparkdl.SparkDLError) as info:
        store.load()
    message = str(info.value)
    assert "ckpt-00000002.pt" in message and "os.makedirs" in message
    assert "weights_only=False" in message and "TrainState(..., weights_only=False)" in message
    assert not marker.exists(), "the planted checkpoint ran code"
    assert torch.equal(store.load(1)["w"], torch.ones(3))  # what sparkdl wrote loads as before

    loaded = store.load(weights_only=False)  # the opt-in unpickles, running the planted code
    assert marker.exists() and loaded == {"global_step": 2, "x": None}


class _Loader:
    """The part of a loader that TrainState uses: a position, and batches from it."""

    def __init__(self, n: int) -> None:
        self.batches, self.epoch, self.step = list(range(n)), 0, 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        while self.step < len(self.batches):
            self.step += 1
            yield self.batches[self.step - 1]
        self.epoch, self.step = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.step = state["epoch"], state["step"]


@pytest.fixture
def one_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """TrainState in this process, as rank 0 of 1 with a checkpoint directory (no collective)."""
    import sparkdl._internal.train.state as state_module
    from sparkdl._internal.rank.context import RunContext

    ckpt = tmp_path / "ckpt"
    ctx = RunContext(rank=0, world_size=1, local_rank=0, local_world_size=1, attempt=0, run_id="t",
                     host="127.0.0.1", backend="torch", gpu_ids=(), use_cuda=False, checkpoint_url=str(ckpt))
    monkeypatch.setattr(state_module, "context", lambda: ctx)
    return ckpt


def test_extra_that_a_weights_only_restore_would_refuse_fails_at_save_not_at_resume(one_rank: Path) -> None:
    import torch

    model = torch.nn.Linear(2, 1)
    state = sparkdl.TrainState(model, None, _Loader(4), extra={"mine": Custom()})
    with pytest.raises(sparkdl.SparkDLError, match=r"Custom.*weights_only=False"):
        state.save()
    assert not one_rank.exists() or not list(one_rank.iterdir()), "a refused checkpoint was written"

    trusting = sparkdl.TrainState(model, None, _Loader(4), extra={"mine": Custom()}, weights_only=False)
    trusting.save()
    with pytest.raises(sparkdl.SparkDLError, match=r"ckpt-00000001\.pt.*Custom"):
        sparkdl.TrainState(model, None, _Loader(4)).restore()
    again = sparkdl.TrainState(model, None, _Loader(4), weights_only=False)
    assert again.restore() and isinstance(again.extra["mine"], Custom)


def test_a_checkpoint_of_the_earlier_format_is_refused_by_default_and_restores_with_the_opt_in(one_rank: Path) -> None:
    import numpy as np
    import torch

    # Earlier versions of sparkdl kept the RNG states as random's tuple, numpy's tuple with an
    # ndarray, and torch's ByteTensor.
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    expected = _plain_draws()
    model = torch.nn.Linear(2, 1)
    ckpt = {"model": model.state_dict(), "optimizer": None, "loader": {"epoch": 0, "step": 2},
            "global_step": 2, "extra": {}, "rng": [old]}
    sparkdl.CheckpointStore(one_rank).save(ckpt)

    with pytest.raises(sparkdl.SparkDLError, match=r"ndarray.*earlier versions of sparkdl kept numpy's RNG state"):
        sparkdl.TrainState(model, None, _Loader(4)).restore()
    state = sparkdl.TrainState(model, None, _Loader(4), weights_only=False)
    assert state.restore() and state.global_step == 2 and state.loader.step == 2
    assert _plain_draws() == expected
