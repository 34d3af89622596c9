"""Sharded checkpoints: every rank writes the shards it holds into one checkpoint.

A model sharded with FSDP (``torch.distributed.fsdp.fully_shard``) or tensor parallelism holds
its parameters and optimizer state as ``DTensor`` shards, one part on each rank; no rank has the
whole. A sharded checkpoint is written by every rank at once with ``torch.distributed.checkpoint``
(DCP) into a directory of its own, ``shards-<seq>-<token>``, and committed by rank 0 writing the
checkpoint's file ``ckpt-<seq>.pt`` (atomically, like every checkpoint of the store) once every
rank's shards and DCP's metadata are written. Only that file makes the checkpoint count, so a
crash of any rank during the save leaves the previous checkpoint the latest: a checkpoint with a
missing shard is never loaded.

What goes where: ``DTensor`` leaves go to DCP; everything else (plain tensors, numbers, the
loader's position, RNG states) stays in rank 0's commit file, which loads with
``weights_only=True`` as every checkpoint does. DCP's own metadata file is a pickle; it is read
with an unpickler that builds DCP's metadata classes and torch's sizes and dtypes only, so a
planted checkpoint cannot run code here either.

Loading needs the ``DTensor`` s to load into (the model and optimizer as they are sharded now,
e.g. from ``get_state_dict``): DCP reads each rank's part of them from whatever shards were
written, so a checkpoint written by 4 ranks loads on 2 (or 8), resharded.
"""

from __future__ import annotations

import json
import pickle
import re
import secrets
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sparkdl._internal.common.errors import SparkDLError
from sparkdl._internal.train.store import (
    SHARDED,
    CheckpointStore,
    nonfinite_paths,
    refuse_nonfinite,
)

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
    return [json.loads(t[:n].cpu().numpy().tobytes()) for t, n in zip(out, sizes, strict=True)]


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


# -- DCP's storage, with its metadata read safely -------------------------------------------------


_METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
})


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata (its dataclasses, torch sizes, dtypes and layouts) and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        found = super().find_class(module, name) if (module, name) in _METADATA_GLOBALS else None
        if module == "torch.distributed.checkpoint.metadata":
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:
                found = obj
        elif module == "torch" and found is None:
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                found = obj
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")
        return found


