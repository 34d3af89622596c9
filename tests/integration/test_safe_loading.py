"""Nothing sparkdl loads runs code unless the user asks (issue 17).

Checkpoints are restored with ``weights_only=True``: a file planted in the checkpoint directory
whose unpickling would create a marker file is refused with an error naming it and the opt-in,
and the marker stays absent. TrainState's own checkpoints load that way, RNG states included,
and cross ranks as tensors, never as pickles. A saved TorchModel (whose loading does run code)
is refused when another user owns its files or others may write them, unless the user opts in.
Here on Spark; the checkpoint store and TrainState in this process, without Spark, are in
tests/unit/train/test_safe_checkpoints.py.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
from resources.safe_loading import Planted, _plain_draws, plant_checkpoint

import sparkdl

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CFG = sparkdl.RunConfig(start_timeout_s=90, slot_wait_s=30, collective_timeout_s=10.0, timeout_s=240)
BATCH = 8


# -- TrainState across two real ranks ----------------------------------------------------------


@pytest.fixture(scope="module")
def dataset(spark, tmp_path_factory):  # type: ignore[no-untyped-def]
    rng = random.Random(7)
    rows = [(i, [rng.uniform(-1, 1) for _ in range(4)], rng.uniform(-1, 1)) for i in range(96)]
    df = spark.createDataFrame(rows, "id long, x array<float>, y double")
    return sparkdl.write_dataset(df, str(tmp_path_factory.mktemp("safe") / "data"), num_files=2)


def _refuse_pickled_collectives() -> None:
    """Any call of torch.distributed's object collectives (which unpickle what peers send) fails."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def refused(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a collective that unpickles what peers send was called")

    for name in ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"):
        setattr(dist, name, refused)
        setattr(c10d, name, refused)


def _setup(ds: sparkdl.Dataset, seed: int) -> tuple[Any, Any, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)
    model = DDP(torch.nn.Linear(4, 1))  # the ranks keep equal weights, as training does
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, ds.loader(BATCH, shuffle=True, seed=1, drop_last=True)


def _step(model: Any, opt: Any, batch: dict[str, Any]) -> None:
    import torch

    loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(1), batch["y"].float())
    opt.zero_grad()
    loss.backward()
    opt.step()


def round_trip(ds: sparkdl.Dataset) -> dict[str, Any]:
    """Saves after 3 steps, scrambles everything, restores, and compares, on every rank."""
    import copy

    import numpy as np
    import torch

    _refuse_pickled_collectives()
    ctx = sparkdl.context()
    model, opt, loader = _setup(ds, 0)
    random.seed(100 + ctx.rank)  # every rank draws from RNGs of its own
    np.random.seed(200 + ctx.rank)
    torch.manual_seed(300 + ctx.rank)
    random.gauss(0, 1)  # both Gaussian samplers keep a cached second value: part of the state
    np.random.standard_normal()
    state = sparkdl.TrainState(model, opt, loader, extra={"note": "kept", "n": [1, 2.5, None]})
    for batch in state.batches(epochs=1, save_every=3):
        if state.global_step == 3:  # the checkpoint of step 3 was just saved: snapshot and stop
            saved = (_plain_draws(), copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), batch)
            break
        _step(model, opt, batch)

    random.seed(999)
    np.random.seed(999)
    model2, opt2, loader2 = _setup(ds, 999)
    torch.manual_seed(999)
    state2 = sparkdl.TrainState(model2, opt2, loader2)
    first = next(iter(state2.batches(epochs=1)))
    draws, weights, opt_state, batch = saved
    assert state2.restored_from is not None and state2.global_step == 3 and state2.extra["note"] == "kept"
    assert _plain_draws() == draws, f"rank {ctx.rank}: RNG draws after the restore differ from those after the save"
    for key, value in weights.items():
        assert torch.equal(model2.state_dict()[key], value), key
    buffers = [s["momentum_buffer"] for s in opt2.state_dict()["state"].values()]
    assert len(buffers) == 2 and all(
        torch.equal(b, s["momentum_buffer"]) for b, s in zip(buffers, opt_state["state"].values(), strict=True)
    )
    assert torch.equal(first["x"], batch["x"]), "the restored loader does not resume at the next batch"
    rngs = ctx.load_checkpoint()["rng"]  # the default, weights-only load
    return {"rank": ctx.rank, "draws": draws, "rngs": rngs, "extra": state2.extra}


def test_trainstate_round_trip_on_two_ranks_restores_everything_without_pickled_collectives(  # type: ignore[no-untyped-def]
    spark, dataset, tmp_path, no_leaks
) -> None:
    out = sparkdl.run(round_trip, dataset, num_workers=2, max_attempts=1, config=CFG,
                      checkpoint_dir=str(tmp_path / "ckpt"))
    assert out["rank"] == 0 and out["extra"] == {"note": "kept", "n": [1, 2.5, None]}
    # Each rank seeded its RNGs with its own seeds, and each found its own draws again after the
    # restore: the checkpoint holds one state per rank, in rank order, in plain values.
    rngs = out["rngs"]
    assert len(rngs) == 2 and rngs[0] != rngs[1], "the per-rank RNG states were not gathered"
    for saved in rngs:
        assert set(saved) == {"python", "numpy", "torch"}
        assert isinstance(saved["torch"], str) and isinstance(saved["numpy"]["keys"], list)


