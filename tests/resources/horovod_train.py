"""The training function of the Horovod tests (tests/integration/test_horovod.py and
tests/cluster/test_horovod_mpi.py), written exactly as for horovodrun. Registered to be pickled by
value, so the ranks need not import it."""

from __future__ import annotations

import os
import sys
from typing import Any

import cloudpickle

import sparkdl

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CFG = sparkdl.RunConfig(start_timeout_s=90, slot_wait_s=10, collective_timeout_s=20)
STEPS = 60


def rank_data(rank: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(64, 5, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0]) + 0.7
    return x, y


def train_horovod(fail_rank: int | None = None, how: str = "raise") -> dict[str, Any]:
    # Written exactly as for horovodrun: hvd.init, broadcast_parameters, DistributedOptimizer.
    import horovod.torch as hvd
    import torch

    hvd.init()
    if fail_rank is not None and hvd.rank() == fail_rank and sparkdl.context().attempt == 0:
        if how == "sigkill":
            os.kill(os.getpid(), 9)
        if how == "hang":
            import time

            time.sleep(3600)
        raise RuntimeError("injected failure under horovod")
    torch.manual_seed(hvd.rank())  # different on purpose: broadcast_parameters must fix it
    model = torch.nn.Linear(5, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    x, y = rank_data(hvd.rank())
    for _ in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
        loss.backward()
        opt.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = hvd.allgather(weights.unsqueeze(0))
    return {
        "weights": weights,
        "replicas_equal": bool(torch.allclose(gathered[0], gathered[1])),
        "size": hvd.size(),
        "loss": loss.item(),
        "attempt": sparkdl.context().attempt,
        "env": {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")},
    }