def _unlike_sparkdls(metadata: Any, expected: frozenset[str]) -> str | None:
    """What in DCP's ``metadata`` sparkdl's own sharded save could not have written; None when nothing.

    sparkdl's save hands DCP ``DTensor`` s only, under the paths of the commit record's skeleton,
    with one data file per rank: every entry is a tensor's, stored in a ``__<rank>_<n>.distcp``
    file of the checkpoint's own directory. Byte entries above all are refused: DCP reads them
    with ``torch.load(weights_only=False)``, which runs code from the shard file.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

    if type(metadata) is not Metadata:
        return f"it is a {type(metadata).__name__}, not DCP's Metadata"
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        return "its entries are not a dict"
    for key, entry in entries.items():
        if type(entry) is not TensorStorageMetadata:
            return f"entry {key!r} is a {type(entry).__name__}; sparkdl writes tensors only"
    if set(entries) != expected:
        extra = sorted(set(entries) - expected)[:3]
        lacking = sorted(expected - set(entries))[:3]
        return f"its entries are not the commit record's sharded tensors (extra: {extra}, missing: {lacking})"
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        return "its storage map is not a dict"
    for index, info in storage.items():
        if type(index) is not MetadataIndex or index.fqn not in entries:
            return f"its storage map names {index!r}, which is no entry of it"
        if (type(info) is not _StorageInfo or not isinstance(info.relative_path, str)
                or not re.match(r"^__\d+_\d+\.distcp$", info.relative_path)):
            return f"entry {index.fqn!r} is stored at {getattr(info, 'relative_path', info)!r}, not in a shard file of its own directory"
    return None


class _SafeMetadata:
    """Mixed into DCP's readers: their ``read_metadata`` with :class:`_MetadataUnpickler`, then
    checked against what sparkdl's own save writes (:func:`_unlike_sparkdls`)."""

    expected: frozenset[str] = frozenset()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))  # type: ignore[attr-defined]
        with self.fs.create_stream(path, "rb") as f:  # type: ignore[attr-defined]
            try:
                metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as exc:
                raise SparkDLError(
                    f"the sharded checkpoint's metadata {path} holds what no checkpoint metadata holds "
                    f"({exc}); sparkdl did not load it, since that could run code from the file. Delete "
                    "the checkpoint, and keep checkpoint_dir where only you can write"
                ) from None
        odd = _unlike_sparkdls(metadata, self.expected)
        if odd:
            raise SparkDLError(
                f"the sharded checkpoint's metadata {path} is not one sparkdl's save writes: {odd}. sparkdl did "
                "not load it (a planted checkpoint could run code this way). Delete the checkpoint, and keep "
                "checkpoint_dir where only you can write"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[attr-defined]
        return metadata


def _local_path(url: str) -> str | None:
    return url[len("file://"):] if url.startswith("file://") else None


def _writer(url: str, sync: bool) -> Any:
    # Not fsynced unless asked (RunConfig.checkpoint_sync), like every file of the store: what a
    # process wrote survives its crash, and fsync per shard cost 4-6x the save's time here
    # (benchmarks/bench_checkpoint.py). A host crash may then tear a shard: the commit record's
    # sizes catch that, and a restore falls back.
    local = _local_path(url)
    if local is not None:
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(local, single_file_per_rank=True, sync_files=sync)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(url, single_file_per_rank=True, sync_files=sync)


def _reader(url: str, expected: frozenset[str]) -> Any:
    local = _local_path(url)
    base: type
    if local is not None:
        from torch.distributed.checkpoint import FileSystemReader

        base = FileSystemReader
    else:  # fsspec's, which needs fsspec
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        base = FsspecReader
    safe = type("SafeReader", (_SafeMetadata, base), {"expected": expected})
    return safe(local if local is not None else url)


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
        bad = [p for found in all_gather_json(nonfinite_paths(obj)) for p in found]
        if bad:
            refuse_nonfinite({p: float("nan") for p in bad}, f"the sharded checkpoint of {store.url}")
    seq = broadcast_seq(store.next_seq() if _rank() == 0 else None)
    if seq is None:
        raise SparkDLError("rank 0 found no checkpoint number to write")
    # Every rank must name the same directory; the writer and the token keep a crashed
    # attempt's shards apart, and tell which the next commit may remove.
    token = all_gather_json(secrets.token_hex(4) if _rank() == 0 else "")[0]
    writer = f"{store.writer.tag}-" if store.writer is not None else ""
    name = f"shards-{seq:08d}-{writer}{token}"
    dcp.save(shards, storage_writer=_writer(f"{store.url}/{name}", store.sync))
    # dcp.save returns on every rank after the metadata is written; rank 0 commits, and tells
    # the others whether it did, so that a refused commit fails every rank, none waits.
    failure: BaseException | None = None
    if _rank() == 0:
        try:
            store.commit(seq, {SHARDED: 1, "shards": name, "skeleton": skeleton}, weights_only=weights_only,
                         shards=name)
        except BaseException as exc:
            failure = exc
    committed = broadcast_seq(seq if _rank() == 0 and failure is None else None)
    if failure is not None:
        raise failure
    if committed != seq:
        raise SparkDLError(f"rank 0 did not commit checkpoint {seq} of {store.url}; its error says why")
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
            f"checkpoint {seq} of {store.url} holds sharded tensors that `into` has no sharded tensor for: "
            f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; pass the model's and "
            "optimizer's sharded state dicts (get_state_dict(model, optimizer)) under the keys they were saved"
        )
    request = {p: targets[p] for p in wanted}
    if request:
        dcp.load(request, storage_reader=_reader(f"{store.url}/{record['shards']}", frozenset(wanted)))
    return join(skeleton, request)
