"""The checks of ``tools/gpu-check`` that run inside the rank processes (see ``gpu_check.py``).

Each takes the rank's ``sparkdl.context()`` and the options the driver sent, and returns what it
saw (one line) or raises with what went wrong. Every rank runs every check in the same order, so
the collectives inside them meet, and a check runs all of its collectives before it judges what
it saw: a rank whose values are wrong still takes part in every collective, and reports after.
"""

from __future__ import annotations

import os
import shutil
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist


class Problems:
    """What a check found wrong, raised at its end (after its collectives) as one AssertionError."""

    def __init__(self) -> None:
        self.found: list[str] = []

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            self.found.append(what)

    def raise_any(self) -> None:
        if self.found:
            raise AssertionError("; ".join(self.found))


def _gather(ctx: Any, obj: Any) -> list[Any]:
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def _barrier(ctx: Any) -> None:
    if ctx.device.type == "cuda":
        dist.barrier(device_ids=[0])
    else:
        dist.barrier()


def check_environment(ctx: Any, opts: dict[str, Any]) -> str:
    """The rank's variables and device: its own GPU as cuda:0 (GPU), or its place on the host (CPU)."""
    env, p = os.environ, Problems()
    r, w = ctx.rank, ctx.world_size
    uuids = _gather(ctx, str(torch.cuda.get_device_properties(0).uuid) if opts["cuda"] else None)
    p.expect((env["RANK"], env["WORLD_SIZE"]) == (str(r), str(w)), f"RANK={env['RANK']} WORLD_SIZE={env['WORLD_SIZE']}")
    local = (ctx.local_rank, ctx.local_world_size, env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"])
    if not opts["cuda"]:
        p.expect(str(ctx.device) == "cpu" and env.get("CUDA_VISIBLE_DEVICES") == "", f"device {ctx.device}")
        # Every rank runs on 127.0.0.1: LOCAL_RANK numbers the ranks of the host, as torchrun's do.
        p.expect(local == (r, w, str(r), str(w)), f"(local_rank, local_world_size, LOCAL_RANK, LOCAL_WORLD_SIZE)={local}")
        p.raise_any()
        return f"device cpu, RANK {r} of {w}, LOCAL_RANK {r} of {w} (ranks on one host)"
    want = opts["addresses"][r]
    visible = env.get("CUDA_VISIBLE_DEVICES")
    p.expect(visible == want, f"CUDA_VISIBLE_DEVICES={visible!r}, but this rank's address is {want!r}")
    p.expect(torch.cuda.device_count() == 1, f"sees {torch.cuda.device_count()} GPUs, not just its own")
    p.expect(str(ctx.device) == "cuda:0" and torch.cuda.current_device() == 0,
             f"device {ctx.device}, current device {torch.cuda.current_device()}")
    p.expect(local == (0, 1, "0", "1"), f"(local_rank, local_world_size, LOCAL_RANK, LOCAL_WORLD_SIZE)={local}")
    p.expect(len(set(uuids)) == w, f"ranks share GPUs: {uuids}")
    p.raise_any()
    return (f"CUDA_VISIBLE_DEVICES={visible}: 1 GPU ({torch.cuda.get_device_name(0)}), device cuda:0, "
            f"LOCAL_RANK 0 of 1, {w} distinct GPU(s) over {w} rank(s)")


def check_process_group(ctx: Any, kind: str) -> str:
    """all_reduce and broadcast of tensors on ``kind`` ("cpu" or "cuda") over the default group."""
    dev = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    backend, w, p = str(dist.get_backend()), ctx.world_size, Problems()
    t = torch.full((1024,), float(ctx.rank + 1), device=dev)
    dist.all_reduce(t)
    b = torch.full((8,), float(ctx.rank), device=dev)
    dist.broadcast(b, src=0)
    _barrier(ctx)
    if ctx.device.type == "cuda":
        p.expect("nccl" in backend and "gloo" in backend, f"backend {backend!r}, not cpu:gloo,cuda:nccl")
    p.expect(bool((t == w * (w + 1) / 2).all()), f"all_reduce gave {t[:3].tolist()}")
    p.expect(bool((b == 0).all()), f"broadcast gave {b[:3].tolist()}")
    p.raise_any()
    version = torch.cuda.nccl.version() if kind == "cuda" else None
    nccl = f", NCCL {'.'.join(map(str, version)) if isinstance(version, tuple) else version}" if version else ""
    return f"all_reduce, broadcast and barrier over {w} rank(s); backend {backend!r}{nccl}"


def check_ddp(ctx: Any) -> str:
    """One DDP step: gradients are the mean of the ranks' own, parameters equal afterwards."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = ctx.device
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(dev)
    alone = copy.deepcopy(model)  # the same parameters (same seed on every rank), outside DDP
    ddp = DDP(model, device_ids=[0] if dev.type == "cuda" else None)
    x = torch.arange(32.0, device=dev).reshape(4, 8) * (ctx.rank + 1) / 10
    ddp(x).pow(2).sum().backward()
    alone(x).pow(2).sum().backward()
    mean = torch.cat([q.grad.flatten() for q in alone.parameters() if q.grad is not None])
    dist.all_reduce(mean)
    mean /= ctx.world_size
    got = torch.cat([q.grad.flatten() for q in model.parameters() if q.grad is not None])
    torch.optim.SGD(ddp.parameters(), lr=0.1).step()
    params = _gather(ctx, torch.cat([q.detach().flatten() for q in model.parameters()]).cpu())
    p = Problems()
    p.expect(torch.allclose(got, mean, rtol=1e-5, atol=1e-5), f"DDP's gradients are off by {(got - mean).abs().max().item()}")
    p.expect(all(torch.equal(q, params[0]) for q in params), "parameters differ between ranks after the step")
    p.raise_any()
    return f"gradients are the mean over {ctx.world_size} rank(s), parameters equal on every rank after SGD"


def check_train_state(ctx: Any, opts: dict[str, Any]) -> str:
    """Train a DDP model 6 steps with a checkpoint at step 4, then resume a fresh model, optimizer
    and loader from it, as a rerun of the gang does."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sparkdl

    dev, p = ctx.device, Problems()
    ds = sparkdl.Dataset(opts["small"])

    def fresh(seed: int) -> tuple[Any, Any, Any]:
        torch.manual_seed(seed)
        model = DDP(torch.nn.Linear(256, 10).to(dev), device_ids=[0] if dev.type == "cuda" else None)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2), ds.loader(64, seed=1, to_device=True)

    model, opt, loader = fresh(0)
    state = sparkdl.TrainState(model, opt, loader)
    gen = state.batches(epochs=1, save_every=4)
    saved: dict[str, torch.Tensor] = {}
    for batch in gen:
        p.expect(batch["x"].device == dev, f"a batch is on {batch['x'].device}")
        if state.global_step == 4:  # checkpoint 4 was written before this batch was handed out
            saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if state.global_step == 6:
            break
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()
    gen.close()
    loader.close()
    # The checkpoint holds rank 0's model: every rank compares what it restores with rank 0's
    # weights at step 4. A rank's own replica is not bitwise the same in every run: once here
    # (2026-11-25, Adam on 2 CPU ranks) rank 1's step-4 weights differed from the checkpoint that
    # rank 0's matched.
    held = [saved]
    dist.broadcast_object_list(held, src=0)
    saved = held[0]
    steps = len(loader)
    expected = list(ds.loader(64, seed=1, device="cpu"))
    model, opt, loader = fresh(1)
    state = sparkdl.TrainState(model, opt, loader)
    gen = state.batches(epochs=1)
    first = next(gen)
    p.expect(bool(saved), f"the first run ended before step 4 ({steps} steps per epoch)")
    p.expect(state.restored_from is not None, "no checkpoint was restored")
    p.expect(loader.step == 5 and torch.equal(first["x"].cpu(), expected[4]["x"]),
             f"resumed at loader step {loader.step - 1}, not 4, or with another batch")
    for k, v in model.state_dict().items():
        p.expect(v.device == dev and k in saved and torch.equal(v, saved[k]), f"{k} restored on {v.device}, or with other values")
    moments = {t.device for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0}
    p.expect(moments == {dev}, f"Adam's state restored on {moments}")
    gen.close()
    loader.close()
    rngs = ctx.checkpoints.load()["rng"]
    cuda_rng = all("cuda" in r for r in rngs)
    p.expect(cuda_rng or dev.type != "cuda", "the checkpoint holds no CUDA RNG state")
    seq = state.restored_from
    _barrier(ctx)
    if ctx.rank == 0:  # the launcher leaves the run's checkpoints; this check's are of no use
        url = str(ctx.checkpoint_url)
        path = urlparse(url).path if "://" in url else url
        shutil.rmtree(os.path.dirname(path.rstrip("/")), ignore_errors=True)
    p.raise_any()
    return (f"checkpoint {seq} at step 4 of {steps} restored into a fresh DDP model on {dev}: parameters, "
            f"Adam's state on {dev}, loader position and next batch as saved"
            f"{', CUDA RNG states saved' if cuda_rng else ''}")


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def check_loader(ctx: Any, opts: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The loader feeding the rank's device: pinned batches, and ``to_device`` batches."""
    import sparkdl

    dev = ctx.device
    ds = sparkdl.Dataset(opts["small"])
    plain = ds.loader(64, seed=2, device="cpu")
    want = list(plain)
    out: list[tuple[str, str, str]] = []
    name = f"loader pins memory for {dev}"
    if dev.type != "cuda":
        out.append(("SKIP", name, "needs CUDA"))
    else:
        try:
            b = next(iter(ds.loader(64, seed=2)))  # the run's device: cuda:0
            _expect(b["x"].device.type == "cpu" and b["x"].is_pinned() and b["y"].is_pinned(), "batches are not pinned")
            out.append(("PASS", name, "CPU batches in pinned memory, for non_blocking copies"))
        except Exception as exc:
            out.append(("FAIL", name, f"{type(exc).__name__}: {exc}"))
    name = f"loader to_device=True feeds {dev}"
    try:
        moved = ds.loader(64, seed=2, to_device=True)
        # The loop runs on a stream of its own: each batch must be ready on that stream too.
        stream = torch.cuda.Stream() if dev.type == "cuda" else None
        got = []
        with torch.cuda.stream(stream) if stream is not None else _nothing():
            for b in moved:
                _expect(b["x"].device == dev, f"a batch arrived on {b['x'].device}")
                got.append({k: (v * 1).cpu() for k, v in b.items()})
        same = all(torch.equal(a[k], b[k]) for a, b in zip(want, got, strict=True) for k in a)
        _expect(same, "batches differ from the CPU loader's")
        _expect(moved.state_dict() == plain.state_dict(), "its position differs from the CPU loader's")
        out.append(("PASS", name, f"{len(got)} batches on {dev}, equal to the CPU loader's, same position"))
    except Exception as exc:
        out.append(("FAIL", name, f"{type(exc).__name__}: {exc}"))
    return out


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def check_feed(ctx: Any, opts: dict[str, Any]) -> tuple[str, str, str]:
    """The data-wait figures of ``benchmarks/bench_gpu_feed.py`` on this rank's device, alone."""
    import bench_gpu_feed

    import sparkdl

    dev = ctx.device
    ds = sparkdl.Dataset(opts["feed"])
    figures = bench_gpu_feed.measure(ds, dev, batch_size=opts["batch"], hidden=opts["hidden"],
                                     layers=opts["layers"], epochs=opts["epochs"])
    by = {f.name: f for f in figures}
    wait = by["to_device"].wait_fraction
    head = (f"{100 * wait:.1f}% of step time waiting for data with to_device "
            f"({ds.num_rows} rows of 256 float32, batch {opts['batch']}, MLP 256-"
            f"{'-'.join([str(opts['hidden'])] * opts['layers'])}-10 on {dev})")
    detail = "\n".join([head, *bench_gpu_feed.report(figures)])
    if dev.type != "cuda":
        return ("PASS", "data wait (to_device)", detail + f"\nthe {100 * opts['wait_target']:.0f}% target is for GPUs")
    ok = wait < opts["wait_target"]
    return ("PASS" if ok else "FAIL", "data wait (to_device)",
            detail + f"\ntarget: below {100 * opts['wait_target']:.0f}%")
