"""Keeping a GPU fed: how much of a training step waits for ``ds.loader``, measured in one run.

    python benchmarks/bench_gpu_feed.py           # on a CUDA GPU: 1M rows, MLP 256-2048-2048-2048-10
    python benchmarks/bench_gpu_feed.py --cpu     # the same loop on the CPU, fewer rows, a smaller MLP

(From a checkout without an installed sparkdl: ``PYTHONPATH=. python3 benchmarks/...``; it needs
torch, pyarrow and numpy, not Spark.) It writes ``--rows`` rows of 256 float32 features (a
fixed-size list) and an int64 label as Parquet with pyarrow, then trains the same MLP (Adam,
batch ``--batch-size``, ``--epochs`` epochs, shuffled) four ways, one after the other, on one
device:

- ``in memory``: every batch already on the device before the clock starts, so nothing waits
  for data: the ceiling, measured in the same run;
- ``loader``: ``ds.loader(batch, device=dev)``, pinned CPU batches that the loop moves itself
  with ``.to(dev, non_blocking=True)``: the copy runs on the compute stream, between two steps;
- ``to_device``: ``ds.loader(batch, device=dev, to_device=True)``: batches arrive on the device,
  copied on a side stream while earlier steps compute;
- ``loader alone``: the loader with no model, to tell an input-bound loop (the loader alone is
  slower than the model) from one that copies slow down.

Every step ends with ``loss.item()``, as a loop that logs its loss does, so the clock sees the
GPU's work. Printed for each: steps/s, steps/s as a ratio to ``in memory``, and the data wait:
the loop's time inside ``next(loader)`` over its whole time, both counted from the arrival of
the first batch, whose wait (reading the first shuffle window: a start-up cost paid once per
run, as later epochs are read ahead while the one before ends) is printed apart. Target
(issue 22): a data wait below 5% of step time with ``to_device`` on a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FEATURES, CLASSES = 256, 10


@dataclass(frozen=True)
class Figures:
    """One way of feeding the loop: its steps, its wall time and its time waiting for data."""

    name: str
    steps: int
    seconds: float
    wait_s: float
    first_s: float  # the wait for the run's first batch (a one-time start-up, like CUDA's)

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0

    @property
    def wait_fraction(self) -> float:
        """Time waiting for data over the loop's time, both after the first batch arrived."""
        run = self.seconds - self.first_s
        return (self.wait_s - self.first_s) / run if run > 0 else 0.0


def write_rows(directory: Path, rows: int, *, files: int = 4, row_group_rows: int = 16_384) -> None:
    """``rows`` rows of ``x`` (256 float32) and ``y`` (int64) as Parquet, uncompressed, with pyarrow."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per_file = -(-rows // files)
    for i, start in enumerate(range(0, rows, per_file)):
        n = min(per_file, rows - start)
        x = rng.standard_normal((n, FEATURES), dtype=np.float32)
        y = x[:, :CLASSES].argmax(axis=1).astype(np.int64)
        table = pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), FEATURES), "y": y})
        pq.write_table(table, directory / f"part-{i:03d}.parquet", row_group_size=row_group_rows, compression="none")


def make_model(hidden: int, layers: int, device: Any) -> Any:
    import torch

    torch.manual_seed(0)
    widths = [FEATURES] + [hidden] * layers
    mods: list[Any] = []
    for a, b in itertools.pairwise(widths):
        mods += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(widths[-1], CLASSES)).to(device)


def _loop(name: str, epochs: list[Iterable[dict[str, Any]]], model: Any, device: Any) -> Figures:
    """Trains over every batch of every epoch; the clock runs from the first ``next`` to the end."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.Adam(model.parameters(), lr=1e-3) if model is not None else None
    steps, wait, first = 0, 0.0, None
    start = time.perf_counter()
    for batches in epochs:
        it = iter(batches)
        while True:
            t0 = time.perf_counter()
            batch = next(it, None)
            wait += time.perf_counter() - t0
            first = wait if first is None else first
            if batch is None:
                break
            if model is None or opt is None:  # the loader alone
                steps += 1
                continue
            x = batch["x"].to(device, non_blocking=True)
            y = batch["y"].to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss.item()  # the loop waits for its step here, as one that logs its loss does
            steps += 1
    return Figures(name, steps, time.perf_counter() - start, wait, first or 0.0)


def measure(
    ds: Any, device: Any, *, batch_size: int, hidden: int, layers: int, epochs: int,
    rank: int = 0, world_size: int = 1, read_threads: int | None = None,
) -> list[Figures]:
    """The four ways of feeding (see the module docstring), in order; ``ds`` is a ``sparkdl.Dataset``."""
    import torch

    device = torch.device(device)
    kw: dict[str, Any] = dict(rank=rank, world_size=world_size, seed=0, drop_last=True, device=device,
                              read_threads=read_threads)
    # The ceiling: exactly the loader's batches, already on the device.
    ready = [{k: v.to(device) for k, v in b.items()} for b in ds.loader(batch_size, **kw)]
    _loop("warm-up", [ready[:3]], make_model(hidden, layers, device), device)  # CUDA context, kernels, allocator
    out = [_loop("in memory", [ready] * epochs, make_model(hidden, layers, device), device)]
    del ready
    for name, extra, model in (
        ("loader", {}, True), ("to_device", {"to_device": True}, True), ("loader alone", {}, False)
    ):
        loader = ds.loader(batch_size, **kw, **extra)  # the same loader, epoch after epoch
        out.append(_loop(name, [loader] * epochs, make_model(hidden, layers, device) if model else None, device))
        loader.close()
    return out


def report(figures: list[Figures]) -> list[str]:
    """One line per way of feeding: steps/s, the data wait and the ratio to the ceiling."""
    base = figures[0].steps_per_s
    return [
        f"{f.name:>13}: {f.steps} steps in {f.seconds:.2f} s, {f.steps_per_s:8.1f} steps/s"
        f" ({f.steps_per_s / base if base else 0:.2f}x in memory), data wait {100 * f.wait_fraction:.1f}% of step time"
        f" (first batch after {1000 * f.first_s:.0f} ms)"
        for f in figures
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (defaults: 32768 rows, MLP 256-256-256-10)")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--read-threads", type=int, default=None, help="the loader's read_threads (default: its own)")
    args = parser.parse_args()

    import torch

    from sparkdl import Dataset

    if not args.cpu and not torch.cuda.is_available():
        parser.error("torch.cuda.is_available() is False here: run with --cpu, or on a machine with a CUDA GPU")
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    rows = args.rows or (32_768 if args.cpu else 1_048_576)
    hidden = args.hidden or (256 if args.cpu else 2048)
    layers = args.layers or (2 if args.cpu else 3)
    where = Path(tempfile.mkdtemp(prefix="sparkdl-bench-gpu-feed-"))
    try:
        t0 = time.perf_counter()
        write_rows(where, rows)
        ds = Dataset(where)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"{rows} rows of {FEATURES} float32 written in {time.perf_counter() - t0:.1f} s; device {device} ({name}); "
              f"MLP {FEATURES}-{'-'.join([str(hidden)] * layers)}-{CLASSES}, batch {args.batch_size}, {args.epochs} epochs")
        figures = measure(ds, device, batch_size=args.batch_size, hidden=hidden, layers=layers, epochs=args.epochs,
                          read_threads=args.read_threads)
        for line in report(figures):
            print(line)
    finally:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
