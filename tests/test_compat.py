"""Code written for Databricks' HorovodRunner and Spark's TorchDistributor runs unchanged on sparkdl."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import sparkdl

cloudpickle.register_pickle_by_value(sys.modules[__name__])
# Spark's own TorchDistributor pickles with pyspark's vendored copy of cloudpickle.
pyspark_cloudpickle = pytest.importorskip("pyspark.cloudpickle")
pyspark_cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.spark
SCRIPT = str(Path(__file__).parent / "resources" / "td_train_script.py")


def hvd_train(lr: float = 0.1) -> dict[str, Any]:
    # As HorovodRunner's documentation shows it.
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.manual_seed(1234)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.ones(4, 3) * (hvd.rank() + 1)
    for _ in range(5):
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    print(f"hvd rank {hvd.rank()} of {hvd.size()} done")
    return {"size": hvd.size(), "weight": model.weight.detach().flatten().tolist()}


@pytest.mark.parametrize("np", [2, -2])
def test_horovod_runner_runs_documented_code(spark, capfd, no_leaks, np: int) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("horovod.torch")
    out = sparkdl.HorovodRunner(np=np).run(hvd_train, lr=0.05)
    assert out["size"] == 2
    printed = capfd.readouterr().out
    assert "[rank 0] hvd rank 0 of 2 done" in printed and "[rank 1] hvd rank 1 of 2 done" in printed
    if np == 2:
        # The same code, the same result on the cluster and on the driver.
        local = sparkdl.HorovodRunner(np=-2).run(hvd_train, lr=0.05)
        assert local["weight"] == pytest.approx(out["weight"], abs=1e-6)


def test_horovod_runner_refuses_np_zero() -> None:
    with pytest.raises(sparkdl.ConfigError, match="np must be a non-zero integer"):
        sparkdl.HorovodRunner(np=0)


def td_train(lr: float) -> list[float]:
    # As written for pyspark.ml.torch.distributor.TorchDistributor.
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    w = torch.zeros(3, requires_grad=True)
    x = torch.arange(6.0).reshape(2, 3) + rank
    for _ in range(10):
        (x @ w - 1.0).pow(2).mean().backward()
        with torch.no_grad():
            dist.all_reduce(w.grad)
            w -= lr * w.grad / dist.get_world_size()
            w.grad.zero_()
    dist.destroy_process_group()
    return w.tolist()


@pytest.mark.parametrize("local_mode", [False, True])
def test_torch_distributor_function_matches_sparks_own(spark, no_leaks, local_mode: bool) -> None:  # type: ignore[no-untyped-def]
    from pyspark.ml.torch.distributor import TorchDistributor as SparkTD

    ours = sparkdl.TorchDistributor(num_processes=2, local_mode=local_mode, use_gpu=False).run(td_train, 0.05)
    theirs = SparkTD(num_processes=2, local_mode=local_mode, use_gpu=False).run(td_train, 0.05)
    assert ours == pytest.approx(theirs, abs=1e-7)


@pytest.mark.parametrize("local_mode", [False, True])
def test_torch_distributor_script_matches_sparks_own(spark, tmp_path, no_leaks, local_mode: bool) -> None:  # type: ignore[no-untyped-def]
    from pyspark.ml.torch.distributor import TorchDistributor as SparkTD

    ours_out, theirs_out = tmp_path / "ours.json", tmp_path / "theirs.json"
    assert sparkdl.TorchDistributor(num_processes=2, local_mode=local_mode, use_gpu=False).run(
        SCRIPT, "--out", str(ours_out), "--lr", "0.05") is None
    SparkTD(num_processes=2, local_mode=local_mode, use_gpu=False).run(SCRIPT, "--out", str(theirs_out), "--lr", "0.05")
    ours, theirs = json.loads(ours_out.read_text()), json.loads(theirs_out.read_text())
    assert ours["world"] == theirs["world"] == 2
    assert ours["w"] == pytest.approx(theirs["w"], abs=1e-7)


def test_torch_distributor_defaults_to_gpus_like_sparks(spark) -> None:  # type: ignore[no-untyped-def]
    # Spark's class defaults to use_gpu=True; without GPU confs both refuse, naming the conf.
    with pytest.raises(sparkdl.ConfigError, match=r"spark\.task\.resource\.gpu\.amount"):
        sparkdl.TorchDistributor(num_processes=2, local_mode=False).run(td_train, 0.1)
    with pytest.raises(sparkdl.ConfigError, match=r"spark\.driver\.resource\.gpu\.amount"):
        sparkdl.TorchDistributor(num_processes=2).run(td_train, 0.1)


def fails_on_rank_1() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("rank 1 is broken")
    dist.barrier()


def test_local_mode_failure_gives_the_report_and_leaves_nothing(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(sparkdl.RunFailedError, match=r"Root cause: attempt 0, rank 1 .*ValueError: rank 1 is broken"):
        sparkdl.TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(fails_on_rank_1)
