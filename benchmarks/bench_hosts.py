"""Two hosts against one: a warm 2-rank launch and a 2-rank DDP step on the namespaced cluster
(tools/netns_cluster.py: a standalone master and two workers, each its own network namespace on
a bridge; root only) against the same on ``local[2]``.

Each side is a driver process of its own (the cluster's in the root namespace on the bridge),
timing, after one warm-up run: ``--runs`` launches of one gloo allreduce, and one run of
``--steps`` DDP steps of an MLP 64-256-256-10 on batches of 64 (the mean step time, measured in
rank 0 after 10 warm-up steps). Prints the medians and the ratios hosts / local.

    sudo .venv/bin/python benchmarks/bench_hosts.py [--runs 5] [--steps 200]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def allreduce() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def ddp_steps(steps: int) -> float:
    """Mean seconds per DDP step after 10 warm-up steps, as rank 0 saw it."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                    torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    started = 0.0
    for step in range(steps + 10):
        if step == 10:
            started = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return (time.perf_counter() - started) / steps


def driver(conf: dict[str, str], runs: int, steps: int, ckpt: str) -> dict[str, float]:
    from pyspark.sql import SparkSession

    import sparkdl

    builder = SparkSession.builder.appName("bench-hosts")
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    cfg = sparkdl.RunConfig(progress=False, echo_logs=False)
    sparkdl.run(allreduce, num_workers=2, config=cfg, checkpoint_dir=ckpt)  # warm-up
    launches = []
    for _ in range(runs):
        started = time.perf_counter()
        assert sparkdl.run(allreduce, num_workers=2, config=cfg, checkpoint_dir=ckpt) == 2.0
        launches.append(time.perf_counter() - started)
    step = sparkdl.run(ddp_steps, steps, num_workers=2, config=cfg, checkpoint_dir=ckpt)
    spark.stop()
    return {"launch_s": statistics.median(launches), "step_ms": 1000 * step}


def _side(conf: dict[str, str], env: dict[str, str], args: argparse.Namespace, ckpt: str) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--driver", json.dumps(conf), "--runs", str(args.runs),
           "--steps", str(args.steps), "--ckpt", ckpt]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"driver failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
    result: dict[str, float] = json.loads(lines[-1].split(" ", 1)[1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="timed launches per side (default 5)")
    parser.add_argument("--steps", type=int, default=200, help="timed DDP steps (default 200)")
    parser.add_argument("--driver", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.driver is not None:
        print("RESULT " + json.dumps(driver(json.loads(args.driver), args.runs, args.steps, args.ckpt)), flush=True)
        return
    spec = importlib.util.spec_from_file_location("netns_cluster", ROOT / "tools" / "netns_cluster.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    sys.modules["netns_cluster"] = tool
    spec.loader.exec_module(tool)
    reason = tool.NetnsCluster.available()
    if reason:
        raise SystemExit(f"no namespaced hosts here: {reason}")
    local_env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
    local_conf = {"spark.master": "local[2]", "spark.ui.enabled": "false", "spark.driver.host": "127.0.0.1"}
    with tempfile.TemporaryDirectory(prefix="bench-hosts-") as tmp:
        local = _side(local_conf, local_env, args, f"{tmp}/ckpt")
    with tool.NetnsCluster(workers=2, cores=1, memory="1g", keep=[ROOT]) as cluster:
        time.sleep(2)
        conf = {**cluster.driver_conf(), "spark.executor.memory": "512m"}
        hosts = _side(conf, cluster.driver_env(), args, f"{cluster.shared}/ckpt")
    print(f"{'':24}{'local[2]':>12}{'2 hosts':>12}{'hosts/local':>14}")
    print(f"{'warm launch, median (s)':24}{local['launch_s']:12.2f}{hosts['launch_s']:12.2f}"
          f"{hosts['launch_s'] / local['launch_s']:14.2f}")
    print(f"{'DDP step (ms)':24}{local['step_ms']:12.2f}{hosts['step_ms']:12.2f}{hosts['step_ms'] / local['step_ms']:14.2f}")


if __name__ == "__main__":
    main()
