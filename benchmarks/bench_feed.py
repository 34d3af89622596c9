"""Feed throughput: sparkdl's loader against pyarrow's ceiling and Petastorm, in one run.

    .venv/bin/python benchmarks/bench_feed.py [--rows 2000000] [--batch-size 1024] [--epochs 3]

It writes ``--rows`` rows (an int64 label and a list of 32 float32, the layout Spark writes for
``array<float>``) into 8 Parquet files with 50,000-row row groups, then for each contender runs
``--epochs`` epochs of ``--batch-size`` batches into torch tensors, and prints rows/s per epoch,
the median and best epoch, the ratios of the medians to the ceiling, and the peak RSS of the process during
each epoch (sampled every 5 ms) so that flat memory across epochs shows. It also prints the
process CPU time per row (all threads): the loader overlaps reading with the consumer in
background threads, so on a busy machine its wall-clock ratio to the single-threaded ceiling
falls; CPU per row says how much work it adds.

Each contender first runs one warm-up epoch, reported apart: a fresh process pays page faults
for its first epoch's buffers (about 50,000 here), which later epochs reuse.

- ceiling: ``ParquetFile.iter_batches`` into ``torch.from_numpy``, single pass, no shuffle;
- sparkdl, no shuffle: ``Dataset(...).loader(batch_size, shuffle=False)``;
- sparkdl, shuffle: ``loader(batch_size, shuffle=True)`` (row groups and rows in windows);
- petastorm: ``make_batch_reader(workers_count=2)`` with ``petastorm.pytorch.DataLoader``, where
  Petastorm imports (the classic stack); else a line says why it was skipped.

Targets (issue 3): sparkdl >= 0.8x the ceiling without shuffle, >= 0.5x with shuffle, >= 5x
Petastorm.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import torch

import sparkdl

FEATURES = 32


def generate(directory: Path, rows: int, files: int, row_group: int) -> None:
    rng = np.random.default_rng(0)
    per_file = -(-rows // files)
    for i in range(files):
        n = min(per_file, rows - i * per_file)
        if n <= 0:
            break
        values = rng.standard_normal(n * FEATURES, dtype=np.float32)
        offsets = np.arange(0, (n + 1) * FEATURES, FEATURES, dtype=np.int32)
        table = pa.table(
            {
                "label": pa.array(rng.integers(0, 10, n)),
                "features": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
            }
        )
        pq.write_table(table, directory / f"part-{i:05d}.parquet", row_group_size=row_group)


class PeakRss:
    """Samples this process's RSS in a thread; ``peak()`` since the last ``reset()``."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self._proc = psutil.Process()
        self._interval = interval_s
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2.0)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._peak = max(self._peak, self._proc.memory_info().rss)

    def reset(self) -> None:
        self._peak = self._proc.memory_info().rss

    def peak(self) -> int:
        return max(self._peak, self._proc.memory_info().rss)


