"""Feed throughput: sparkdl's loader against the best pyarrow reader and Petastorm, in one run.

    .venv/bin/python benchmarks/bench_feed.py [--rows 2000000] [--batch-size 1024] [--epochs 3] [--no-spark]

It writes ``--rows`` rows (an int64 label and a list of 32 float32, the layout Spark writes for
``array<float>``) into 8 Parquet files with 50,000-row row groups, then for each contender runs
``--epochs`` epochs of ``--batch-size`` batches into torch tensors, and prints rows/s per epoch,
the median and best epoch, the ratios of the medians to the ceiling, and the peak RSS of the
process during each epoch (sampled every 5 ms) so that flat memory across epochs shows. It also
prints the process CPU time per row (all threads): the loader overlaps reading with the consumer
in background threads, so on a busy machine its wall-clock ratio to a single-threaded reader
falls; CPU per row says how much work it adds.

Each contender runs in a fresh process of its own, so that its peak RSS is its own (not what an
earlier contender left in the allocator) and none inherits another's warm caches. It first runs
one warm-up epoch, reported apart: a fresh process pays page faults for its first epoch's
buffers, which later epochs reuse.

Baselines, both pyarrow into ``torch.from_numpy``, single pass, no shuffle; the ceiling is the
faster of the two:

- ``iter_batches``: ``ParquetFile.iter_batches(batch_size)``;
- whole row groups: ``read_row_group(i, use_threads=True)``, batches sliced from it.

sparkdl, on two layouts of the same rows:

- plain Parquet opened with no hints (``Dataset(path)``): the list column's length is not known
  up front, as for any table Spark or pyarrow wrote;
- the layout ``write_dataset`` writes (a Spark job on ``local[2]`` writes the same rows again;
  its manifest records the array length; its row groups are of ``write_dataset``'s default
  8 MiB, about 65,000 rows here), compared with the
  whole-row-group reader on those same files. ``--no-spark`` skips it.

Each without and with shuffle (``loader(batch_size, shuffle=...)``); plus, on plain Parquet with
shuffle, one rank's share of four (``rank=0, world_size=4``) and a projection to the list column
(``columns=["features"]``, against the best reader of that column alone). Petastorm:
``make_batch_reader(workers_count=2)`` with ``petastorm.pytorch.DataLoader``, where it imports
(the classic stack); else a line says why it was skipped.

Targets (issue 19): >= 0.8x the ceiling without shuffle, >= 0.5x with shuffle, for both layouts;
peak RSS in every epoch <= 1.25x the whole-row-group reader's (same files and columns); >= 5x
Petastorm.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


def _tensors(batch: pa.RecordBatch | pa.Table, columns: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    for name in columns:
        col = batch.column(name)
        if isinstance(col, pa.ChunkedArray):
            col = col.combine_chunks()
        if name == "features":
            out[name] = torch.from_numpy(col.flatten().to_numpy().reshape(-1, FEATURES))
        else:
            out[name] = torch.from_numpy(col.to_numpy())
    return out


def iter_batches_epoch(files: list[Path], batch_size: int, columns: list[str]) -> Iterator[dict[str, torch.Tensor]]:
    for path in files:
        pf = pq.ParquetFile(path)
        for batch in pf.iter_batches(batch_size=batch_size, columns=columns):
            yield _tensors(batch, columns)


def row_groups_epoch(files: list[Path], batch_size: int, columns: list[str]) -> Iterator[dict[str, torch.Tensor]]:
    for path in files:
        pf = pq.ParquetFile(path)
        for i in range(pf.num_row_groups):
            table = pf.read_row_group(i, columns=columns, use_threads=True)
            for start in range(0, table.num_rows, batch_size):
                yield _tensors(table.slice(start, batch_size), columns)


def measure(
    name: str, epochs: int, make_epoch: Callable[[int], Iterator[dict[str, torch.Tensor]]], rss: PeakRss
) -> tuple[float, list[float]]:
    """The median rows/s over ``epochs`` and the peak RSS (MiB) of each epoch."""
    rates = []
    peaks = []
    cpu_ns = []
    warmup = 0.0
    for epoch in range(-1, epochs):  # epoch -1: warm-up, reported apart
        rss.reset()
        rows = 0
        t0, c0 = time.perf_counter(), time.process_time()
        for batch in make_epoch(epoch):
            rows += int(batch["features"].shape[0])
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
        f"{name:<34} median {median / 1e6:5.2f}M rows/s, best {max(rates) / 1e6:5.2f}M "
        f"(epochs: {per_epoch}; warm-up {warmup / 1e6:.2f}M); CPU {np.median(cpu_ns):.0f} ns/row (all threads); "
        f"peak RSS MiB per epoch: {peak_text}"
    )
    return median, peaks


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


def write_with_spark(source: Path, target: Path) -> str | None:
    """The same rows written by ``write_dataset`` (its manifest records the array length)."""
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:
        return f"pyspark not importable ({exc})"
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master("local[2]").appName("bench-feed")
        .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1").getOrCreate()
    )
    try:
        sparkdl.write_dataset(spark.read.parquet(str(source)), str(target), num_files=8)
    finally:
        spark.stop()
    return None


def loader_epochs(loader: Any) -> Callable[[int], Iterator[dict[str, torch.Tensor]]]:
    def run(epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        loader.set_epoch(epoch + 1)
        return iter(loader)

    return run


def contender(name: str, data: Path, written: Path, batch_size: int) -> Callable[[int], Iterator[dict[str, torch.Tensor]]]:
    """The epochs of the contender called ``name``."""
    files = sorted(data.glob("*.parquet"))
    both, one = ["label", "features"], ["features"]
    b = batch_size

    def loader(path: Path, *, shuffle: bool = True, world_size: int = 1, columns: list[str] | None = None) -> Any:
        return loader_epochs(sparkdl.Dataset(path).loader(
            b, shuffle=shuffle, seed=0, rank=0, world_size=world_size, columns=columns))

    if name == "pyarrow iter_batches":
        return lambda _: iter_batches_epoch(files, b, both)
    if name == "pyarrow whole row groups":
        return lambda _: row_groups_epoch(files, b, both)
    if name == "pyarrow whole row groups, 1 col":
        return lambda _: row_groups_epoch(files, b, one)
    if name == "pyarrow whole row groups, written":
        return lambda _: row_groups_epoch(sorted(written.glob("*.parquet")), b, both)
    if name == "plain, no shuffle":
        return loader(data, shuffle=False)
    if name == "plain, shuffle":
        return loader(data)
    if name == "plain, shuffle, rank 0 of 4":
        return loader(data, world_size=4)
    if name == "plain, shuffle, 1 col":
        return loader(data, columns=one)
    if name == "write_dataset, no shuffle":
        return loader(written, shuffle=False)
    if name == "write_dataset, shuffle":
        return loader(written)
    if name == "petastorm":
        peta = petastorm_epochs(data.as_uri(), b)
        if isinstance(peta, str):
            raise SystemExit(peta)
        return peta
    raise SystemExit(f"unknown contender {name!r}")


CONTENDERS = (
    "pyarrow iter_batches",
    "pyarrow whole row groups",
    "pyarrow whole row groups, 1 col",
    "plain, no shuffle",
    "plain, shuffle",
    "plain, shuffle, rank 0 of 4",
    "plain, shuffle, 1 col",
    "pyarrow whole row groups, written",
    "write_dataset, no shuffle",
    "write_dataset, shuffle",
    "petastorm",
)


def run_contender(name: str, args: argparse.Namespace, data: Path, written: Path) -> tuple[float, list[float]] | str:
    """Runs one contender in a fresh process; its (median rows/s, peak RSS MiB per epoch), or why it was skipped."""
    cmd = [sys.executable, __file__, "--contender", name, "--dir", str(data.parent),
           "--batch-size", str(args.batch_size), "--epochs", str(args.epochs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    lines = proc.stdout.strip().splitlines()
    print(lines[0], flush=True)
    result = json.loads(lines[-1])
    return float(result["median"]), [float(p) for p in result["peaks_mib"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--row-group", type=int, default=50_000)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--no-spark", action="store_true", help="skip the write_dataset layout (no JVM)")
    parser.add_argument("--dir", default=None, help="where to write the data (default: a temp dir, removed after)")
    parser.add_argument("--contender", default=None, help=argparse.SUPPRESS)  # one contender, in this process
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

    tmp = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="sparkdl-bench-"))
    plain_dir, written_dir = tmp / "plain", tmp / "written"
    if args.contender:
        with PeakRss() as rss:
            median, peaks = measure(args.contender, args.epochs,
                                    contender(args.contender, plain_dir, written_dir, args.batch_size), rss)
        print(json.dumps({"median": median, "peaks_mib": peaks}))
        return
    plain_dir.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        generate(plain_dir, args.rows, args.files, args.row_group)
        print(
            f"data: {args.rows} rows (int64 label, list<float32>[{FEATURES}]), {args.files} files, "
            f"{args.row_group}-row row groups, written in {time.perf_counter() - t0:.1f}s; "
            f"batch_size={args.batch_size}, {args.epochs} epochs each; torch threads={torch.get_num_threads()}, "
            f"cpus={os.cpu_count()}; each contender in a fresh process"
        )
        skipped = "--no-spark" if args.no_spark else write_with_spark(plain_dir, written_dir)
        results: dict[str, tuple[float, list[float]]] = {}
        for name in CONTENDERS:
            if (name.startswith("write_dataset") or name.endswith("written")) and skipped is not None:
                print(f"{name:<34} skipped: {skipped}")
                continue
            outcome = run_contender(name, args, plain_dir, written_dir)
            if isinstance(outcome, str):
                print(f"{name:<34} skipped: {outcome}")
            else:
                results[name] = outcome

        ceiling = max(results["pyarrow iter_batches"][0], results["pyarrow whole row groups"][0])
        best_rss = max(results["pyarrow whole row groups"][1])
        one_col, one_col_rss = results["pyarrow whole row groups, 1 col"][0], max(results["pyarrow whole row groups, 1 col"][1])
        written = results.get("pyarrow whole row groups, written")
        written_base = (written[0], max(written[1])) if written else (ceiling, best_rss)
        print()
        print(f"ceiling: the faster pyarrow reader, {ceiling / 1e6:.2f}M rows/s "
              f"(iter_batches {results['pyarrow iter_batches'][0] / 1e6:.2f}M, whole row groups "
              f"{results['pyarrow whole row groups'][0] / 1e6:.2f}M); its peak RSS {best_rss:.0f} MiB")
        print("ratios of the medians (rows/s vs the best pyarrow reader of the same files and columns;")
        print("peak RSS of each epoch vs the whole-row-group reader's highest, on the same files and columns):")
        for name, (rate, peaks) in results.items():
            if name.startswith("pyarrow") or name == "petastorm":
                continue
            base, base_rss = (one_col, one_col_rss) if name.endswith("1 col") else (ceiling, best_rss)
            if name.startswith("write_dataset"):
                base, base_rss = written_base
            target = 0.8 if "no shuffle" in name else 0.5
            per_epoch = ", ".join(f"{p / base_rss:.2f}" for p in peaks)
            print(f"  {name:<32} {rate / base:.2f}x (target >= {target}x)   "
                  f"RSS {max(peaks) / base_rss:.2f}x (epochs: {per_epoch}; target <= 1.25x)")
        if "petastorm" in results:
            peta_rate = results["petastorm"][0]
            print(f"  plain, shuffle / petastorm       {results['plain, shuffle'][0] / peta_rate:.1f}x (target >= 5x)")
    finally:
        if not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
