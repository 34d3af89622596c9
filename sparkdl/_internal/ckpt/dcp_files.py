"""The files of a sharded checkpoint: each rank writes its own, alone; they are read back only
as sparkdl writes them.

Every rank saves its shards with ``torch.distributed.checkpoint`` (DCP) and none of DCP's own
collectives (``use_collectives=False``): into the checkpoint's shard directory it writes its data
``__<rank>_0.distcp`` and its own metadata ``__<rank>.metadata``, and tells sparkdl what it wrote
(sizes, the metadata's SHA-256) as JSON. DCP's coordinated save and load gather and scatter their
plans with ``gather_object`` and ``scatter_object_list``, which unpickle what any peer on the
unauthenticated gloo group sends; here no plan travels between ranks, so no pickle does.

Loading reads every rank's metadata with an unpickler that builds DCP's metadata classes, torch's
sizes and dtypes and nothing else, checks that each is what sparkdl's save writes (tensor entries
only, stored in that rank's own data file), merges them into one, and lets each rank read what it
needs with ``no_dist=True``: resharding 4 ranks' shards onto 2 is DCP's planner, run locally.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import posixpath
import re
import warnings
from collections.abc import Iterator
from typing import Any

from sparkdl._internal.ckpt import records
from sparkdl._internal.common.errors import SparkDLError
from sparkdl._internal.fs.storage import filesystem, redact

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


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """DCP run on this rank alone, as sparkdl means it: without DCP's warning that it assumes so."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def metadata_name(rank: int) -> str:
    return f"__{rank}.metadata"


def unlike_sparkdls(metadata: Any, rank: int, expected: frozenset[str]) -> str | None:
    """What in rank ``rank``'s DCP ``metadata`` sparkdl's own sharded save could not have written;
    None when nothing.

    sparkdl's save hands DCP ``DTensor`` s only, under the paths of the commit record's skeleton:
    every entry is a tensor's, stored in the rank's own ``__<rank>_<n>.distcp`` file of the
    checkpoint's directory. Byte entries above all are refused: DCP reads them with
    ``torch.load(weights_only=False)``, which runs code from the shard file.
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
    extra = sorted(set(entries) - expected)
    if extra:
        return f"it has entries that are no sharded tensor of the commit record: {extra[:3]}"
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        return "its storage map is not a dict"
    own = re.compile(rf"^__{rank}_\d+\.distcp$")
    for index, info in storage.items():
        if type(index) is not MetadataIndex or index.fqn not in entries:
            return f"its storage map names {index!r}, which is no entry of it"
        if type(info) is not _StorageInfo or not isinstance(info.relative_path, str) or not own.match(info.relative_path):
            return (f"entry {index.fqn!r} is stored at {getattr(info, 'relative_path', info)!r}, not in rank "
                    f"{rank}'s own shard file")
    return None


def read_rank_metadata(url: str, rank: int, expected: frozenset[str]) -> Any:
    """Rank ``rank``'s metadata in the shard directory ``url``, unpickled safely and checked."""
    fs, root = filesystem(url)
    path = posixpath.join(root, metadata_name(rank))
    with fs.open_input_stream(path) as f:
        raw = f.read()
    where = f"{redact(url)}/{metadata_name(rank)}"
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
        raise SparkDLError(
            f"the sharded checkpoint's metadata {where} holds what no checkpoint metadata holds "
            f"({exc}); sparkdl did not load it, since that could run code from the file. Delete "
            "the checkpoint, and keep checkpoint_dir where only you can write"
        ) from None
    odd = unlike_sparkdls(metadata, rank, expected)
    if odd:
        raise SparkDLError(
            f"the sharded checkpoint's metadata {where} is not one sparkdl's save writes: {odd}. sparkdl did "
            "not load it (a planted checkpoint could run code this way). Delete the checkpoint, and keep "
            "checkpoint_dir where only you can write"
        )
    return metadata


def merge(parts: list[Any], expected: frozenset[str], where: str) -> Any:
    """The metadata of the whole checkpoint from every rank's: each tensor's chunks, from all."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

    entries: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    for part in parts:
        for key, entry in part.state_dict_metadata.items():
            seen = entries.get(key)
            if seen is None:
                entries[key] = TensorStorageMetadata(entry.properties, entry.size, list(entry.chunks))
            elif seen.size != entry.size or seen.properties.dtype != entry.properties.dtype:
                raise SparkDLError(f"the sharded checkpoint {where} has ranks that disagree on the shape of {key!r}")
            else:
                seen.chunks.extend(entry.chunks)
        storage.update(part.storage_data)
        if isinstance(part.planner_data, dict):
            planner.update(part.planner_data)
    lacking = sorted(expected - set(entries))
    if lacking:
        raise SparkDLError(f"the sharded checkpoint {where} has no shards of {lacking[:3]}: it is incomplete")
    return Metadata(state_dict_metadata=entries, planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta())


def _local_path(url: str) -> str | None:
    return url[len("file://"):] if url.startswith("file://") else None


def writer(url: str, sync: bool, rank: int) -> Any:
    """DCP's writer of rank ``rank``'s own files in the shard directory ``url``, for
    ``dcp.save(..., no_dist=True, use_collectives=False)``: DCP then runs no collective, and the
    writer names the files after the rank (with ``no_dist`` DCP takes every process for rank 0).

    Not fsynced unless asked (``RunConfig.checkpoint_sync``), like every file of the store: what
    a process wrote survives its crash, and fsync per shard cost 4-6x the save's time here
    (benchmarks/bench_checkpoint.py). A host crash may then tear a shard: the commit record's
    sizes catch that, and a restore falls back.
    """
    local = _local_path(url)
    base: type
    if local is not None:
        from torch.distributed.checkpoint import FileSystemWriter

        base = FileSystemWriter
    else:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        base = FsspecWriter

    def set_up_storage_writer(self: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        base.set_up_storage_writer(self, is_coordinator, *args, **{**kwargs, "rank": rank, "use_collectives": False})

    def _metadata_exists(self: Any) -> bool:
        return False  # a new directory for every save: another rank's metadata there is its own

    own = type("RankWriter", (base,), {"set_up_storage_writer": set_up_storage_writer,
                                        "_metadata_exists": _metadata_exists})
    return own(local if local is not None else url, single_file_per_rank=True, sync_files=sync)


def reader(url: str, metadata: Any) -> Any:
    """DCP's reader of the shard directory ``url`` whose whole metadata is ``metadata`` (merged)."""
    local = _local_path(url)
    base: type
    if local is not None:
        from torch.distributed.checkpoint import FileSystemReader

        base = FileSystemReader
    else:  # fsspec's, which needs fsspec
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        base = FsspecReader

    def read_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
        metadata.storage_meta.load_id = self.load_id
        return metadata

    merged = type("MergedReader", (base,), {"read_metadata": read_metadata})
    return merged(local if local is not None else url)


def describe_rank(url: str, rank: int) -> dict[str, Any]:
    """What rank ``rank`` wrote into the shard directory ``url``: its files' sizes and its
    metadata's SHA-256, for the commit record."""
    import pyarrow.fs as pafs

    fs, root = filesystem(url)
    mine = re.compile(rf"^__{rank}(_\d+\.distcp|\.metadata)$")
    files = {posixpath.basename(i.path): i.size for i in fs.get_file_info(pafs.FileSelector(root))
             if i.type == pafs.FileType.File and mine.match(posixpath.basename(i.path))}
    with fs.open_input_stream(posixpath.join(root, metadata_name(rank))) as f:
        sha = records.digest(f.read())
    return {"files": files, "metadata_sha256": {metadata_name(rank): sha}}