def ceiling_epoch(files: list[Path], batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    for path in files:
        pf = pq.ParquetFile(path)
        for batch in pf.iter_batches(batch_size=batch_size):
            feats = batch.column(1).flatten().to_numpy().reshape(-1, FEATURES)
            yield {"label": torch.from_numpy(batch.column(0).to_numpy()), "features": torch.from_numpy(feats)}


def measure(
    name: str, epochs: int, make_epoch: Callable[[int], Iterator[dict[str, torch.Tensor]]], rss: PeakRss
) -> float:
    rates = []
    peaks = []
    cpu_ns = []
    warmup = 0.0
    for epoch in range(-1, epochs):  # epoch -1: warm-up, reported apart
        rss.reset()
        rows = 0
        t0, c0 = time.perf_counter(), time.process_time()
        for batch in make_epoch(epoch):
            rows += int(batch["label"].shape[0])
            # touch the data, as a training step would
            batch["features"].sum()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        if epoch < 0:
            warmup = rows / dt
            continue
        rates.append(rows / dt)
        cpu_ns.append(cpu / rows * 1e9)
        peaks.append(rss.peak() / 2**20)
    per_epoch = ", ".join(f"{r / 1e6:.2f}M" for r in rates)
    peak_text = ", ".join(f"{p:.0f}" for p in peaks)
    median = float(np.median(rates))
    print(
        f"{name:<22} median {median / 1e6:5.2f}M rows/s, best {max(rates) / 1e6:5.2f}M "
        f"(epochs: {per_epoch}; warm-up {warmup / 1e6:.2f}M); CPU {np.median(cpu_ns):.0f} ns/row (all threads); "
        f"peak RSS MiB per epoch: {peak_text}"
    )
    return median


def petastorm_epochs(url: str, batch_size: int) -> Callable[[int], Iterator[dict[str, torch.Tensor]]] | str:
    try:
        from petastorm import make_batch_reader
        from petastorm.pytorch import DataLoader
    except Exception as exc:
        return f"petastorm not importable on pyarrow {pa.__version__} ({type(exc).__name__}: {exc})"

    def epoch(_: int) -> Iterator[dict[str, torch.Tensor]]:
        with make_batch_reader(url, num_epochs=1, workers_count=2) as reader:
            for batch in DataLoader(reader, batch_size=batch_size):
                yield {"label": batch["label"], "features": batch["features"]}

    return epoch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--row-group", type=int, default=50_000)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the data (default: a temp dir, removed after)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

    tmp = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="sparkdl-bench-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        generate(tmp, args.rows, args.files, args.row_group)
        print(
            f"data: {args.rows} rows (int64 label, list<float32>[{FEATURES}]), {args.files} files, "
            f"{args.row_group}-row row groups, written in {time.perf_counter() - t0:.1f}s; "
            f"batch_size={args.batch_size}, {args.epochs} epochs each; torch threads={torch.get_num_threads()}, "
            f"cpus={os.cpu_count()}"
        )
        files = sorted(tmp.glob("*.parquet"))
        ds = sparkdl.Dataset(tmp, fixed_lengths={"features": FEATURES})
        plain = ds.loader(args.batch_size, shuffle=False, rank=0, world_size=1)
        shuffled = ds.loader(args.batch_size, shuffle=True, seed=0, rank=0, world_size=1)
        print(f"sparkdl shuffle window: {shuffled.shuffle_window} rows; prefetch: 4 batches")

        def loader_epoch(loader: object) -> Callable[[int], Iterator[dict[str, torch.Tensor]]]:
            def run(epoch: int) -> Iterator[dict[str, torch.Tensor]]:
                loader.set_epoch(epoch + 1)  # type: ignore[attr-defined]
                return iter(loader)  # type: ignore[call-overload]

            return run

        with PeakRss() as rss:
            ceiling = measure("pyarrow (ceiling)", args.epochs, lambda _: ceiling_epoch(files, args.batch_size), rss)
            no_shuffle = measure("sparkdl, no shuffle", args.epochs, loader_epoch(plain), rss)
            shuffle = measure("sparkdl, shuffle", args.epochs, loader_epoch(shuffled), rss)
            peta = petastorm_epochs(tmp.as_uri(), args.batch_size)
            peta_rate = None
            if isinstance(peta, str):
                print(f"{'petastorm':<22} skipped: {peta}")
            else:
                peta_rate = measure("petastorm", args.epochs, peta, rss)

        print()
        print("ratios of the medians:")
        print(f"sparkdl, no shuffle / ceiling: {no_shuffle / ceiling:.2f}x (target >= 0.8x)")
        print(f"sparkdl, shuffle    / ceiling: {shuffle / ceiling:.2f}x (target >= 0.5x)")
        if peta_rate:
            print(f"sparkdl, shuffle / petastorm:  {shuffle / peta_rate:.1f}x (target >= 5x)")
            print(f"petastorm / ceiling:           {peta_rate / ceiling:.2f}x")
    finally:
        if not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
