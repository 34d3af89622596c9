"""What each rank of ``TorchEstimator.fit`` runs: the model, the loss, the optimizer and the epoch loop.

:func:`train_on_rank` is the function :func:`sparkdl.run` ships to every rank: DDP over the rank's
shard of the written dataset, driven by :class:`sparkdl.TrainState`, so a gang rerun resumes from
the last checkpoint, history included. Every epoch's metrics are reduced over all ranks with
``all_reduce``, and rank 0 prints one line per epoch (relayed to the driver). The smaller helpers (:func:`instantiate`,
:func:`loss_function`, :func:`make_optimizer`, ...) are also what the driver's probe runs, so the
probe tries the model exactly as the ranks will train it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.ml.fit_plan import CLASSIFICATION, FitPlan

if TYPE_CHECKING:
    import torch

    from sparkdl._internal.data.dataset import Dataset

__all__ = [
    "aligned",
    "input_dtype",
    "instantiate",
    "label_tensor",
    "loss_function",
    "make_optimizer",
    "model_input",
    "train_on_rank",
]


def instantiate(model: Any, seed: int) -> torch.nn.Module:
    """A fresh module: the factory's product, or a copy of the given module (never the user's object)."""
    import cloudpickle
    import torch

    torch.manual_seed(seed)
    if isinstance(model, torch.nn.Module):
        return cast("torch.nn.Module", cloudpickle.loads(cloudpickle.dumps(model)))
    module = model()
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"the model factory returned {type(module).__name__}; it must return a torch.nn.Module")
    return module


def input_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype the module computes in: that of its first floating parameter (float32 without one)."""
    import torch

    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def model_input(x: torch.Tensor, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """Features as the model takes them: ``dtype`` on ``device``; ``uint8`` (decoded images)
    scaled to [0, 1] there, so that bytes cross to the GPU as bytes."""
    import torch

    if x.dtype == torch.uint8:
        return x.to(device=device).to(dtype).div_(255)
    return x.to(device=device, dtype=dtype)


def loss_function(loss: Any) -> Callable[..., torch.Tensor]:
    """The torch function of a named loss, or the user's callable as it is."""
    import torch.nn.functional as F

    if not isinstance(loss, str):
        return cast("Callable[..., torch.Tensor]", loss)
    return cast(
        "Callable[..., torch.Tensor]",
        {
            "cross_entropy": F.cross_entropy,
            "nll": F.nll_loss,
            "bce_with_logits": F.binary_cross_entropy_with_logits,
            "mse": F.mse_loss,
            "l1": F.l1_loss,
            "smooth_l1": F.smooth_l1_loss,
            "huber": F.huber_loss,
        }[loss],
    )


def label_tensor(values: Sequence[Any], plan: FitPlan, dtype: torch.dtype) -> torch.Tensor:
    """Collected label values as a tensor: int64 class indices, or ``dtype`` for everything else."""
    import torch

    if plan.class_index_labels:
        return torch.tensor(values, dtype=torch.int64)
    return torch.tensor(values, dtype=dtype)


def aligned(out: torch.Tensor, y: torch.Tensor, plan: FitPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and label as the loss takes them.

    A named loss on one value per row gets both as ``(N,)``: an ``(N, 1)`` output against an
    ``(N,)`` label would otherwise broadcast to ``(N, N)`` in mse and silently train on nonsense.
    A callable loss gets them as they are.
    """
    if isinstance(plan.loss, str) and y.dim() == 1 and out.dim() == 2 and out.shape[1] == 1:
        out = out.squeeze(1)
    return out, y


def make_optimizer(plan: FitPlan, params: Any) -> Any:
    """The plan's optimizer over ``params``: a named one with the learning rate, or the factory's."""
    import torch

    if not isinstance(plan.optimizer, str):
        return plan.optimizer(params)
    if plan.optimizer == "adam":
        return torch.optim.Adam(params, lr=plan.learning_rate)
    if plan.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=plan.learning_rate)
    return torch.optim.SGD(params, lr=plan.learning_rate, momentum=0.9)


def _correct(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """How many rows of a batch the model classifies right (for the accuracy metric)."""
    if out.dim() == 1 or out.shape[-1] == 1:
        return ((out.reshape(-1) > 0) == (y.reshape(-1) > 0.5)).sum()
    return (out.argmax(dim=-1) == y).sum()


def train_on_rank(plan: FitPlan, train_ds: Dataset, val_ds: Dataset | None) -> dict[str, Any] | None:
    """The function every rank runs: DDP over this rank's shard, resumable through TrainState.

    Rank 0 returns the trained ``state_dict`` (on the CPU) and the history; the others None.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sparkdl._internal.rank.context import context
    from sparkdl._internal.train.state import TrainState

    ctx = context()
    device = ctx.device
    module = instantiate(plan.model, plan.seed).to(device)
    dtype = input_dtype(module)
    # DDP broadcasts rank 0's initial weights, so every replica starts alike even from a factory.
    net = DistributedDataParallel(module) if dist.is_initialized() else module
    optimizer = make_optimizer(plan, net.parameters())
    loss_fn = loss_function(plan.loss)
    # Full batches keep every step's gradient on the same number of rows. Only data smaller than
    # one batch per rank keeps its partial batch (the loader then repeats a few rows instead).
    drop_last = train_ds.num_rows >= ctx.world_size * plan.batch_size
    decode = {"x": plan.decoder} if plan.decoder is not None else None
    loader = train_ds.loader(plan.batch_size, seed=plan.seed, columns=["x", "y"], drop_last=drop_last, device=device,
                             decode=decode)
    val_decode = {"x": plan.eval_decoder} if plan.eval_decoder is not None else None
    val_loader = (
        val_ds.loader(plan.batch_size, shuffle=False, columns=["x", "y"], device=device, decode=val_decode)
        if val_ds is not None
        else None
    )
    # The history lives in the checkpoint (TrainState.extra), so a rerun resumes it too.
    state = TrainState(module, optimizer, loader, extra={"history": []})
    # Loss sum and row count of this epoch on this rank; an epoch resumed mid-way counts the
    # batches run since the resume.
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    started = time.monotonic()
    for batch in state.batches(epochs=plan.epochs, save_every=plan.checkpoint_every or None):
        x = model_input(batch["x"], device, dtype)
        y = batch["y"]
        y = y.to(device=device, dtype=dtype) if y.is_floating_point() else y.to(device)
        out, target = aligned(net(x), y, plan)
        loss = loss_fn(out, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        sums[0] += loss.detach().to(torch.float64) * len(y)
        sums[1] += len(y)
        if loader.step == len(loader):
            # The epoch's last batch: record its metrics now, so that the checkpoint TrainState
            # writes at the end of the epoch (before the next batch) holds them.
            record = _epoch_record(loader.epoch + 1, sums, module, val_loader, loss_fn, plan, device, dtype)
            record["seconds"] = round(time.monotonic() - started, 3)
            state.extra["history"].append(record)
            if ctx.rank == 0:
                # A print, not a log record: the driver relays each rank's stdout with its rank tag.
                print(_format_record(record, plan.epochs), flush=True)
            sums.zero_()
            started = time.monotonic()
    if ctx.rank != 0:
        return None
    return {
        "state_dict": {k: v.detach().cpu() for k, v in module.state_dict().items()},
        "history": list(state.extra["history"]),
    }


def _epoch_record(
    epoch: int,
    sums: torch.Tensor,
    module: torch.nn.Module,
    val_loader: Any,
    loss_fn: Callable[..., torch.Tensor],
    plan: FitPlan,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """This epoch's metrics, reduced over all ranks (every rank calls it at the same step)."""
    import torch
    import torch.distributed as dist

    totals = torch.zeros(5, dtype=torch.float64, device=device)
    totals[:2] = sums
    if val_loader is not None:
        was_training = module.training
        module.eval()
        with torch.no_grad():
            for batch in val_loader:
                x = model_input(batch["x"], device, dtype)
                y = batch["y"]
                y = y.to(device=device, dtype=dtype) if y.is_floating_point() else y.to(device)
                out, target = aligned(module(x), y, plan)
                n = float(len(y))
                totals[2] += float(loss_fn(out, target)) * n
                totals[3] += n
                if plan.task == CLASSIFICATION:
                    totals[4] += float(_correct(out, target))
        module.train(was_training)
    if dist.is_initialized():
        dist.all_reduce(totals)
    t = totals.tolist()
    record: dict[str, Any] = {"epoch": epoch, "train_loss": t[0] / max(t[1], 1.0), "train_rows": int(t[1])}
    if val_loader is not None:
        record["val_loss"] = t[2] / max(t[3], 1.0)
        if plan.task == CLASSIFICATION:
            record["val_accuracy"] = t[4] / max(t[3], 1.0)
    return record


def _format_record(record: Mapping[str, Any], epochs: int) -> str:
    parts = [f"epoch {record['epoch']}/{epochs}", f"train_loss {record['train_loss']:.4f}"]
    if "val_loss" in record:
        parts.append(f"val_loss {record['val_loss']:.4f}")
    if "val_accuracy" in record:
        parts.append(f"val_accuracy {record['val_accuracy']:.4f}")
    parts.append(f"{record.get('seconds', 0.0):.1f} s")
    return ", ".join(parts)
