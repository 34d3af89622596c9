"""Checkpoints on shared storage: one atomic file per checkpoint, the last ``keep`` kept.

A checkpoint is one file, ``ckpt-<seq>.pt`` (``torch.save`` format), in the run's checkpoint
directory, which may be a local or shared path or any URL pyarrow/fsspec reach. It is written to
a temporary name and moved into place, so a crash in the middle of a write leaves the previous
checkpoint the latest complete one. Only complete files count; the last ``keep`` are kept.
A sharded checkpoint (:mod:`sparkdl._internal.train.sharded`) is such a file too, naming the directory
``shards-<seq>-<token>`` that every rank wrote its shards into; it goes when its file goes.

Checkpoints are read back with ``torch.load(weights_only=True)``: tensors, numbers, strings,
``None`` and lists, tuples, dicts and sets of them load; an object of any other class, whose
unpickling could run code from the file, is refused with a :class:`SparkDLError` naming the
file and the refused names. Whoever wrote such a checkpoint themselves loads it with
``weights_only=False``.
"""

from __future__ import annotations

import io
import os
import pickle
import posixpath
import re
import uuid
from typing import TYPE_CHECKING, Any

from sparkdl._internal.common.errors import ConfigError, SparkDLError
from sparkdl._internal.common.validate import int_at_least
from sparkdl._internal.fs.storage import filesystem, make_dirs, normalize_url

if TYPE_CHECKING:
    import pyarrow.fs as pafs

_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")
_SHARDS = re.compile(r"^shards-(\d{8})-[0-9a-f]+$")
SHARDED = "sparkdl_sharded"
"""The key that marks a sharded checkpoint's commit file (see :mod:`sparkdl._internal.train.sharded`)."""


class CheckpointStore:
    """The checkpoints of one run. Plain and picklable: the URL, ``keep`` and ``refused`` are all
    it holds. ``refused``: why nothing may be written here (a directory some host of the gang does
    not share, see :mod:`sparkdl._internal.spark.reach`); reads work, every write raises a ConfigError saying it."""

    def __init__(self, url: str | os.PathLike[str], keep: int = 3, *, refused: str | None = None) -> None:
        int_at_least("keep_checkpoints", keep, 1)
        self.url = normalize_url(url)
        self.keep = keep
        self.refused = refused

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r}, keep={self.keep})"

    def child(self, name: str) -> CheckpointStore:
        """The store of a subdirectory (a rank's own checkpoints), under the same terms."""
        return CheckpointStore(f"{self.url}/{name}", keep=self.keep, refused=self.refused)

    def check_writable(self) -> None:
        """Raises the ConfigError of a store that must not be written (``refused``)."""
        if self.refused is not None:
            raise ConfigError(self.refused)

    def _fs(self) -> tuple[pafs.FileSystem, str]:
        return filesystem(self.url)

    def sequence_numbers(self) -> list[int]:
        """Sequence numbers of the complete checkpoints, oldest first."""
        import pyarrow.fs as pafs

        fs, root = self._fs()
        infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
        found = []
        for info in infos:
            match = _NAME.match(posixpath.basename(info.path))
            if match and info.type == pafs.FileType.File:
                found.append(int(match.group(1)))
        return sorted(found)

    def latest(self) -> int | None:
        seqs = self.sequence_numbers()
        return seqs[-1] if seqs else None

    def save(self, obj: Any, *, weights_only: bool = False) -> int:
        """Writes ``obj`` as the next checkpoint, atomically; returns its sequence number.

        With ``weights_only=True``, an ``obj`` that :meth:`load` would refuse under its default
        (it holds objects of classes other than tensors, numbers, strings and containers) is
        refused now, with a :class:`SparkDLError` naming them, and nothing is written.
        """
        return self.commit((self.latest() or 0) + 1, obj, weights_only=weights_only)

    def commit(self, seq: int, obj: Any, *, weights_only: bool = False, shards: str | None = None) -> int:
        """Writes ``obj`` as checkpoint ``seq``, atomically, then lets go of what is no longer kept:
        checkpoints beyond the last ``keep``, their shard directories, the shard directories of
        saves that never committed (other than ``shards``, this checkpoint's own), and temporary
        files of writers that crashed."""
        self.check_writable()
        import pyarrow.fs as pafs
        import torch

        buf = io.BytesIO()
        torch.save(obj, buf)
        if weights_only:
            refused = _refused_names(buf.getvalue())
            if refused:
                raise SparkDLError(
                    f"this checkpoint holds objects that loading it with weights_only=True would refuse "
                    f"({', '.join(refused)}); keep to tensors, numbers, strings, lists, tuples and dicts "
                    "(state_dicts are), or, to keep such objects, pass weights_only=False (to "
                    "TrainState(...), or to CheckpointStore.save and .load)"
                )
        fs, root = self._fs()
        make_dirs(fs, root)
        final = posixpath.join(root, f"ckpt-{seq:08d}.pt")
        tmp = posixpath.join(root, f".tmp-ckpt-{seq:08d}-{uuid.uuid4().hex}")
        with fs.open_output_stream(tmp) as out:
            out.write(buf.getbuffer())
        fs.move(tmp, final)
        kept = set(self.sequence_numbers()[-self.keep :])
        for info in fs.get_file_info(pafs.FileSelector(root)):
            name = posixpath.basename(info.path)
            done, shard = _NAME.match(name), _SHARDS.match(name)
            if done and int(done.group(1)) not in kept:
                fs.delete_file(info.path)
            elif shard and (int(shard.group(1)) not in kept or (int(shard.group(1)) == seq and name != shards)):
                fs.delete_dir(info.path)
            elif name.startswith(".tmp-ckpt-") and info.path != tmp:
                # Temporary files of earlier writers that crashed mid-write are garbage now.
                fs.delete_file(info.path)
        return seq

    def load(self, seq: int | None = None, *, weights_only: bool = True, sharded_ok: bool = False) -> Any:
        """The checkpoint ``seq`` (default: the latest complete one), or None when there is none.

        Args:
            seq: the sequence number of the checkpoint to read; None: the latest complete one.
            weights_only: True (the default) loads tensors, numbers, strings and containers of
                them only, and never runs code from the file: a checkpoint that holds anything
                else raises :class:`SparkDLError` naming the file and what was refused. False
                unpickles anything, which runs whatever code the file holds: pass it only for
                checkpoints you wrote yourself, on storage nobody else writes to.
            sharded_ok: return a sharded checkpoint's commit record (for
                :mod:`sparkdl._internal.train.sharded`); by default a sharded checkpoint raises
                :class:`SparkDLError`, since its shards load only inside the run.
        """
        import torch

        if seq is None:
            seq = self.latest()
            if seq is None:
                return None
        fs, root = self._fs()
        name = f"ckpt-{seq:08d}.pt"
        with fs.open_input_file(posixpath.join(root, name)) as f:
            data = f.read()
        try:
            obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
        except pickle.UnpicklingError as exc:
            if not weights_only:
                raise
            raise _refused(f"{self.url}/{name}", data, exc) from None
        if not sharded_ok and isinstance(obj, dict) and obj.get(SHARDED):
            raise SparkDLError(
                f"checkpoint {self.url}/{name} is sharded: every rank wrote its part of the model with "
                "torch.distributed.checkpoint. Load it inside the run, on every rank, into the sharded "
                "model: with sparkdl.TrainState, or sparkdl.context().load_checkpoint(into=...)"
            )
        return obj