# -- TrainState restoring a planted checkpoint, in a real run ----------------------------------


def resume(ds: sparkdl.Dataset, weights_only: bool) -> dict[str, Any]:
    model, opt, loader = _setup(ds, 0)
    state = sparkdl.TrainState(model, opt, loader, weights_only=weights_only)
    for batch in state.batches(epochs=1):
        _step(model, opt, batch)
    return {"restored_from": state.restored_from, "extra": sorted(state.extra)}


def test_a_checkpoint_another_user_planted_is_not_run_on_restore_unless_opted_in(  # type: ignore[no-untyped-def]
    spark, dataset, tmp_path, other_user, no_leaks
) -> None:
    import torch

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    marker = tmp_path / "marker"
    net = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    planted = {
        "model": {f"module.{k}": v for k, v in net.state_dict().items()}, "optimizer": opt.state_dict(),
        "loader": dataset.loader(BATCH, shuffle=True, seed=1, drop_last=True, rank=0, world_size=2).state_dict(),
        "global_step": 0, "extra": {"payload": Planted(str(marker))}, "rng": [],
    }
    plant_checkpoint(ckpt, 1, planted)
    for path in (ckpt, ckpt / "ckpt-00000001.pt", ckpt / "ckpt-00000001.json"):
        os.chown(path, other_user.uid, other_user.gid)

    with pytest.raises(sparkdl.RunFailedError) as info:
        sparkdl.run(resume, dataset, True, num_workers=2, max_attempts=1, config=CFG, checkpoint_dir=str(ckpt))
    report = str(info.value)
    assert "SparkDLError" in report and "ckpt-00000001.pt" in report and "os.makedirs" in report
    assert "weights_only=False" in report
    assert not marker.exists(), "restoring ran code from the planted checkpoint"

    out = sparkdl.run(resume, dataset, False, num_workers=2, max_attempts=1, config=CFG, checkpoint_dir=str(ckpt))
    assert marker.exists() and out == {"restored_from": 1, "extra": ["payload"]}


# -- TorchModel ----------------------------------------------------------------------------------


def _save_model(path: Path, module: Any) -> None:
    sparkdl.TorchModel(model=module, featuresCol="x", task="regression").save(str(path))


def test_a_torchmodel_writable_by_others_is_refused_and_loads_with_the_opt_in(spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch
    from pyspark.ml import Pipeline, PipelineModel

    net = torch.nn.Linear(3, 1)
    path = tmp_path / "model"
    _save_model(path, net)
    loaded = sparkdl.TorchModel.load(str(path))  # own files, not writable by others: loads
    assert torch.equal(loaded.getModule().weight, net.weight)

    data_file = next(p for p in (path / "data").iterdir() if p.name.endswith(".parquet"))
    data_file.chmod(0o666)
    for url in (str(path), path.as_uri()):
        with pytest.raises(sparkdl.ConfigError) as info:
            sparkdl.TorchModel.load(url)
        message = str(info.value)
        assert url in message and str(data_file) in message and "writable by other users (mode 666)" in message
        assert "TorchModel.load(path, trusted=True)" in message and "spark.sparkdl.ml.trustSavedModels=true" in message
    assert torch.equal(sparkdl.TorchModel.load(str(path), trusted=True).getModule().weight, net.weight)

    # Inside a PipelineModel, Spark loads the stage itself: the Spark conf is the opt-in.
    pipe = tmp_path / "pipe"
    Pipeline(stages=[loaded]).fit(spark.range(1)).save(str(pipe))
    stage_dir = next((pipe / "stages").iterdir())
    (stage_dir / "metadata").chmod(0o777)
    with pytest.raises(sparkdl.ConfigError, match="writable by other users"):
        PipelineModel.load(str(pipe))
    spark.conf.set("spark.sparkdl.ml.trustSavedModels", "true")
    try:
        assert isinstance(PipelineModel.load(str(pipe)).stages[0], sparkdl.TorchModel)
    finally:
        spark.conf.unset("spark.sparkdl.ml.trustSavedModels")


def test_a_planted_torchmodel_of_another_user_is_refused_before_its_code_runs(spark, tmp_path, other_user) -> None:  # type: ignore[no-untyped-def]
    import torch

    class PlantedModule(torch.nn.Module):
        def __init__(self, marker: str) -> None:
            super().__init__()
            self.marker = marker

        def __reduce__(self) -> tuple[Any, ...]:
            return (os.makedirs, (self.marker, 0o777, True))

    marker = tmp_path / "marker"
    path = tmp_path / "model"
    _save_model(path, PlantedModule(str(marker)))
    for root, dirs, files in os.walk(path):
        for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
            os.chown(name, other_user.uid, other_user.gid)

    with pytest.raises(sparkdl.ConfigError, match=rf"belongs to uid {other_user.uid}, not to this user"):
        sparkdl.TorchModel.load(str(path))
    assert not marker.exists()

    model = sparkdl.TorchModel.load(str(path), trusted=True)  # the user vouches for it: its code runs
    with pytest.raises(AttributeError):
        model.getModule()  # unpickling created the marker (and gave None, which is no module)
    assert marker.exists()
