"""sparkdl's GPU path, checked without Spark: what ``tools/gpu-check [--cpu]`` runs.

It needs torch, pyarrow and numpy, and neither Java nor pyspark: it runs on a GPU machine where
nothing else can be installed. The ranks are started by sparkdl's driver-local launcher, the one
behind ``TorchDistributor(local_mode=True)``, so they are the very rank processes of a cluster
run (environment, process group, device, ``sparkdl.context()``), given GPU addresses as Spark
would give them. One line per check: ``PASS``, ``FAIL`` or ``SKIP``, its name, what it saw.
The exit status is 1 when any check failed.

``--cpu`` runs the same checks on the CPU (gloo, ``cpu``), skipping only those that need CUDA;
it is part of ``tools/test``. Without ``--cpu`` a CUDA GPU is required: one rank per GPU (at
most 8; the addresses are this process's ``CUDA_VISIBLE_DEVICES``, else every GPU torch sees).
Either way a first launch gives two ranks fake addresses (``1000`` and ``1001,1002``) that no
GPU answers to, to check the environment they produce.

The rank side is :func:`rank_checks` and ``gpu_check_rank.py``; the data-wait figures come from
``benchmarks/bench_gpu_feed.py``; the image checks (nvJPEG) are ``gpu_check_images.py`` (all on
``PYTHONPATH``, as ``tools/gpu-check`` sets it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Result = tuple[str, str, str]  # (PASS | FAIL | SKIP, check, detail)
# CPU addresses that no GPU has: the plumbing is checked, and torch finds no device behind them.
FAKE_ADDRESSES = ["1000", "1001,1002"]
WAIT_TARGET = 0.05


def _attempt(name: str, check: Callable[[], str | Result]) -> Result:
    """Runs one check: its detail (PASS), the result it returns, or FAIL with the exception."""
    try:
        out = check()
    except Exception as exc:
        return ("FAIL", name, f"{type(exc).__name__}: {exc}")
    return out if isinstance(out, tuple) else ("PASS", name, out)


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


# -- the rank side: runs in every rank process of the launch ----------------------------------


def rank_checks(opts: dict[str, Any]) -> list[Result]:
    """Every rank runs the same checks, in the same order; rank 0 returns them, merged over ranks."""
    import torch.distributed as dist
    from gpu_check_rank import (
        check_ddp,
        check_environment,
        check_feed,
        check_loader,
        check_process_group,
        check_train_state,
    )

    import sparkdl

    ctx = sparkdl.context()
    cuda = opts["cuda"]
    local: list[Result] = [
        _attempt("rank environment", lambda: check_environment(ctx, opts)),
        _attempt("process group, CPU tensors (gloo)", lambda: check_process_group(ctx, "cpu")),
        _attempt("process group, CUDA tensors (nccl)", lambda: check_process_group(ctx, "cuda"))
        if cuda else ("SKIP", "process group, CUDA tensors (nccl)", "needs CUDA"),
        _attempt(f"DDP training step on {ctx.device}", lambda: check_ddp(ctx)),
        _attempt(f"TrainState checkpoint and resume on {ctx.device}", lambda: check_train_state(ctx, opts)),
    ]
    local += check_loader(ctx, opts)
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, local)
    if ctx.rank != 0:
        return []
    merged = [_merge([g[i] for g in gathered]) for i in range(len(local))]
    # Last, on rank 0 alone (the others have returned): the figures of one GPU fed by one loader.
    merged.append(_attempt("data wait (to_device)", lambda: check_feed(ctx, opts)))
    return merged


def _merge(per_rank: list[Result]) -> Result:
    """One line for a check run on every rank: the first failure, else rank 0's result."""
    for r, res in enumerate(per_rank):
        if res[0] == "FAIL":
            return ("FAIL", res[1], f"rank {r}: {res[2]}")
    status, name, detail = per_rank[0]
    return (status, name, detail if len(per_rank) == 1 else f"{detail} [{len(per_rank)} ranks agree]")


