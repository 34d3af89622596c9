"""Checkpoints on shared storage, and the resumable training loop built on them.

A checkpoint is one file, ``ckpt-<seq>.pt`` (``torch.save`` format), in the run's checkpoint
directory, which may be a local or shared path or any URL pyarrow/fsspec reach. It is written to
a temporary name and moved into place, so a crash in the middle of a write leaves the previous
checkpoint the latest complete one. Only complete files count; the last ``keep`` are kept.
"""

from __future__ import annotations

import io
import os
import posixpath
import random
import re
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sparkdl.errors import ConfigError

if TYPE_CHECKING:
    import pyarrow.fs as pafs

_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")


class CheckpointStore:
    """The checkpoints of one run. Plain and picklable: the URL and ``keep`` are all it holds."""

    def __init__(self, url: str | os.PathLike[str], keep: int = 3) -> None:
        from sparkdl.dataset import _normalize_url

        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep_checkpoints must be an integer >= 1; got {keep!r}")
        self.url = _normalize_url(url)
        self.keep = keep

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r}, keep={self.keep})"

    def _fs(self) -> tuple[pafs.FileSystem, str]:
        from sparkdl.dataset import _filesystem

        return _filesystem(self.url, None)

    def sequence_numbers(self) -> list[int]:
        """Sequence numbers of the complete checkpoints, oldest first."""
        import pyarrow.fs as pafs

        fs, root = self._fs()
        infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
        found = []
        for info in infos:
            match = _NAME.match(posixpath.basename(info.path))
            if match and info.type == pafs.FileType.File:
                found.append(int(match.group(1)))
        return sorted(found)

    def latest(self) -> int | None:
        seqs = self.sequence_numbers()
        return seqs[-1] if seqs else None

    def save(self, obj: Any) -> int:
        """Writes ``obj`` as the next checkpoint, atomically; returns its sequence number."""
        import torch

        fs, root = self._fs()
        fs.create_dir(root, recursive=True)
        seq = (self.latest() or 0) + 1
        final = posixpath.join(root, f"ckpt-{seq:08d}.pt")
        tmp = posixpath.join(root, f".tmp-ckpt-{seq:08d}-{uuid.uuid4().hex}")
        buf = io.BytesIO()
        torch.save(obj, buf)
        with fs.open_output_stream(tmp) as out:
            out.write(buf.getbuffer())
        fs.move(tmp, final)
        for old in self.sequence_numbers()[: -self.keep]:
            fs.delete_file(posixpath.join(root, f"ckpt-{old:08d}.pt"))
        # Temporary files of earlier writers that crashed mid-write are garbage now.
        import pyarrow.fs as pafs

        for info in fs.get_file_info(pafs.FileSelector(root)):
            name = posixpath.basename(info.path)
            if name.startswith(".tmp-ckpt-") and info.path != tmp:
                fs.delete_file(info.path)
        return seq

    def load(self, seq: int | None = None) -> Any:
        """The checkpoint ``seq`` (default: the latest complete one), or None when there is none."""
        import torch

        if seq is None:
            seq = self.latest()
            if seq is None:
                return None
        fs, root = self._fs()
        with fs.open_input_file(posixpath.join(root, f"ckpt-{seq:08d}.pt")) as f:
            data = f.read()
        # Checkpoints are this run's own files on the user's storage, so full unpickling is intended.
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


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
        from sparkdl.context import context

        rngs = _all_gather(_rng_state())
        ctx = context()
        if ctx.rank == 0:
            ctx.save_checkpoint({**self.state_dict(), "rng": rngs})

    def restore(self) -> bool:
        """Loads the latest checkpoint of the run, the same one on every rank; False when none."""
        from sparkdl.context import context

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
        if save_every is not None and (isinstance(save_every, bool) or save_every < 1):
            raise ConfigError(f"save_every must be an integer >= 1 or None; got {save_every!r}")
        import time

        from sparkdl.context import context

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
