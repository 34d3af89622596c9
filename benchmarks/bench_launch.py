"""Launch overhead: a warm 2-rank ``sparkdl.run`` against Spark's own TorchDistributor.

Both do the same work, one gloo allreduce on 2 ranks, on the same local Spark session, in the
same process, alternating, after one warm-up run each. Prints both medians and their ratio
(target: sparkdl / TorchDistributor <= 0.25).

TorchDistributor's tasks return without reading their input, so Spark retires their Python
workers; each sparkdl run after one starts on new Python workers, and what keeps it warm is the
executor's zygote (see the README's "Warm start"), which outlives them.

    .venv/bin/python benchmarks/bench_launch.py [--runs 5] [--master local[2]] [--remote [URL]]

``--remote``: the same over Spark Connect, both launchers on a Connect client session; with no
URL, a Connect server of ``--master`` is started on 127.0.0.1 for the run (tools/connect_server.py).
Compare its medians with a classic run's on the same machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def allreduce_with_sparkdl_group() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def allreduce_torchrun_style() -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - start
    if result != 2.0:
        raise SystemExit(f"wrong allreduce result {result!r}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="timed runs of each launcher (default 5)")
    parser.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    parser.add_argument("--remote", nargs="?", const="start", metavar="URL",
                        help="over Spark Connect: sc://host:port, or none to start a server of --master")
    args = parser.parse_args()

    from pyspark.ml.torch.distributor import TorchDistributor
    from pyspark.sql import SparkSession

    import sparkdl
    from sparkdl.session import create_session

    server = None
    if args.remote:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
        from connect_server import ConnectServer

        server = ConnectServer(args.master).start() if args.remote == "start" else None
        spark = SparkSession.builder.remote(server.url if server else args.remote).getOrCreate()
        print(f"Spark Connect client of {server.url if server else args.remote} (master {args.master})", flush=True)
    else:
        spark = create_session(args.master, {"spark.ui.enabled": "false"}, "sparkdl-bench", "local[2]")
        spark.sparkContext.setLogLevel("ERROR")
    quiet = sparkdl.RunConfig(echo_logs=False)

    def run_sparkdl() -> object:
        return sparkdl.run(allreduce_with_sparkdl_group, num_workers=2, config=quiet)

    def run_td() -> object:
        return TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(allreduce_torchrun_style)

    print("warming up both launchers ...", flush=True)
    _time(run_sparkdl)
    _time(run_td)
    ours, theirs = [], []
    for i in range(args.runs):
        ours.append(_time(run_sparkdl))
        theirs.append(_time(run_td))
        print(f"run {i}: sparkdl {ours[-1]:.2f} s, TorchDistributor {theirs[-1]:.2f} s", flush=True)
    m_ours, m_theirs = statistics.median(ours), statistics.median(theirs)
    print()
    print(f"sparkdl.run (2 ranks, warm)          median {m_ours:.2f} s  (min {min(ours):.2f}, max {max(ours):.2f})")
    print(f"TorchDistributor (2 procs, warm)     median {m_theirs:.2f} s  (min {min(theirs):.2f}, max {max(theirs):.2f})")
    print(f"ratio sparkdl / TorchDistributor     {m_ours / m_theirs:.3f}  (target <= 0.25)")
    spark.stop()
    if server is not None:
        server.cleanup()


if __name__ == "__main__":
    main()
