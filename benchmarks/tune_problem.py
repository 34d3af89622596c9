"""The search problem of ``bench_tune.py``, the same for sparkdl and for Ray: no import of
either here, only torch and torch.distributed (a process group already formed by the launcher).

A linear regression (32 features) trained with SGD on data split over the ranks, gradients
averaged with an allreduce every step. Its loss after training depends on the learning rate in a
known way: too small learns slowly, too large (above ~0.3 here) diverges, best near 0.1. Each
step also waits ``step_s`` seconds, standing in for the step of a model on an accelerator: on
this 2-core machine, trials that run at once do not fight over the CPU for their (tiny) compute,
as on a cluster each gang has its own executors. Each epoch reports the loss.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

FEATURES, ROWS, BATCH = 32, 2048, 128


def train(lr: float, epochs: int, steps_per_epoch: int, step_s: float, start_epoch: int,
          report: Callable[[float, int], bool]) -> dict[str, float]:
    """Trains from ``start_epoch``; ``report(loss, epoch)`` True stops (pruned). Returns the last
    loss, the epochs run and the time spent training (what is not launch overhead)."""
    import torch
    import torch.distributed as dist

    began = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    true_w = torch.randn(FEATURES, 1, generator=gen)
    x = torch.randn(ROWS, FEATURES, generator=gen)
    y = x @ true_w + 0.1 * torch.randn(ROWS, 1, generator=gen)
    x, y = x[rank::world], y[rank::world]
    w = torch.zeros(FEATURES, 1, requires_grad=True)
    loss_value, ran = math.inf, 0
    for epoch in range(start_epoch, epochs):
        for step in range(steps_per_epoch):
            lo = (step * BATCH) % len(x)
            loss = ((x[lo:lo + BATCH] @ w - y[lo:lo + BATCH]) ** 2).mean()
            w.grad = None
            loss.backward()
            assert w.grad is not None
            dist.all_reduce(w.grad)
            with torch.no_grad():
                w -= lr * w.grad / world
            time.sleep(step_s)
        with torch.no_grad():
            full = torch.tensor([((x @ w - y) ** 2).mean().item()])
        dist.all_reduce(full)
        loss_value = min(full.item() / world, 1e6)  # a diverged run reports a large finite loss
        ran += 1
        if report(loss_value, epoch):
            break
    return {"loss": loss_value, "epochs": ran, "train_s": time.perf_counter() - began}


def learning_rates(n: int) -> list[float]:
    """``n`` learning rates on a log grid from 1e-3 to 1, in a fixed shuffled order (so that a
    pruner sees good and bad trials early, as a sampler would give them)."""
    grid = [10 ** (-3 + 3 * i / (n - 1)) for i in range(n)]
    order = sorted(range(n), key=lambda i: (i * 5) % n)
    return [grid[i] for i in order]
