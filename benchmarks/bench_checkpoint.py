"""Checkpoint time of an FSDP-sharded model and its Adam state: sharded against rank 0 alone.

Each of ``--ranks`` processes (gloo, CPU) holds its shards of the same MLP, sharded with FSDP2
(``fully_shard``) after one Adam step, so the optimizer state is there too. Timed, best of
``--repeat``, each in the same run:

- sharded save: ``sparkdl._internal.ckpt.sharded.save`` (every rank writes its own shards with
  ``torch.distributed.checkpoint``, rank 0 commits), and its load into the sharded model;
- rank-0 save: what a loop without sharded checkpoints does, gathering the whole model and
  optimizer state on rank 0 (``get_state_dict`` with ``full_state_dict=True``) and writing one
  file with ``CheckpointStore.save`` (``torch.save``), and loading it back (every rank reads the
  file and keeps its part, ``set_state_dict`` with ``full_state_dict=True``).

The rank-0 load is timed against reading the file and trusting it, as restores did before
commit records (each restore now checks the data's SHA-256 first). Both saves are timed again
with ``RunConfig.checkpoint_sync`` (every file and directory entry
fsynced before the commit counts), against the same saves without it. Every load verifies the
checkpoint against its commit record first (sizes, SHA-256 of the data file and of DCP's metadata).

Prints the times, the checkpoint's size, the sharded/rank-0 ratios and the fsync/no-fsync ratios.

    .venv/bin/python benchmarks/bench_checkpoint.py [--ranks 2] [--hidden 2048] [--layers 6]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(hidden: int, layers: int) -> Any:
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU()) for _ in range(layers)]
    net = torch.nn.Sequential(*blocks)
    for block in blocks:
        fully_shard(block)
    fully_shard(net)
    return net


def _timed(fn: Any, repeat: int) -> float:
    import torch.distributed as dist

    best = float("inf")
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        best = min(best, time.perf_counter() - start)
    return best


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, root: str, out: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    from sparkdl._internal.ckpt import sharded
    from sparkdl._internal.ckpt.store import CheckpointStore

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    net = _model(args.hidden, args.layers)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net(torch.randn(8, args.hidden)).sum().backward()
    opt.step()

    sharded_store = CheckpointStore(f"{root}/sharded", keep=1)
    full_store = CheckpointStore(f"{root}/rank0", keep=1)
    synced = {"sharded": CheckpointStore(f"{root}/sharded-sync", keep=1, sync=True),
              "rank0": CheckpointStore(f"{root}/rank0-sync", keep=1, sync=True)}

    def sharded_save(store: CheckpointStore = sharded_store) -> None:
        msd, osd = get_state_dict(net, opt)
        sharded.save(store, {"model": msd, "optimizer": osd})

    def sharded_load() -> None:
        msd, osd = get_state_dict(net, opt)
        seq = sharded.latest(sharded_store)
        assert seq is not None
        ckpt = sharded.load(sharded_store, seq, {"model": msd, "optimizer": osd})
        set_state_dict(net, opt, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optimizer"])

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def full_save(store: CheckpointStore = full_store) -> None:
        msd, osd = get_state_dict(net, opt, options=full)
        if rank == 0:
            store.save({"model": msd, "optimizer": osd})

    def full_load(verified: bool = True) -> None:
        if verified:
            ckpt = full_store.load()
        else:  # the file read as it is, trusting it: what restores did before commit records
            path = max(Path(root, "rank0").glob("ckpt-*.pt"))
            ckpt = torch.load(io.BytesIO(path.read_bytes()), map_location="cpu", weights_only=True)
        set_state_dict(net, opt, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optimizer"],
                       options=StateDictOptions(full_state_dict=True))

    figures = {
        "sharded_save": _timed(sharded_save, args.repeat),
        "sharded_load": _timed(sharded_load, args.repeat),
        "rank0_save": _timed(full_save, args.repeat),
        "rank0_load": _timed(full_load, args.repeat),
        "rank0_load_unverified": _timed(lambda: full_load(verified=False), args.repeat),
        "sharded_save_sync": _timed(lambda: sharded_save(synced["sharded"]), args.repeat),
        "rank0_save_sync": _timed(lambda: full_save(synced["rank0"]), args.repeat),
    }
    if rank == 0:
        size = sum(p.stat().st_size for p in Path(root, "rank0").glob("ckpt-*.pt"))
        out.put({**figures, "bytes": size})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="sparkdl-bench-ckpt-")
    try:
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args, root, queue)) for r in range(args.ranks)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=900)
            if p.exitcode != 0:
                for q in procs:
                    q.kill()
                print(f"a rank failed (exit code {p.exitcode})", file=sys.stderr)
                return 1
        figures = queue.get()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    params = args.layers * (args.hidden * args.hidden + args.hidden)
    print(f"{args.ranks} ranks, {params / 1e6:.1f}M parameters + Adam state, checkpoint {figures['bytes'] / 2**20:.0f} MiB")
    for what in ("save", "load"):
        s, r = figures[f"sharded_{what}"], figures[f"rank0_{what}"]
        print(f"{what}: sharded {s:.2f} s, rank-0 torch.save {r:.2f} s: ratio {s / r:.2f}")
    verified, trusted = figures["rank0_load"], figures["rank0_load_unverified"]
    print(f"rank-0 load, verified against its commit record: {verified:.2f} s against {trusted:.2f} s trusting the "
          f"file: ratio {verified / trusted:.2f}")
    for how in ("sharded", "rank0"):
        plain, synced = figures[f"{how}_save"], figures[f"{how}_save_sync"]
        print(f"save with checkpoint_sync, {how}: {synced:.2f} s against {plain:.2f} s without: ratio {synced / plain:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
