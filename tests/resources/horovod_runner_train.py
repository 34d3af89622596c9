"""The training function of the HorovodRunner tests (tests/integration/test_compat.py, and the
signature checks of tests/unit/compat/test_compat_signatures.py), written as HorovodRunner's
documentation shows it. Registered to be pickled by value, so the ranks need not import it."""

from __future__ import annotations

import sys
from typing import Any

import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])


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
