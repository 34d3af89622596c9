"""Step time per rank of three backends on 2 ranks: DDP (backend="torch"), Horovod with its Gloo
controller, and Horovod with its MPI controller (``RunConfig(horovod_controller="mpi")``, when
Horovod was built with MPI and Open MPI 4 is here).

The same MLP, data, batch size and optimizer; each rank times its own training steps after a
warm-up, and rank 0 reports the median over ranks. Prints each and its ratio to DDP's.

    .venv/bin/python benchmarks/bench_backends.py [--steps 200] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def _model(hidden: int) -> Any:
    import torch

    return torch.nn.Sequential(torch.nn.Linear(256, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def _batches(rank: int, steps: int) -> list[tuple[Any, Any]]:
    import torch

    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(128, 256, generator=g), torch.randint(0, 10, (128,), generator=g)) for _ in range(steps)]


def _timed(model: Any, opt: Any, batches: list[tuple[Any, Any]], warmup: int) -> list[float]:
    import time

    import torch

    times = []
    for i, (x, y) in enumerate(batches):
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def ddp(steps: int, hidden: int) -> float:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sparkdl

    torch.manual_seed(0)
    model = DDP(_model(hidden))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    med = torch.tensor([statistics.median(_timed(model, opt, _batches(sparkdl.context().rank, steps), 20))])
    dist.all_reduce(med)
    return med.item() / dist.get_world_size()


def horovod(steps: int, hidden: int) -> float:
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.manual_seed(0)
    model = _model(hidden)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    med = statistics.median(_timed(model, opt, _batches(hvd.rank(), steps), 20))
    return float(hvd.allreduce(torch.tensor([med]), op=hvd.Average).item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="training steps per rank (default 200)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden width of the MLP (default 1024)")
    args = parser.parse_args()
    import sparkdl
    import sparkdl._internal.backends
    from sparkdl._internal.spark.session import create_session

    spark = create_session("local[2]", {"spark.ui.enabled": "false"}, "sparkdl-bench", "local[2]")
    spark.sparkContext.setLogLevel("ERROR")
    quiet = sparkdl.RunConfig(echo_logs=False)
    t_ddp = sparkdl.run(ddp, args.steps, args.hidden, num_workers=2, config=quiet)
    t_hvd = sparkdl.run(horovod, args.steps, args.hidden, num_workers=2, backend="horovod", config=quiet)
    mpi = quiet.replace(horovod_controller="mpi")
    try:
        sparkdl._internal.backends.check_driver("horovod", mpi)
        t_mpi: float | None = sparkdl.run(horovod, args.steps, args.hidden, num_workers=2, backend="horovod",
                                          config=mpi)
    except sparkdl.BackendUnavailableError as exc:
        t_mpi, why = None, str(exc)
    print(f"model: MLP 256-{args.hidden}-10, batch 128 per rank, {args.steps} steps, 2 ranks on local[2]")
    print(f"DDP (gloo)      median step time per rank {t_ddp * 1000:.2f} ms")
    print(f"Horovod (gloo)  median step time per rank {t_hvd * 1000:.2f} ms  ratio to DDP {t_hvd / t_ddp:.3f}")
    if t_mpi is None:
        print(f"Horovod (mpi)   not measured: {why}")
    else:
        print(f"Horovod (mpi)   median step time per rank {t_mpi * 1000:.2f} ms  ratio to DDP {t_mpi / t_ddp:.3f}, "
              f"to Horovod (gloo) {t_mpi / t_hvd:.3f}")
    spark.stop()


if __name__ == "__main__":
    main()