def addresses_rank(expected: list[str]) -> dict[str, Any]:
    """What a rank launched with (fake) GPU addresses sees: its environment and its context."""
    import torch

    import sparkdl

    ctx = sparkdl.context()
    return {
        "rank": ctx.rank,
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "gpu_ids": list(ctx.gpu_ids),
        "local": (ctx.local_rank, ctx.local_world_size, os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")),
        "device": str(ctx.device),
        "visible": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "expected": expected[ctx.rank],
    }


def two_gpus_rank() -> dict[str, Any]:
    """A rank given two GPUs: it sees both, as cuda:0 and cuda:1, and is LOCAL_RANK 0 of 1."""
    import torch

    import sparkdl

    ctx = sparkdl.context()
    a = torch.ones(4, device="cuda:0")
    b = (a.to("cuda:1") * 2).to("cuda:0")
    return {
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "count": torch.cuda.device_count(),
        "device": str(ctx.device),
        "local": (os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")),
        "uuids": [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())],
        "sum": float(b.sum().item()),
    }


# -- the driver side ---------------------------------------------------------------------------


def _check_no_pyspark() -> str:
    import sparkdl
    import sparkdl._internal.data.loader
    import sparkdl._internal.driver.local
    import sparkdl._internal.ml.scoring
    import sparkdl._internal.train.state  # noqa: F401

    loaded = sorted(m for m in sys.modules if m == "pyspark" or m.startswith("pyspark."))
    _expect(not loaded, f"importing them loaded {loaded[:5]}")
    try:  # only now, to tell which machine this is
        import pyspark  # noqa: F401

        here = "importable here"
    except ImportError:
        here = "not importable here"
    return f"sparkdl, the driver-local launcher, the loader, TrainState and the scorer load no pyspark (pyspark {here})"


def _launch(fn: Callable[..., Any], args: tuple[Any, ...], n: int, gpu_ids: list[str] | None,
            timeout_s: float, echo: bool = True) -> Any:
    from sparkdl import RunConfig
    from sparkdl._internal.driver.local import run_on_driver

    cfg = RunConfig(timeout_s=timeout_s, collective_timeout_s=min(120.0, timeout_s), progress=False,
                    echo_logs=echo, prewarm=False)
    return run_on_driver(fn, args, {}, num_processes=n, backend="torch", gpu_ids=gpu_ids, config=cfg)


def _check_addresses(timeout_s: float) -> str:
    """Ranks given fake addresses (one, then two): the environment Spark's addresses produce."""
    seen = _launch(_gather_addresses, (FAKE_ADDRESSES,), len(FAKE_ADDRESSES), FAKE_ADDRESSES, timeout_s, echo=False)
    for s in seen:
        want = s["expected"]
        _expect(s["CUDA_VISIBLE_DEVICES"] == want, f"rank {s['rank']}: CUDA_VISIBLE_DEVICES={s['CUDA_VISIBLE_DEVICES']!r}, want {want!r}")
        _expect(s["gpu_ids"] == want.split(","), f"rank {s['rank']}: context().gpu_ids={s['gpu_ids']}, want {want.split(',')}")
        _expect(s["local"] == (0, 1, "0", "1"), f"rank {s['rank']}: (local_rank, local_world_size, LOCAL_RANK, LOCAL_WORLD_SIZE)={s['local']}")
        _expect(s["visible"] == 0 and s["device"] == "cpu", f"rank {s['rank']}: {s['visible']} devices, device {s['device']}")
    return "; ".join(f"rank {s['rank']}: CUDA_VISIBLE_DEVICES={s['CUDA_VISIBLE_DEVICES']}" for s in seen) + (
        ", LOCAL_RANK 0 of 1 each; no GPU behind these fake addresses, so each fell back to cpu"
    )


def _gather_addresses(expected: list[str]) -> list[dict[str, Any]]:
    import gpu_check
    import torch.distributed as dist

    mine = gpu_check.addresses_rank(expected)
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def _check_two_gpus(addresses: list[str], timeout_s: float) -> Result:
    name = "a rank with 2 GPUs (spark.task.resource.gpu.amount=2)"
    if len(addresses) < 2:
        return ("SKIP", name, f"needs 2 GPUs; this machine shows {len(addresses)}")
    import gpu_check

    # One rank, two addresses: the environment Spark's two addresses for one task give it.
    s = _launch(gpu_check.two_gpus_rank, (), 1, [",".join(addresses[:2])], timeout_s)
    _expect(s["CUDA_VISIBLE_DEVICES"] == ",".join(addresses[:2]), f"CUDA_VISIBLE_DEVICES={s['CUDA_VISIBLE_DEVICES']}")
    _expect(s["count"] == 2 and len(set(s["uuids"])) == 2, f"sees {s['count']} devices {s['uuids']}")
    _expect(s["device"] == "cuda:0" and s["local"] == ("0", "1"), f"device {s['device']}, LOCAL_RANK/LOCAL_WORLD_SIZE {s['local']}")
    _expect(s["sum"] == 8.0, f"a copy through cuda:1 gave {s['sum']}")
    return ("PASS", name, f"CUDA_VISIBLE_DEVICES={s['CUDA_VISIBLE_DEVICES']}: cuda:0 and cuda:1, device cuda:0, LOCAL_RANK 0 of 1")


def _check_scoring(cuda: bool) -> list[Result]:
    """TorchModel's scoring function (``sparkdl._internal.ml.scoring``), called without Spark."""
    import cloudpickle
    import numpy as np
    import pyarrow as pa
    import torch

    from sparkdl._internal.ml import scoring
    from sparkdl._internal.ml.fit_plan import REGRESSION

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    x = np.random.default_rng(0).standard_normal((3000, 16), dtype=np.float32)
    arr = pa.ListArray.from_arrays(pa.array(np.arange(0, x.size + 1, 16, dtype=np.int32)), pa.array(x.reshape(-1)))
    with torch.no_grad():
        want = model(torch.from_numpy(x)).reshape(-1).double().numpy()

    def score(use_gpu: bool) -> tuple[np.ndarray, str]:
        data = cloudpickle.dumps(model)
        scorer = scoring.Scorer(model_id=scoring.model_id_of(data), source=data, task=REGRESSION,
                                num_features=16, batch_rows=1024, use_gpu=use_gpu, features_col="features",
                                vector_out=False)
        out = list(scoring._score_batches(scorer, iter([arr.slice(0, 1700), arr.slice(1700)])))
        device = str(next(scoring._worker_model(scorer)[0].parameters()).device)
        return np.concatenate([o.to_numpy() for o in out]), device

    def on_cpu() -> str:
        got, device = score(False)
        _expect(device == "cpu" and np.allclose(got, want, atol=1e-5), f"on {device}: off by {np.abs(got - want).max()}")
        return f"3000 rows in 2 Arrow batches on {device}: the model's own outputs"

    def on_cuda() -> str:
        # Spark's TaskContext.resources() is not here: the task's GPU address is given as "0".
        scoring._task_gpu = lambda: "0"
        got, device = score(True)
        _expect(device == "cuda:0", f"the model is on {device}")
        _expect(np.allclose(got, want, atol=1e-4), f"off by {np.abs(got - want).max()} from the CPU")
        return f"3000 rows in 2 Arrow batches on {device} ({torch.cuda.get_device_name(0)}): the CPU's outputs within 1e-4"

    return [
        _attempt("TorchModel scoring function (cpu)", on_cpu),
        _attempt("TorchModel scoring function on cuda", on_cuda) if cuda
        else ("SKIP", "TorchModel scoring function on cuda", "needs CUDA"),
    ]


def _gpu_addresses() -> list[str]:
    import torch

    given = [a.strip() for a in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if a.strip()]
    return given[: torch.cuda.device_count()] if given else [str(i) for i in range(torch.cuda.device_count())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="the same checks on the CPU; CUDA-only ones are skipped")
    parser.add_argument("--rows", type=int, default=None, help="rows for the data-wait figure (GPU 1048576, CPU 16384)")
    parser.add_argument("--timeout", type=float, default=None, help="bound on each launch, in seconds")
    args = parser.parse_args(argv)
    started = time.monotonic()

    import torch

    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        print(f"FAIL  CUDA  torch {torch.__version__} sees no GPU (torch.cuda.is_available() is False); "
              "run tools/gpu-check --cpu for the CPU checks")
        return 1
    addresses = _gpu_addresses() if cuda else []
    where = f"{len(addresses)} GPU(s) {addresses} ({torch.cuda.get_device_name(0)})" if cuda else "CPU"
    print(f"gpu-check: torch {torch.__version__} (CUDA {torch.version.cuda}), {where}, python {sys.version.split()[0]}")
    timeout_s = args.timeout or (540.0 if cuda else 120.0)
    results: list[Result] = [_attempt("no pyspark on the path", _check_no_pyspark)]
    # Fake addresses on a GPU machine too: no device is behind them, so every rank runs on the CPU.
    results.append(_attempt("ranks get CUDA_VISIBLE_DEVICES from their addresses", lambda: _check_addresses(timeout_s)))
    results.append(_attempt("a rank with 2 GPUs (spark.task.resource.gpu.amount=2)", lambda: _check_two_gpus(addresses, timeout_s))
                   if cuda else ("SKIP", "a rank with 2 GPUs (spark.task.resource.gpu.amount=2)", "needs CUDA"))
    tmp = Path(tempfile.mkdtemp(prefix="sparkdl-gpu-check-"))
    try:
        from bench_gpu_feed import write_rows

        rows = args.rows or (1_048_576 if cuda else 16_384)
        write_rows(tmp / "feed", rows)
        write_rows(tmp / "small", 8192, files=2, row_group_rows=512)
        opts = {
            "cuda": cuda, "addresses": addresses, "feed": str(tmp / "feed"), "small": str(tmp / "small"),
            "batch": 4096 if cuda else 2048, "hidden": 2048 if cuda else 128, "layers": 3 if cuda else 2,
            "epochs": 2 if cuda else 1, "wait_target": WAIT_TARGET,
        }
        import gpu_check

        n = min(len(addresses), 8) if cuda else 2
        try:
            results += _launch(gpu_check.rank_checks, (opts,), n, addresses[:n] if cuda else None, timeout_s)
        except Exception as exc:
            results.append(("FAIL", f"the launch of {n} ranks", f"{type(exc).__name__}: {exc}"))
        from gpu_check_images import image_checks

        results += image_checks(cuda, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results += _check_scoring(cuda)
    for status, name, detail in results:
        for i, line in enumerate(detail.split("\n")):
            print(f"{status:<4}  {name}: {line}" if i == 0 else f"      {line}")
    failed = sum(r[0] == "FAIL" for r in results)
    skipped = sum(r[0] == "SKIP" for r in results)
    print(f"gpu-check: {len(results) - failed - skipped} passed, {failed} failed, {skipped} skipped "
          f"in {time.monotonic() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    import gpu_check  # by its name, so that ranks import this module rather than unpickle a copy

    sys.exit(gpu_check.main())
