"""Training overhead: one rank under ``sparkdl.run`` against a plain PyTorch loop, per epoch.

The same MLP, optimizer, batch size, thread count and rows. The baseline is the loop a user
would write on one machine with the data already in memory: a tensor per column, a fresh
``randperm`` per epoch, slices as batches. sparkdl runs one rank on the local Spark session that
reads the same rows from Parquet through ``ds.loader`` (shuffling) into the same model; then the
same loop driven by ``TrainState`` (checkpoints every ``--save-every`` steps and at each epoch's
end, progress metrics); then the loader loop with the model wrapped in DDP, which shows what
torch's DDP itself costs on one rank. Epoch times are taken inside the rank, so the
launch itself is left out (``bench_launch.py`` measures it); the first epoch of each contender
is a warm-up, reported apart. Prints the median epoch times and their ratios to the baseline
(target: at most 1.1x).

    .venv/bin/python benchmarks/bench_train.py [--rows 262144] [--epochs 4] [--hidden 256] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

FEATURES, CLASSES = 32, 10


def _make_model(hidden: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, CLASSES),
    )


def _write_data(directory: Path, rows: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    files = 4
    per_file = rows // files
    for i in range(files):
        x = rng.standard_normal((per_file, FEATURES), dtype=np.float32)
        y = (x[:, :CLASSES].argmax(axis=1)).astype(np.int64)
        offsets = np.arange(0, (per_file + 1) * FEATURES, FEATURES, dtype=np.int32)
        table = pa.table({"y": y, "x": pa.ListArray.from_arrays(pa.array(offsets), pa.array(x.reshape(-1)))})
        pq.write_table(table, directory / f"part-{i:03d}.parquet", row_group_size=16_384)


def plain_loop(directory: Path, epochs: int, batch: int, hidden: int, lr: float, threads: int) -> list[float]:
    """The baseline: every row in memory as tensors, shuffled with randperm each epoch."""
    import pyarrow.parquet as pq
    import torch

    torch.set_num_threads(threads)
    table = pq.read_table(directory)
    x = torch.from_numpy(table.column("x").combine_chunks().flatten().to_numpy().reshape(-1, FEATURES).copy())
    y = torch.from_numpy(table.column("y").to_numpy().copy())
    model = _make_model(hidden)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    times = []
    steps = len(y) // batch
    for _ in range(epochs):
        t0 = time.perf_counter()
        order = torch.randperm(len(y), generator=g)
        for s in range(steps):
            idx = order[s * batch : (s + 1) * batch]
            loss = loss_fn(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        times.append(time.perf_counter() - t0)
    return times


def sparkdl_loop(ds: Any, epochs: int, batch: int, hidden: int, lr: float, threads: int, save_every: int) -> Any:
    """One rank: ``ds.loader`` into the model, into a DDP-wrapped model, and under ``TrainState``."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sparkdl

    torch.set_num_threads(threads)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(model: Any, opt: Any, b: dict[str, Any]) -> None:
        loss = loss_fn(model(b["x"]), b["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()

    def fresh(wrap: bool) -> tuple[Any, Any]:
        model = DDP(_make_model(hidden)) if wrap else _make_model(hidden)
        return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    out: dict[str, Any] = {"threads": torch.get_num_threads()}
    for name, wrap in (("loader", False), ("loader_ddp", True)):
        model, opt = fresh(wrap)
        loader = ds.loader(batch, shuffle=True, seed=0, drop_last=True)
        out["steps"] = len(loader)
        times = []
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            t0 = time.perf_counter()
            for b in loader:
                step(model, opt, b)
            times.append(time.perf_counter() - t0)
        out[name] = times

    model, opt = fresh(False)
    state = sparkdl.TrainState(model, opt, ds.loader(batch, shuffle=True, seed=0, drop_last=True))
    times = []
    t0 = time.perf_counter()
    last_epoch = 0
    for b in state.batches(epochs=epochs, save_every=save_every):
        if state.loader.epoch != last_epoch:  # the loader moved on: the previous epoch ended
            times.append(time.perf_counter() - t0)
            last_epoch, t0 = state.loader.epoch, time.perf_counter()
        step(model, opt, b)
    times.append(time.perf_counter() - t0)  # includes the last epoch-end checkpoint
    out["trainstate"] = times
    return out


def _summary(name: str, times: list[float], base: float | None) -> float:
    med = statistics.median(times[1:]) if len(times) > 1 else times[0]
    ratio = f"  ratio {med / base:.3f}x" if base else ""
    epochs = ", ".join(f"{t:.2f}" for t in times[1:])
    print(f"{name:<34} median {med:6.2f} s/epoch (epochs {epochs}; warm-up {times[0]:.2f}){ratio}")
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=262_144)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=4, help="epochs of each contender, the first a warm-up")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in both contenders")
    parser.add_argument("--save-every", type=int, default=200, help="TrainState checkpoint interval (steps)")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (the first is a warm-up)")

    from pyspark.sql import SparkSession

    import sparkdl

    tmp = Path(tempfile.mkdtemp(prefix="sparkdl-bench-train-"))
    spark = None
    try:
        (tmp / "data").mkdir()
        _write_data(tmp / "data", args.rows)
        spark = (
            SparkSession.builder.master("local[2]")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.sparkdl.runDir", str(tmp / "runs"))
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        ds = sparkdl.Dataset(tmp / "data", fixed_lengths={"x": FEATURES})
        print(
            f"data: {args.rows} rows (x: {FEATURES} float32, y: int64) in Parquet; MLP {FEATURES}-{args.hidden}-"
            f"{args.hidden}-{CLASSES}, SGD, batch {args.batch_size}, {args.threads} torch thread(s), "
            f"{args.epochs} epochs each (first = warm-up)",
            flush=True,
        )
        base_times = plain_loop(tmp / "data", args.epochs, args.batch_size, args.hidden, 0.05, args.threads)
        out = sparkdl.run(
            sparkdl_loop, ds, args.epochs, args.batch_size, args.hidden, 0.05, args.threads, args.save_every,
            num_workers=1, config=sparkdl.RunConfig(echo_logs=False, progress=False),
        )
        print(f"steps per epoch: {out['steps']}; threads in the rank: {out['threads']}")
        base = _summary("plain PyTorch, in-memory tensors", base_times, None)
        _summary("sparkdl.run, 1 rank, ds.loader", out["loader"], base)
        _summary("sparkdl.run, 1 rank, TrainState", out["trainstate"], base)
        _summary("sparkdl.run, 1 rank, ds.loader+DDP", out["loader_ddp"], base)
        print(
            "DDP wraps the model in torch's gradient reducer even on one rank (its autograd hooks and "
            "bucket copies, about 1 ms a step here); that cost is torch's, the same with or without sparkdl."
        )
    finally:
        if spark is not None:
            spark.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
