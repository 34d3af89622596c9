"""Sharded checkpoints: every rank writes the shards it holds into one checkpoint.

A model sharded with FSDP (``torch.distributed.fsdp.fully_shard``) or tensor parallelism holds
its parameters and optimizer state as ``DTensor`` shards, one part on each rank; no rank has the
whole. A sharded checkpoint is written by every rank at once with ``torch.distributed.checkpoint``
(DCP), each rank alone (:mod:`sparkdl._internal.ckpt.dcp_files`), into a directory of its own,
``shards-<seq>-<writer>-<token>``, and committed by rank 0 writing the checkpoint's file
``ckpt-<seq>.pt`` and its commit record (atomically, like every checkpoint of the store) once
every rank said, as JSON, which files it wrote. Only the record makes the checkpoint count, and it
lists every shard file with its size: a crash of any rank during the save leaves the previous
checkpoint the latest, and a shard lost or torn later makes a restore fall back to the one before.

What goes where: ``DTensor`` leaves go to DCP; everything else (plain tensors, numbers, the
loader's position, RNG states) stays in rank 0's commit file, which loads with
``weights_only=True`` as every checkpoint does. DCP's metadata files are pickles; they are read
with an unpickler that builds DCP's metadata classes and torch's sizes and dtypes only, and must
then be what sparkdl's save writes, so a planted checkpoint cannot run code here either. Nothing
of a save or a load travels between ranks as a pickle: sparkdl's own collectives carry JSON and
integers as tensors, and DCP runs without its own.

Loading needs the ``DTensor`` s to load into (the model and optimizer as they are sharded now,
e.g. from ``get_state_dict``): DCP reads each rank's part of them from whatever shards were
written, so a checkpoint written by 4 ranks loads on 2 (or 8), resharded.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sparkdl._internal.ckpt import dcp_files
from sparkdl._internal.ckpt.finite import nonfinite_paths, refuse_nonfinite
from sparkdl._internal.ckpt.store import SHARDED, CheckpointStore
from sparkdl._internal.common.errors import SparkDLError
from sparkdl._internal.fs.storage import redact

if TYPE_CHECKING:
    import torch

_MARK = "__sparkdl_dtensor__"


# -- collectives of plain values, as tensors: nothing a peer sends is unpickled -------------------


def distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _collective_device() -> torch.device:
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend())
    # sparkdl's own group on GPUs is "cpu:gloo,cuda:nccl"; only a group of the user's that is
    # NCCL alone needs the tensors on the GPU.
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_json(obj: Any) -> list[Any]:
    """``obj`` (JSON-able) of every rank, in rank order: lengths first, then the padded bytes."""
    import torch
    import torch.distributed as dist

    if not distributed():
        return [obj]
    device = _collective_device()
    data = json.dumps(obj, separators=(",", ":")).encode()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(dist.get_world_size())]
    dist.all_gather(lengths, length)
    sizes = [int(n.item()) for n in lengths]
    mine = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    out = [torch.empty_like(mine) for _ in sizes]
    dist.all_gather(out, mine)
    values = []
    for rank, (t, n) in enumerate(zip(out, sizes, strict=True)):
        try:
            values.append(json.loads(t[:n].cpu().numpy().tobytes()))
        except ValueError:
            raise SparkDLError(
                f"rank {rank} sent what is not JSON where sparkdl's exchange between ranks expects JSON; "
                "it was refused, never unpickled. Something other than sparkdl joined the run's process "
                "group: keep executors on a network only your cluster reaches"
            ) from None
    return values


def broadcast_seq(seq: int | None) -> int | None:
    """Rank 0's checkpoint sequence number (or None), on every rank."""
    import torch
    import torch.distributed as dist

    if not distributed():
        return seq
    box = torch.tensor([-1 if seq is None else seq], dtype=torch.int64, device=_collective_device())
    dist.broadcast(box, src=0)
    value = int(box.item())
    return None if value < 0 else value


def latest(store: CheckpointStore) -> int | None:
    """Rank 0's newest checkpoint of ``store`` that verifies, on every rank: all load the same one.
    Newer ones that do not verify (torn, missing shards, no commit record) are skipped, and rank 0
    says which and why (:meth:`CheckpointStore.newest_good`)."""
    return broadcast_seq(store.newest_good()[0] if _rank() == 0 else None)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if distributed() else 0


# -- which leaves are shards ----------------------------------------------------------------------


