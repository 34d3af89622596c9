"""Launch overhead: a warm 2-rank ``sparkdl.run`` against Spark's own TorchDistributor.

Both do the same work, one gloo allreduce on 2 ranks, on the same local Spark session, in the
same process, alternating, after one warm-up run each. Prints both medians and their ratio
(target: sparkdl / TorchDistributor <= 0.25).

TorchDistributor's tasks return without reading their input, so Spark retires their Python
workers; each sparkdl run after one starts on new Python workers, and what keeps it warm is the
executor's zygote (see "Warm start" in docs/guides/launching.md), which outlives them.

    .venv/bin/python benchmarks/bench_launch.py [--runs 5] [--master local[2]] [--remote [URL]] [--relay] [--horovod]

``--remote``: the same over Spark Connect, both launchers on a Connect client session; with no
URL, a Connect server of ``--master`` is started on 127.0.0.1 for the run (tools/connect_server.py).
Compare its medians with a classic run's on the same machine. ``--relay``: also times sparkdl
with ``spark.sparkdl.channel=relay`` (the ranks report through Spark's result rows, as for a
client the executors cannot reach), alternating with the default, and prints relay / default.
``--horovod``: also times ``backend="horovod"`` (one ``hvd.allreduce``) with the Gloo controller
and with the MPI controller (an Open MPI job formed by the tasks), and prints MPI / Gloo.

``--curve 2 4 8 16 32``: instead, the launch curve: sparkdl's warm median at each gang size on
``local[<largest>]`` (targets: T(32) <= 2 x T(2)), and TorchDistributor's at ``--td-at`` ranks
(default 16) in the same session (target: sparkdl / TorchDistributor <= 0.05 there). With
``--hosts N`` (root), on a standalone cluster of N namespaced hosts, one executor of one core each
(tools/netns_cluster.py), the driver in this process on the bridge: ``--curve 2 4 8 --hosts 8 --td-at 8``.
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


def allreduce_with_horovod() -> float:
    import horovod.torch as hvd
    import torch

    hvd.init()
    return float(hvd.allreduce(torch.ones(1), op=hvd.Sum).item())


def _time(fn: Callable[[], object], expected: float = 2.0) -> float:
    start = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - start
    if result != expected:
        raise SystemExit(f"wrong allreduce result {result!r}, expected {expected}")
    return elapsed


def curve(sizes: list[int], td_at: int, runs: int, hosts: int = 0) -> None:
    """sparkdl's warm launch at each gang size, and TorchDistributor's at ``td_at``, on one session:
    of ``local[<largest>]``, or with ``hosts`` of a standalone cluster of that many namespaced hosts
    (tools/netns_cluster.py; one worker of one core each, the driver here on the bridge)."""
    if hosts:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
        from netns_cluster import NetnsCluster

        with NetnsCluster(hosts, cores=1, memory="1g", start_timeout_s=180) as cluster:
            os.environ["SPARK_LOCAL_IP"] = cluster.driver_host
            # Each host's one interface is eth0; its name resolves to loopback, where gloo would
            # otherwise bind (sparkdl picks the interface of its rank's address itself).
            conf = {**cluster.driver_conf(), "spark.executor.memory": "512m",
                    "spark.executorEnv.GLOO_SOCKET_IFNAME": "eth0"}
            _curve(sizes, td_at, runs, cluster.master_url, conf, f"{hosts} namespaced hosts")
        return
    master = f"local[{max(*sizes, td_at)}]"
    _curve(sizes, td_at, runs, master, {"spark.ui.enabled": "false"}, master)


def _curve(sizes: list[int], td_at: int, runs: int, master: str, conf: dict[str, str], where: str) -> None:
    from pyspark.ml.torch.distributor import TorchDistributor

    import sparkdl
    from sparkdl._internal.spark.session import create_session

    spark = create_session(master, conf, "sparkdl-bench-curve", master)
    spark.sparkContext.setLogLevel("ERROR")
    quiet = sparkdl.RunConfig(echo_logs=False, progress=False)
    print(f"launch curve on {where}, {os.cpu_count()} cores, median of {runs} warm runs", flush=True)
    medians: dict[int, float] = {}
    # Every executor warm first (its zygote, its Python workers): a small gang may land on any.
    _time(lambda: sparkdl.run(allreduce_with_sparkdl_group, num_workers=max(sizes), config=quiet), float(max(sizes)))
    for n in sizes:
        def launch(n: int = n) -> object:
            return sparkdl.run(allreduce_with_sparkdl_group, num_workers=n, config=quiet)

        _time(launch, float(n))  # warm-up: the zygote, the Python workers
        times = [_time(launch, float(n)) for _ in range(runs)]
        medians[n] = statistics.median(times)
        print(f"sparkdl {n:>3} ranks: median {medians[n]:.2f} s  (min {min(times):.2f}, max {max(times):.2f})",
              flush=True)

    def td() -> object:
        return TorchDistributor(num_processes=td_at, local_mode=False, use_gpu=False).run(allreduce_torchrun_style)

    _time(td, float(td_at))
    td_times = [_time(td, float(td_at)) for _ in range(runs)]
    td_median = statistics.median(td_times)
    print(f"TorchDistributor {td_at} ranks: median {td_median:.2f} s  (min {min(td_times):.2f}, max {max(td_times):.2f})")
    first, last = min(sizes), max(sizes)
    print(f"ratio T({last}) / T({first})                {medians[last] / medians[first]:.2f}  (target <= 2)")
    if td_at in medians:
        print(f"ratio sparkdl / TorchDistributor at {td_at}  {medians[td_at] / td_median:.3f}  (target <= 0.05)")
    spark.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="timed runs of each launcher (default 5)")
    parser.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    parser.add_argument("--remote", nargs="?", const="start", metavar="URL",
                        help="over Spark Connect: sc://host:port, or none to start a server of --master")
    parser.add_argument("--relay", action="store_true", help="also time sparkdl with spark.sparkdl.channel=relay")
    parser.add_argument("--horovod", action="store_true", help="also time backend='horovod' with Gloo and with MPI")
    parser.add_argument("--curve", type=int, nargs="+", metavar="N", help="the launch curve at these gang sizes")
    parser.add_argument("--td-at", type=int, default=16, help="TorchDistributor's gang size in --curve (default 16)")
    parser.add_argument("--hosts", type=int, default=0, metavar="N",
                        help="--curve on a standalone cluster of N namespaced hosts (root), not local[N]")
    args = parser.parse_args()
    if args.curve:
        curve(sorted(args.curve), args.td_at, args.runs, args.hosts)
        return

    from pyspark.ml.torch.distributor import TorchDistributor
    from pyspark.sql import SparkSession

    import sparkdl
    from sparkdl._internal.spark.session import create_session

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

    def run_relayed() -> object:
        spark.conf.set("spark.sparkdl.channel", "relay")
        try:
            return sparkdl.run(allreduce_with_sparkdl_group, num_workers=2, config=quiet)
        finally:
            spark.conf.unset("spark.sparkdl.channel")

    launchers = {"sparkdl": run_sparkdl, "TorchDistributor": run_td}
    if args.relay:
        launchers["sparkdl relayed"] = run_relayed
    if args.horovod:
        for controller in ("gloo", "mpi"):
            cfg = quiet.replace(horovod_controller=controller)
            launchers[f"horovod {controller}"] = (
                lambda cfg=cfg: sparkdl.run(allreduce_with_horovod, num_workers=2, backend="horovod", config=cfg))
    print(f"warming up {', '.join(launchers)} ...", flush=True)
    for fn in launchers.values():
        _time(fn)
    times: dict[str, list[float]] = {name: [] for name in launchers}
    for i in range(args.runs):
        for name, fn in launchers.items():
            times[name].append(_time(fn))
        print(f"run {i}: " + ", ".join(f"{name} {t[-1]:.2f} s" for name, t in times.items()), flush=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    print()
    for name, t in times.items():
        print(f"{name + ' (2 ranks, warm)':36} median {med[name]:.2f} s  (min {min(t):.2f}, max {max(t):.2f})")
    print(f"ratio sparkdl / TorchDistributor     {med['sparkdl'] / med['TorchDistributor']:.3f}  (target <= 0.25)")
    if args.relay:
        print(f"ratio relayed / default channel      {med['sparkdl relayed'] / med['sparkdl']:.3f}")
    if args.horovod:
        print(f"ratio horovod mpi / horovod gloo     {med['horovod mpi'] / med['horovod gloo']:.3f}")
    spark.stop()
    if server is not None:
        server.cleanup()


if __name__ == "__main__":
    main()
