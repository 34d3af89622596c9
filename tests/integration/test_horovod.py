"""backend="horovod": the same gang launch, with code written for horovodrun running unchanged."""

from __future__ import annotations

import sys
from typing import Any

import cloudpickle
import pytest

import sparkdl

pytest.importorskip("horovod.torch")
from resources.horovod_train import CFG, STEPS, rank_data, train_horovod

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.spark


def train_ddp() -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = sparkdl.context()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(5, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = rank_data(ctx.rank)
    for _ in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
        loss.backward()
        opt.step()
    return {"weights": torch.cat([p.detach().flatten() for p in model.parameters()]), "loss": loss.item()}


def test_horovod_and_ddp_converge_to_the_same_weights(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    import torch

    hvd_out = sparkdl.run(train_horovod, num_workers=2, backend="horovod", config=CFG)
    ddp_out = sparkdl.run(train_ddp, num_workers=2, backend="torch", config=CFG)
    assert hvd_out["size"] == 2 and hvd_out["replicas_equal"]
    assert hvd_out["loss"] < 0.01 and ddp_out["loss"] < 0.01
    # Both average gradients over the same shards; only the initial weights differ (rank 0's
    # seed under Horovod vs seed 0 under DDP), so after convergence they agree closely.
    assert torch.allclose(hvd_out["weights"], ddp_out["weights"], atol=2e-2), (hvd_out["weights"], ddp_out["weights"])
    env = hvd_out["env"]
    assert env["HOROVOD_CONTROLLER"] == "gloo" and env["HOROVOD_SIZE"] == "2"
    assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "127.0.0.1"


def test_horovod_code_under_the_torch_backend_fails_naming_the_backend(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    # hvd.init() finds no job of the gang's ranks under backend="torch": each rank would train
    # alone and rank 0's result come back as if all had. hvd.init() fails instead, and the run
    # with it, once (a setting: no rerun).
    with pytest.raises(sparkdl.RunFailedError, match=r"Horovod.s init\(\) was called under backend=.torch.") as info:
        sparkdl.run(train_horovod, num_workers=2, backend="torch", max_attempts=2, config=CFG)
    assert info.value.attempts == 1 and "backend='horovod'" in str(info.value)


@pytest.mark.fault
@pytest.mark.parametrize("how", ["raise", "sigkill"])
def test_a_failed_horovod_rank_reruns_the_gang(spark, no_leaks, how: str) -> None:  # type: ignore[no-untyped-def]
    out = sparkdl.run(train_horovod, 1, how, num_workers=2, backend="horovod", max_attempts=2, config=CFG)
    assert out["attempt"] == 1 and out["replicas_equal"]


@pytest.mark.fault
def test_a_hanging_horovod_rank_is_stopped_by_timeout_s(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    import time

    # Horovod's collectives have no timeout of their own: the run's timeout_s is the bound.
    start = time.monotonic()
    with pytest.raises(sparkdl.RunTimeoutError, match="timeout_s"):
        sparkdl.run(train_horovod, 1, "hang", num_workers=2, backend="horovod", config=CFG.replace(timeout_s=8.0))
    assert time.monotonic() - start < 60