def _refused_names(data: bytes) -> list[str]:
    """The classes and functions named in the ``torch.save`` bytes ``data`` that a weights-only
    load refuses, sorted; empty when there are none, or when this torch cannot tell (before 2.5).
    The bytes are only read, never unpickled."""
    from torch import serialization

    scan = getattr(serialization, "get_unsafe_globals_in_checkpoint", None)
    if scan is None:
        return []
    try:
        return sorted(scan(io.BytesIO(data)))
    except Exception:  # not a torch.save zip file: the load itself reports it
        return []


def _refused(where: str, data: bytes, exc: Exception) -> SparkDLError:
    """The error for a checkpoint that a weights-only load refused, naming what it refused."""
    refused = ", ".join(_refused_names(data))
    if not refused:
        # torch's own message names the refused global or opcode on one of its lines.
        lines = [line.strip() for line in str(exc).splitlines()]
        refused = next((line for line in lines if "unsupported" in line.lower()), lines[-1] if lines else repr(exc))
    hint = ""
    if "numpy" in refused:
        hint = " (numpy: earlier versions of sparkdl kept numpy's RNG state as an array in TrainState checkpoints)"
    return SparkDLError(
        f"checkpoint {where} holds objects that a weights-only load refuses: {refused}{hint}. Loading them "
        "would run code from the file, so sparkdl did not; checkpoints of TrainState and of state_dicts "
        "never hold any. If you wrote this checkpoint yourself (custom objects in TrainState(extra=...) or "
        "save_checkpoint), load it with weights_only=False: TrainState(..., weights_only=False), "
        "sparkdl.context().load_checkpoint(weights_only=False) or CheckpointStore.load(weights_only=False). "
        "If you did not, delete it, and keep checkpoint_dir where only you can write"
    )
