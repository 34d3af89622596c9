"""The resumable training loop: model, optimizer, loader position and RNG states in checkpoints."""

from __future__ import annotations

import base64
import json
import random
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sparkdl._validate import int_at_least
from sparkdl.rank.context import context

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


def _collective_device() -> torch.device:
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend())
    # sparkdl's own group on GPUs is "cpu:gloo,cuda:nccl"; only a group of the user's that is
    # NCCL alone needs the tensors on the GPU.
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_gather_json(obj: Any) -> list[Any]:
    """``obj`` (JSON-able) of every rank, in rank order: lengths first, then the padded bytes."""
    import torch
    import torch.distributed as dist

    if not _distributed():
        return [obj]
    device = _collective_device()
    data = json.dumps(obj, separators=(",", ":")).encode()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(dist.get_world_size())]
    dist.all_gather(lengths, length)
    sizes = [int(n.item()) for n in lengths]
    mine = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    out = [torch.empty_like(mine) for _ in sizes]
    dist.all_gather(out, mine)
    return [json.loads(t[:n].cpu().numpy().tobytes()) for t, n in zip(out, sizes, strict=True)]


def _broadcast_seq(seq: int | None) -> int | None:
    """Rank 0's checkpoint sequence number (or None), on every rank."""
    import torch
    import torch.distributed as dist

    if not _distributed():
        return seq
    box = torch.tensor([-1 if seq is None else seq], dtype=torch.int64, device=_collective_device())
    dist.broadcast(box, src=0)
    value = int(box.item())
    return None if value < 0 else value


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
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loader = loader
        self.extra: dict[str, Any] = dict(extra or {})
        self.weights_only = weights_only
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
        rngs = _all_gather_json(_rng_state())
        ctx = context()
        if ctx.rank == 0:
            ctx.checkpoints.save({**self.state_dict(), "rng": rngs}, weights_only=self.weights_only)

    def restore(self) -> bool:
        """Loads the latest checkpoint of the run, the same one on every rank; False when none."""
        ctx = context()
        store = ctx.checkpoints
        seq = _broadcast_seq(store.latest() if ctx.rank == 0 else None)
        if seq is None:
            return False
        ckpt = store.load(seq, weights_only=self.weights_only)
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
