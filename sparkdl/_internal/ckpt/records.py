"""A checkpoint's commit record: what the checkpoint holds, written last, checked before it is trusted.

Checkpoint ``N`` is its data file ``ckpt-N.pt`` and its record ``ckpt-N.json``. The data file is
written under a temporary name and moved into place; then the record is, the same way, and only
the record makes the checkpoint count. It is plain JSON: the writer (run and attempt), the data
file's size and SHA-256, and for a sharded checkpoint its shard directory with every rank's
files, their sizes and the SHA-256 of each rank's DCP metadata.

Writes are not fsynced by default (``RunConfig.checkpoint_sync``), so a host that crashes may
leave a record whose data file is empty or short; a writer killed between the two leaves a data
file with no record. Neither is trusted: :func:`problem` says why, and the store falls back to
the newest checkpoint that verifies.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from typing import Any

FORMAT = 1
# Only the files each rank's DCP writer makes (sparkdl._internal.ckpt.dcp_files): a record naming
# anything else (a path with a slash, "..") was not made by sparkdl.
SHARD_FILE = re.compile(r"^__\d+(_\d+\.distcp|\.metadata)$")


NO_RECORD = "it has no commit record (its save stopped before it committed)"


def record_name(seq: int) -> str:
    return f"ckpt-{seq:08d}.json"


def data_name(seq: int) -> str:
    return f"ckpt-{seq:08d}.pt"


def digest(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def build(seq: int, data: bytes | memoryview, writer: str | None, shards: dict[str, Any] | None) -> bytes:
    """The record of checkpoint ``seq`` whose data file holds ``data``."""
    record: dict[str, Any] = {"format": FORMAT, "seq": seq, "size": len(data), "sha256": digest(data),
                              "writer": writer}
    if shards is not None:
        record["shards"] = shards
    return json.dumps(record, sort_keys=True).encode()


def parse(raw: bytes, seq: int) -> dict[str, Any] | str:
    """The record in ``raw``, or why it is not one of checkpoint ``seq``."""
    try:
        record = json.loads(raw)
    except ValueError:
        return f"its commit record is not JSON ({len(raw)} bytes: torn)"
    if not isinstance(record, dict) or record.get("format") != FORMAT or record.get("seq") != seq:
        return "its commit record is not one sparkdl wrote for it"
    if not isinstance(record.get("size"), int) or not isinstance(record.get("sha256"), str):
        return "its commit record lacks the data file's size and checksum"
    shards = record.get("shards")
    if shards is not None:
        shards = shards if isinstance(shards, dict) else {}
        files, name, sums = shards.get("files"), shards.get("dir"), shards.get("metadata_sha256")
        if (not isinstance(name, str) or "/" in name or name.startswith(".") or not isinstance(files, dict)
                or not all(isinstance(k, str) and SHARD_FILE.match(k) and isinstance(v, int) for k, v in files.items())
                or not isinstance(sums, dict) or not sums
                or not all(k in files and k.endswith(".metadata") and isinstance(v, str) for k, v in sums.items())):
            return "its commit record names shard files that sparkdl's sharded save does not write"
    return record


def data_problem(record: dict[str, Any], data: bytes | memoryview) -> str | None:
    """Why ``data`` is not the data file ``record`` committed; None when it is."""
    if len(data) != record["size"]:
        what = "empty" if not data else f"{len(data)} bytes"
        return f"its data file is {what}, its commit record says {record['size']} (torn: written but not synced?)"
    if digest(data) != record["sha256"]:
        return "its data file's checksum differs from the one its commit record holds (torn, or overwritten)"
    return None


def shards_problem(fs: Any, root: str, shards: dict[str, Any]) -> str | None:
    """Why the shard directory ``shards`` describes is not as committed; None when it is."""
    import pyarrow.fs as pafs

    base = posixpath.join(root, shards["dir"])
    found = {posixpath.basename(i.path): i for i in fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))}
    for name, size in sorted(shards["files"].items()):
        info = found.get(name)
        if info is None or info.type != pafs.FileType.File:
            return f"its shard file {shards['dir']}/{name} is missing"
        if info.size != size:
            return f"its shard file {shards['dir']}/{name} is {info.size} bytes, its commit record says {size} (torn)"
    for name, sha in sorted(shards["metadata_sha256"].items()):
        with fs.open_input_stream(posixpath.join(base, name)) as f:
            if digest(f.read()) != sha:
                return f"its shard metadata {shards['dir']}/{name} differs from the one committed"
    return None
