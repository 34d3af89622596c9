"""The resumable training loop: model, optimizer, loader position and RNG states in checkpoints."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

from sparkdl._validate import int_at_least
from sparkdl.rank.context import context


def _rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _all_gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any) -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class TrainState:
    """The common resumable loop: model, optimizer, epoch, step, loader position and RNG states.

    On creation nothing is read. :meth:`batches` first restores the latest checkpoint of the
    run, when there is one (after a rerun of the gang), then yields the batches that were not yet
    consumed, saving a checkpoint every ``save_every`` steps and at the end of every epoch.
    Every rank must iterate; only rank 0 writes.

    Example::

        def train(ds):
            ctx = sparkdl.context()
            model = DDP(Net())
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            state = sparkdl.TrainState(model, opt, ds.loader(64, seed=0))
            for batch in state.batches(epochs=10, save_every=50):
                loss = loss_fn(model(batch["x"]), batch["y"])
                opt.zero_grad(); loss.backward(); opt.step()
            return model.module.state_dict()
    """

    def __init__(self, model: Any, optimizer: Any, loader: Any, *, extra: dict[str, Any] | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loader = loader
        self.extra: dict[str, Any] = dict(extra or {})
        self.global_step = 0
        self.restored_from: int | None = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "loader": self.loader.state_dict(),
            "global_step": self.global_step,
            "extra": self.extra,
        }

    def save(self) -> None:
        """Saves a checkpoint now (rank 0 writes; every rank contributes its RNG state)."""
        rngs = _all_gather(_rng_state())
        ctx = context()
        if ctx.rank == 0:
            ctx.save_checkpoint({**self.state_dict(), "rng": rngs})

    def restore(self) -> bool:
        """Loads the latest checkpoint of the run, the same one on every rank; False when none."""
        ctx = context()
        store = ctx.checkpoints
        seq = _broadcast(store.latest() if ctx.rank == 0 else None)
        if seq is None:
            return False
        ckpt = store.load(seq)
        self.model.load_state_dict(ckpt["model"])
        if self.optimizer is not None and ckpt["optimizer"] is not None:
            self.optimizer.load_state_dict(ckpt["optimizer"])
        self.loader.load_state_dict(ckpt["loader"])
        self.global_step = int(ckpt["global_step"])
        self.extra = ckpt["extra"]
        rngs = ckpt.get("rng") or []
        if len(rngs) > ctx.rank:
            _set_rng_state(rngs[ctx.rank])
        self.restored_from = seq
        print(f"sparkdl: resumed from checkpoint {seq} (epoch {self.loader.epoch}, step {self.loader.step})", flush=True)
        return True

    def batches(self, epochs: int, *, save_every: int | None = None) -> Iterator[Any]:
        """Yields the remaining batches of ``epochs`` epochs, checkpointing as it goes."""
        int_at_least("save_every", save_every, 1, allow_none=True)
        ctx = context()
        self.restore()
        last_report = 0.0
        while self.loader.epoch < epochs:
            epoch = self.loader.epoch
            for batch in self.loader:
                yield batch
                # Control is back: the caller finished its step on this batch.
                self.global_step += 1
                if ctx.rank == 0 and time.monotonic() - last_report >= 1.0:
                    # Feeds the driver's progress line without the caller doing anything.
                    last_report = time.monotonic()
                    ctx.log_metrics(
                        {"epoch": epoch, "epoch_step": self.loader.step, "steps_per_epoch": len(self.loader)},
                        step=self.global_step,
                    )
                if save_every and self.global_step % save_every == 0 and self.loader.step < len(self.loader):
                    self.save()
            if self.loader.epoch == epoch:  # an interrupted pass: the loader stays in its epoch
                break
            self.save()
