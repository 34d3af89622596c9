"""A checkpoint directory that some host of the gang does not share (sparkdl._internal.spark.reach): with the
default run directory the run goes on, and every way of saving a checkpoint is refused with the
message, before anything is written; reading works (it finds nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sparkdl
from sparkdl._internal.ckpt.store import CheckpointStore
from sparkdl._internal.rank.context import context
from sparkdl._internal.wire import rankspec

WHY = "sparkdl: this checkpoint was not saved: the checkpoint directory /x is not shared"


def test_a_refused_store_writes_nothing_and_reads_as_empty(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt", keep=2, refused=WHY)
    for save in (lambda: store.save({"w": torch.ones(2)}), lambda: store.commit(1, {"w": 1}),
                 lambda: store.child("rank-1").save({"w": 1})):
        with pytest.raises(sparkdl.ConfigError, match="not shared"):
            save()
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").rglob("*"))
    assert store.load() is None and store.latest() is None
    assert store.child("rank-1").refused == WHY and store.child("rank-1").keep == 2


def test_the_rank_context_refuses_every_save_the_gang_was_told_to_refuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = rankspec.RunSpec(run_id="r", world_size=1, backend="torch", use_gpu=False,
                           checkpoint_url=str(tmp_path / "ckpt"), config=sparkdl.RunConfig())
    spec = rankspec.RankSpec.of(run, rank=0, host="127.0.0.1", gpu_ids=[], task_pid=1)
    gang = rankspec.GangSpec.form(spec, attempt=0, hosts=["127.0.0.1"], master_port=1, checkpoints_refused=WHY)
    for key, value in {**rankspec.rank_env(spec), **rankspec.gang_env(spec, gang)}.items():
        monkeypatch.setenv(key, value)
    ctx = context()
    assert ctx.checkpoints_refused == WHY
    for save in (lambda: ctx.save_checkpoint({"w": 1}), lambda: ctx.save_checkpoint({"w": 1}, all_ranks=True)):
        with pytest.raises(sparkdl.ConfigError, match="this checkpoint was not saved"):
            save()
    assert ctx.load_checkpoint() is None
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").rglob("ckpt-*"))
    # A gang whose every host sees the directory is told nothing, and saves.
    monkeypatch.delenv(rankspec.PREFIX + "CHECKPOINTS_REFUSED")
    assert context().save_checkpoint({"w": 1}) == 1
