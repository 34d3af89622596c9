"""The loader in worker processes (``workers=N``) against its threads (``workers=0``), in one run.

    .venv/bin/python benchmarks/bench_gil_proxy.py [--rows 2000000] [--workers 1 2] [--epochs 3] [--proxy-runs 2]
                                                   [--deep-prefetch 16]

It writes bench_feed.py's data (an int64 label and a list of 32 float32, 8 files, 50,000-row row
groups) and measures, each contender in a fresh process of its own:

1. **Feed**: rows/s of ``--batch-size`` batches (median of ``--epochs`` after a warm-up epoch)
   for the whole-row-group pyarrow reader (bench_feed's best reader), the loader on threads and
   the loader with ``workers=N``, without and with shuffle; and the peak memory of the process
   tree (the rank and its workers), sampled every 10 ms, as the sum of PSS (each page shared by
   forked processes counted once, split between them) and of RSS (shared pages counted in every
   process). Goals: ``workers=N`` >= 0.8x the pyarrow reader without shuffle, >= 0.5x with; its
   peak memory <= 1.25x the threads' for the same batches.
2. **GIL-bound proxy** (issue 58): a training loop whose "GPU step" is a fixed amount of
   GIL-holding Python (a counted loop), calibrated here so that the loop alone runs at 60% of
   the thread loader's batch rate (shuffle, ``--proxy-batch-size``), fed by the loader on threads
   and with ``workers=N`` (the default ``prefetch=4``), then threads and ``workers=1`` with
   ``prefetch=--deep-prefetch``: data wait (time in ``next()`` over the loop's time, after the
   first batch) and steps/s against threads with the same prefetch. Goal: data wait < 5% with
   workers where threads do not reach it.
3. **A loop that does not hold the GIL**: the same step time spent in ``time.sleep``; goal:
   ``workers=N`` steps/s >= 0.95x the threads'.

Ratios are against baselines measured in the same run. On a machine with few cores the workers
and the loop share them: the ratios say what this machine gives, not what a GPU host would.
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import torch
from bench_feed import generate, row_groups_epoch

import sparkdl

WORKLOAD_SHARE = 0.6  # the loop runs at this share of the thread loader's rate


class TreeMemory:
    """Samples the summed PSS and RSS of this process and its descendants; peaks since ``reset()``."""

    def __init__(self, interval_s: float = 0.01) -> None:
        self._me = psutil.Process()
        self._interval = interval_s
        self._stop = threading.Event()
        self.pss = self.rss = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2.0)

    def sample(self) -> None:
        pss = rss = 0
        for proc in [self._me, *self._me.children(recursive=True)]:
            try:
                with open(f"/proc/{proc.pid}/smaps_rollup") as f:
                    for line in f:
                        if line.startswith("Pss:"):
                            pss += int(line.split()[1]) * 1024
                        elif line.startswith("Rss:"):
                            rss += int(line.split()[1]) * 1024
            except (OSError, psutil.Error):
                continue
        self.pss, self.rss = max(self.pss, pss), max(self.rss, rss)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def reset(self) -> None:
        self.pss = self.rss = 0
        self.sample()


def _loader(data: Path, batch_size: int, shuffle: bool, workers: int, prefetch: int = 4) -> Any:
    return sparkdl.Dataset(data).loader(batch_size, shuffle=shuffle, seed=0, rank=0, world_size=1, workers=workers,
                                        prefetch=prefetch)


def _epochs_of(name: str, data: Path, batch_size: int) -> Any:
    """``epoch -> iterator of batches`` for a feed contender: 'pyarrow', or 'threads|workers=N, [no] shuffle'."""
    if name == "pyarrow whole row groups":
        files = sorted(data.glob("*.parquet"))
        return lambda _: row_groups_epoch(files, batch_size, ["label", "features"])
    kind, order = name.split(", ")
    workers = 0 if kind == "threads" else int(kind.split("=")[1])
    loader = _loader(data, batch_size, order == "shuffle", workers)

    def epoch(e: int) -> Iterator[dict[str, Any]]:
        loader.set_epoch(e + 1)
        return iter(loader)

    return epoch


def feed(name: str, data: Path, batch_size: int, epochs: int) -> dict[str, Any]:
    """Rows/s per epoch (after a warm-up) and the tree's peak PSS and RSS (MiB)."""
    make = _epochs_of(name, data, batch_size)
    rates = []
    with TreeMemory() as mem:
        for e in range(-1, epochs):
            mem.reset()
            rows, t0 = 0, time.perf_counter()
            for batch in make(e):
                rows += len(batch["label"])
            if e >= 0:
                rates.append(rows / (time.perf_counter() - t0))
            mem.sample()
            peak = (mem.pss, mem.rss)
    return {"rates": rates, "median": sorted(rates)[len(rates) // 2], "pss_mib": peak[0] / 2**20, "rss_mib": peak[1] / 2**20}


def spin(iterations: int) -> int:
    """A fixed amount of GIL-holding Python: the proxy's "GPU step"."""
    total = 0
    for i in range(iterations):
        total += i
    return total


def _timed(fn: Any, arg: int) -> float:
    t0 = time.perf_counter()
    fn(arg)
    return time.perf_counter() - t0


def proxy(workers: int, prefetch: int, data: Path, batch_size: int, epochs: int, step: int,
          sleep_s: float) -> dict[str, Any]:
    """The loop with the loader: ``spin(step)`` per batch (or ``time.sleep(sleep_s)`` when step is 0)."""
    loader = _loader(data, batch_size, True, workers, prefetch)
    waits, steps = 0.0, 0
    with loader:
        it = iter(loader)
        next(it)  # the first batch's wait (the workers' start, the first window) is left out
        t0 = time.perf_counter()
        for e in range(epochs):
            while True:
                w = time.perf_counter()
                try:
                    next(it)
                except StopIteration:
                    break
                waits += time.perf_counter() - w
                steps += 1
                if step:
                    spin(step)
                else:
                    time.sleep(sleep_s)
            if e + 1 < epochs:
                it = iter(loader)
        elapsed = time.perf_counter() - t0
    return {"wait_pct": 100 * waits / elapsed, "steps_s": steps / elapsed}


def _in_process(args: argparse.Namespace, data: Path, what: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--dir", str(data.parent), "--one", json.dumps(what)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{what}: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--proxy-batch-size", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--proxy-runs", type=int, default=2, help="rounds of the proxy loops (threads, then each workers=N)")
    parser.add_argument("--deep-prefetch", type=int, default=16,
                        help="the proxy also runs threads and workers=1 with this prefetch (0: not)")
    parser.add_argument("--dir", default=None, help="where to write the data (default: a temp dir, removed after)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # one measurement, in this process
    args = parser.parse_args()
    tmp = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="sparkdl-bench-gil-"))
    data = tmp / "plain"
    if args.one:
        what = json.loads(args.one)
        if what["kind"] == "feed":
            out = feed(what["name"], data, what["batch_size"], what["epochs"])
        else:
            out = proxy(what["workers"], what["prefetch"], data, what["batch_size"], what["epochs"], what["step"],
                        what["sleep_s"])
        print(json.dumps(out))
        return
    data.mkdir(parents=True, exist_ok=True)
    try:
        generate(data, args.rows, 8, 50_000)
        print(f"data: {args.rows} rows (int64 label, list<float32>[32]), 8 files, 50,000-row row groups; "
              f"cpus={os.cpu_count()}, torch {torch.__version__}; each contender in a fresh process")
        print(f"\n1. feed, batch {args.batch_size}, {args.epochs} epochs after a warm-up (median rows/s; peak memory "
              "of the rank + its workers)")
        names = ["pyarrow whole row groups"] + [f"{kind}, {order}" for order in ("no shuffle", "shuffle")
                                                for kind in ["threads", *(f"workers={n}" for n in args.workers)]]
        feeds = {}
        for name in names:
            feeds[name] = r = _in_process(args, data, {"kind": "feed", "name": name, "batch_size": args.batch_size,
                                                       "epochs": args.epochs})
            print(f"  {name:<26} {r['median'] / 1e6:5.2f}M rows/s  PSS {r['pss_mib']:6.0f} MiB  RSS {r['rss_mib']:6.0f} MiB",
                  flush=True)
        best = feeds["pyarrow whole row groups"]["median"]
        for name in names[1:]:
            order = name.split(", ")[1]
            threads = feeds[f"threads, {order}"]
            r = feeds[name]
            line = f"  {name:<26} {r['median'] / best:.2f}x the pyarrow reader (target >= {0.8 if order == 'no shuffle' else 0.5}x)"
            if not name.startswith("threads"):
                line += (f"; {r['median'] / threads['median']:.2f}x threads' rows/s; memory vs threads: "
                         f"PSS {r['pss_mib'] / threads['pss_mib']:.2f}x, RSS {r['rss_mib'] / threads['rss_mib']:.2f}x "
                         "(target <= 1.25x)")
            print(line)

        b = args.proxy_batch_size
        alone = _in_process(args, data, {"kind": "feed", "name": "threads, shuffle", "batch_size": b, "epochs": 2})
        loader_rate = alone["median"] / b  # batches/s of the thread loader alone
        step_s = 1 / (WORKLOAD_SHARE * loader_rate)
        n = 200_000
        per_iter = min(_timed(spin, n) for _ in range(7)) / n  # the fastest of 7: the machine's own speed
        step = max(1, int(step_s / per_iter))
        alone_s = sorted(_timed(spin, step) for _ in range(21))[10]
        print(f"\n2. GIL-bound proxy, batch {b}, shuffle, {args.epochs} epochs: the thread loader alone gives "
              f"{loader_rate:.0f} batches/s; the step, {step} iterations of Python, takes "
              f"{alone_s * 1e3:.2f} ms alone (median of 21) ({WORKLOAD_SHARE:.0%} of the loader's rate, "
              f"{WORKLOAD_SHARE * loader_rate:.0f} steps/s)")
        for label, spin_step, sleep_s in (("GIL-holding step", step, 0.0), ("time.sleep step", 0, step_s)):
            # (workers, prefetch): the default prefetch (4), then threads and one worker with a deeper one.
            contenders = [(0, 4), *((w, 4) for w in args.workers)]
            if args.deep_prefetch:
                contenders += [(0, args.deep_prefetch), (1, args.deep_prefetch)]
            for run in range(args.proxy_runs):  # threads and workers in turn, so that both see the same machine
                runs = {}
                for w, pf in contenders:
                    runs[(w, pf)] = _in_process(args, data, {"kind": "proxy", "workers": w, "prefetch": pf,
                                                             "batch_size": b, "epochs": args.epochs,
                                                             "step": spin_step, "sleep_s": sleep_s})
                for (w, pf), r in runs.items():
                    kind = ("threads" if w == 0 else f"workers={w}") + ("" if pf == 4 else f", prefetch {pf}")
                    ratio = "" if w == 0 else f"  {r['steps_s'] / runs[(0, pf)]['steps_s']:.2f}x threads' steps/s"
                    print(f"  {label:<17} run {run + 1} {kind:<22} data wait {r['wait_pct']:5.1f}%  "
                          f"{r['steps_s']:6.1f} steps/s{ratio}", flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