def _is_dtensor(value: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor has no sharded models
        return False
    return isinstance(value, DTensor)


def is_sharded_module(module: Any) -> bool:
    """Whether any parameter of ``module`` is a ``DTensor`` (FSDP2 ``fully_shard``, tensor parallel)."""
    params = getattr(module, "parameters", None)
    return callable(params) and any(_is_dtensor(p) for p in params())


def _key(k: Any) -> str:
    if isinstance(k, str):
        return k.replace("%", "%25").replace("/", "%2F")
    return f"#{k!r}"


def split(obj: Any, path: str = "") -> tuple[Any, dict[str, Any]]:
    """``obj`` with every ``DTensor`` replaced by a marker naming its path, and those DTensors by path."""
    found: dict[str, Any] = {}

    def walk(value: Any, at: str) -> Any:
        if _is_dtensor(value):
            found[at] = value
            return {_MARK: at}
        if isinstance(value, dict):
            return {k: walk(v, f"{at}/{_key(k)}" if at else _key(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [walk(v, f"{at}/[{i}]") for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return value

    return walk(obj, path), found


def _markers(skeleton: Any) -> Iterator[str]:
    if isinstance(skeleton, dict):
        if set(skeleton) == {_MARK}:
            yield skeleton[_MARK]
            return
        for v in skeleton.values():
            yield from _markers(v)
    elif isinstance(skeleton, (list, tuple)):
        for v in skeleton:
            yield from _markers(v)


def join(skeleton: Any, tensors: dict[str, Any]) -> Any:
    """The inverse of :func:`split`: markers replaced by the tensors they name."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {_MARK}:
            return tensors[skeleton[_MARK]]
        return {k: join(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [join(v, tensors) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(join(v, tensors) for v in skeleton)
    return skeleton


# -- save and load --------------------------------------------------------------------------------


def save(store: CheckpointStore, obj: Any, *, weights_only: bool = True) -> int:
    """Writes ``obj`` as the next checkpoint, every rank its own shards; returns its number.

    Every rank of the run calls it with its own ``obj`` (the same structure everywhere; the
    values other than ``DTensor`` s are taken from rank 0). It returns once the checkpoint is
    committed, on every rank.
    """
    import torch.distributed.checkpoint as dcp

    store.check_writable()  # on every rank, before any writes its shards
    skeleton, shards = split(obj)
    if store.finite_only:
        # Every rank looks at its own shards, and all refuse together: no rank is left waiting.
        bad = sorted({p for found in all_gather_json(nonfinite_paths(obj)) for p in found})
        refuse_nonfinite(bad, f"the sharded checkpoint of {redact(store.url)}")
    seq = broadcast_seq(store.next_seq() if _rank() == 0 else None)
    if seq is None:
        raise SparkDLError("rank 0 found no checkpoint number to write")
    # Every rank must name the same directory; the writer and the token keep a crashed
    # attempt's shards apart, and tell which the next commit may remove.
    token = all_gather_json(secrets.token_hex(4) if _rank() == 0 else "")[0]
    writer = f"{store.writer.tag}-" if store.writer is not None else ""
    name = f"shards-{seq:08d}-{writer}{token}"
    url = f"{store.url}/{name}"
    # Each rank alone: no plan of DCP's travels between ranks (as a pickle). What each wrote
    # reaches rank 0 as JSON, once all are done (a rank that failed says so instead).
    try:
        with dcp_files.quiet():
            dcp.save(shards, storage_writer=dcp_files.writer(url, store.sync, _rank()), no_dist=True,
                     use_collectives=False)
        wrote: dict[str, Any] = dcp_files.describe_rank(url, _rank())
    except Exception as exc:
        wrote = {"error": f"{type(exc).__name__}: {exc}"}
    reports = all_gather_json(wrote)
    failed = [f"rank {r}: {w['error']}" for r, w in enumerate(reports) if "error" in w]
    if failed:
        raise SparkDLError(f"the sharded save of checkpoint {seq} of {redact(store.url)} failed, so it was not "
                           f"committed: {'; '.join(failed)}")
    # Rank 0 commits, and tells the others whether it did, so that a refused commit fails
    # every rank and none waits.
    failure: BaseException | None = None
    if _rank() == 0:
        files: dict[str, int] = {}
        sums: dict[str, str] = {}
        for w in reports:
            files.update(w["files"])
            sums.update(w["metadata_sha256"])
        described = {"dir": name, "files": files, "metadata_sha256": sums}
        try:
            store.commit(seq, {SHARDED: 1, "shards": name, "skeleton": skeleton, "ranks": len(reports)},
                         weights_only=weights_only, shards=described)
        except BaseException as exc:
            failure = exc
    committed = broadcast_seq(seq if _rank() == 0 and failure is None else None)
    if failure is not None:
        raise failure
    if committed != seq:
        raise SparkDLError(f"rank 0 did not commit checkpoint {seq} of {redact(store.url)}; its error says why")
    return seq


def load(store: CheckpointStore, seq: int, into: Any, *, weights_only: bool = True) -> Any:
    """Checkpoint ``seq`` (sharded or not), with its ``DTensor`` s loaded into those of ``into``.

    ``into`` holds the ``DTensor`` s to load into, at the paths they were saved from (e.g.
    ``{"model": model_state_dict, "optimizer": optim_state_dict}`` when that was saved); they are
    filled in place. Every rank calls it. A checkpoint saved without shards is returned as is.
    """
    import torch.distributed.checkpoint as dcp

    record = store.load(seq, weights_only=weights_only, sharded_ok=True)
    if not (isinstance(record, dict) and record.get(SHARDED)):
        return record
    skeleton = record["skeleton"]
    _, targets = split(into)
    wanted = list(_markers(skeleton))
    missing = [p for p in wanted if p not in targets]
    if missing:
        raise SparkDLError(
            f"checkpoint {seq} of {redact(store.url)} holds sharded tensors that `into` has no sharded tensor for: "
            f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; pass the model's and "
            "optimizer's sharded state dicts (get_state_dict(model, optimizer)) under the keys they were saved"
        )
    request = {p: targets[p] for p in wanted}
    if request:
        url = f"{store.url}/{record['shards']}"
        expected = frozenset(wanted)
        parts = [dcp_files.read_rank_metadata(url, r, expected) for r in range(_saved_ranks(record, url))]
        merged = dcp_files.merge(parts, expected, redact(url))
        with dcp_files.quiet():
            dcp.load(request, storage_reader=dcp_files.reader(url, merged), no_dist=True)
    return join(skeleton, request)


def _saved_ranks(record: dict[str, Any], url: str) -> int:
    ranks = record.get("ranks")
    if isinstance(ranks, int) and ranks > 0:
        return ranks
    raise SparkDLError(
        f"the sharded checkpoint {redact(url)} was written by an earlier sparkdl, whose ranks exchanged DCP's "
        "plans as pickles; this version reads only checkpoints it wrote. Load it with that version, or "
        "start the run over"
    )
