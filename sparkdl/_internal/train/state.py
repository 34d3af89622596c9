"""The resumable training loop: model, optimizer, loader position and RNG states in checkpoints."""

from __future__ import annotations

import base64
import random
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sparkdl._internal.ckpt import sharded as sharded_ckpt
from sparkdl._internal.ckpt.sharded import all_gather_json
from sparkdl._internal.common.errors import SparkDLError
from sparkdl._internal.common.validate import int_at_least
from sparkdl._internal.fs.storage import redact
from sparkdl._internal.rank.context import context

if TYPE_CHECKING:
    import torch

# RNG states travel between ranks as JSON and sit in checkpoints as plain lists, numbers and
# strings: neither a peer on the network nor a checkpoint file can make this process run code.


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _bytes_tensor(text: str) -> torch.Tensor:
    import torch

    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _rng_state() -> dict[str, Any]:
    """This process's RNG states (Python, numpy, torch, CUDA), as JSON-able values only."""
    import numpy as np
    import torch

    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    keys = np.asarray(keys, dtype=np.uint32)
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "name": name,
            "keys": keys.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    py, npy, cpu, cuda = state["python"], state["numpy"], state["torch"], state.get("cuda")
    if isinstance(py, dict):
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
        keys = np.asarray(npy["keys"], dtype=np.uint32)
        np.random.set_state((npy["name"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
        cpu = _bytes_tensor(cpu)
        cuda = None if cuda is None else [_bytes_tensor(s) for s in cuda]
    else:  # the form of earlier sparkdl versions, reached only with weights_only=False
        random.setstate(py)
        np.random.set_state(npy)
    torch.set_rng_state(cpu)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


class TrainState:
    """The common resumable loop: model, optimizer, epoch, step, loader position and RNG states.

    On creation nothing is read. :meth:`batches` first restores the latest checkpoint of the
    run, when there is one (after a rerun of the gang), then yields the batches that were not yet
    consumed, saving a checkpoint every ``save_every`` steps and at the end of every epoch.
    Every rank must iterate; only rank 0 writes.

    Checkpoints are restored with ``weights_only=True`` (see :meth:`CheckpointStore.load`):
    what ``TrainState`` saves itself (state_dicts, the loader's position, RNG states as plain
    numbers) always loads that way, and a file in the checkpoint directory that holds anything
    else is refused with an error instead of run. ``extra`` must then hold only tensors,
    numbers, strings, ``None`` and lists, tuples and dicts of them; a save that holds anything
    else fails at once, naming it. To keep other objects in ``extra``, pass
    ``weights_only=False``: restoring then unpickles the checkpoint, running any code in it, so
    do it only when nobody else can write to the checkpoint directory.

    A model sharded with FSDP (``fully_shard``) or tensor parallelism (its parameters are
    ``DTensor`` s; ``sharded=None`` finds out) is checkpointed sharded: every rank writes its own
    shards of the model and optimizer (``torch.distributed.checkpoint``), and the checkpoint
    counts once all are written (:mod:`sparkdl._internal.ckpt.sharded`). A run may resume from a
    checkpoint that another number of ranks saved, sharded or not: see :meth:`restore`.

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

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        loader: Any,
        *,
        extra: dict[str, Any] | None = None,
        weights_only: bool = True,
        sharded: bool | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loader = loader
        self.extra: dict[str, Any] = dict(extra or {})
        self.weights_only = weights_only
        self.sharded = sharded_ckpt.is_sharded_module(model) if sharded is None else bool(sharded)
        self.global_step = 0
        self.restored_from: int | None = None

    def _model_and_optimizer(self) -> tuple[Any, Any]:
        if not self.sharded:
            return self.model.state_dict(), self.optimizer.state_dict() if self.optimizer is not None else None
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return get_model_state_dict(self.model), None
        return get_state_dict(self.model, self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds; with ``sharded``, the model's and optimizer's are this rank's shards."""
        model, optimizer = self._model_and_optimizer()
        return {
            "model": model,
            "optimizer": optimizer,
            "loader": self.loader.state_dict(),
            "global_step": self.global_step,
            "extra": self.extra,
            "world_size": context().world_size,
        }

    def save(self) -> None:
        """Saves a checkpoint now: rank 0 writes, or, with ``sharded``, every rank its shards;
        every rank contributes its RNG state."""
        rngs = all_gather_json(_rng_state())
        ctx = context()
        if self.sharded:
            sharded_ckpt.save(ctx.checkpoints, {**self.state_dict(), "rng": rngs}, weights_only=self.weights_only)
        elif ctx.rank == 0:
            ctx.checkpoints.save({**self.state_dict(), "rng": rngs}, weights_only=self.weights_only)

    def restore(self) -> bool:
        """Loads the latest checkpoint of the run, the same one on every rank; False when none.

        A checkpoint saved with another number of ranks loads too: a sharded model and its
        optimizer are resharded, the loader carries on with the rows the old ranks had left
        (:meth:`~sparkdl._internal.data.loader.Loader.load_state_dict`), and each rank below the old
        world size gets its old RNG state back (the others keep theirs).
        """
        ctx = context()
        store = ctx.checkpoints
        seq = sharded_ckpt.latest(store)
        if seq is None:
            return False
        if self.sharded:
            model, optimizer = self._model_and_optimizer()
            ckpt = sharded_ckpt.load(store, seq, {"model": model, "optimizer": optimizer},
                                     weights_only=self.weights_only)
        else:
            ckpt = store.load(seq, weights_only=self.weights_only, sharded_ok=True)
            if isinstance(ckpt, dict) and ckpt.get(sharded_ckpt.SHARDED):
                raise SparkDLError(
                    f"checkpoint {seq} of {redact(store.url)} is sharded, and this TrainState's model is not: "
                    "shard the model as the run that saved it did (fully_shard), before TrainState"
                )
        self._load_model_and_optimizer(ckpt["model"], ckpt["optimizer"])
        self.loader.load_state_dict(ckpt["loader"])
        self.global_step = int(ckpt["global_step"])
        self.extra = ckpt["extra"]
        rngs = ckpt.get("rng") or []
        if len(rngs) > ctx.rank:
            _set_rng_state(rngs[ctx.rank])
        self.restored_from = seq
        saved_size = ckpt.get("world_size", len(rngs))
        size = f", saved by {saved_size} ranks" if saved_size != ctx.world_size else ""
        print(f"sparkdl: resumed from checkpoint {seq} (epoch {self.loader.epoch}, step {self.loader.step}{size})",
              flush=True)
        return True

    def _load_model_and_optimizer(self, model: Any, optimizer: Any) -> None:
        if not self.sharded:
            self.model.load_state_dict(model)
            if self.optimizer is not None and optimizer is not None:
                self.optimizer.load_state_dict(optimizer)
            return
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if self.optimizer is None or optimizer is None:
            set_model_state_dict(self.model, model)
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=model, optim_state_dict=optimizer)

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
                if time.monotonic() - last_report >= 1.0:
                    # Feeds the driver's progress line without the caller doing anything: rank 0's
                    # epoch and step as metrics, the others' steps for the spread and stragglers.
                    last_report = time.monotonic()
                    if ctx.rank == 0:
                        ctx.log_metrics(
                            {"epoch": epoch, "epoch_step": self.loader.step, "steps_per_epoch": len(self.loader)},
                            step=self.global_step,
                        )
                    else:
                        ctx._report_step(self.global_step)
                if save_every and self.global_step % save_every == 0 and self.loader.step < len(self.loader):
                    self.save()
            if self.loader.epoch == epoch:  # an interrupted pass: the loader stays in its epoch
                break
            self.save()
