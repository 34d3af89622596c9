"""Checkpoints on shared storage: each written atomically, committed by a record, verified before it is trusted.

A checkpoint is its data file ``ckpt-<seq>.pt`` (``torch.save`` format) and its commit record
``ckpt-<seq>.json`` (:mod:`sparkdl._internal.ckpt.records`), in the run's checkpoint directory,
which may be a local or shared path or any URL pyarrow/fsspec reach. Both are written to a
temporary name and moved into place, the record last: a crash at any step leaves the previous
checkpoint the newest committed one. A restore trusts a checkpoint only once its data (and its
shards) match what its record says, and falls back to the newest one that does, saying which it
skipped and why; the last ``keep`` committed checkpoints are kept.
A sharded checkpoint (:mod:`sparkdl._internal.ckpt.sharded`) is such a file too, naming the directory
``shards-<seq>-<writer>-<token>`` that every rank wrote its shards into; it goes when its file goes.

Inside a run, the store knows its writer (the run and attempt, :mod:`sparkdl._internal.ckpt.fence`):
a stale attempt's commit is refused, and a commit removes only what its own run left half-written.

Checkpoints are read back with ``torch.load(weights_only=True)``: tensors, numbers, strings,
``None`` and lists, tuples, dicts and sets of them load; an object of any other class, whose
unpickling could run code from the file, is refused with a :class:`SparkDLError` naming the
file and the refused names. Whoever wrote such a checkpoint themselves loads it with
``weights_only=False``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import posixpath
import re
import sys
import uuid
from typing import TYPE_CHECKING, Any

from sparkdl._internal.ckpt import fence, records
from sparkdl._internal.ckpt.fence import Writer
from sparkdl._internal.ckpt.finite import nonfinite_paths, refuse_nonfinite
from sparkdl._internal.common.errors import ConfigError, SparkDLError
from sparkdl._internal.common.validate import int_at_least
from sparkdl._internal.fs.storage import filesystem, make_dirs, normalize_url, redact
from sparkdl._internal.wire import rankspec
from sparkdl._internal.wire.messages import SKIPPED_CHECKPOINT_KEY

if TYPE_CHECKING:
    import pyarrow.fs as pafs

_NAME = re.compile(r"^ckpt-(\d{8})\.(pt|json)$")
# shards-<seq>-<token> (an earlier sparkdl, or a writer outside a run), or shards-<seq>-<run>-<attempt>-<token>.
_SHARDS = re.compile(r"^shards-(\d{8})-(?:([0-9a-f]+-\d+)-)?[0-9a-f]+$")
_TMP = re.compile(r"^\.tmp-ckpt-\d{8}-(?:([0-9a-f]+-\d+)-)?[0-9a-f]{32}$")
SHARDED = "sparkdl_sharded"
"""The key that marks a sharded checkpoint's commit file (see :mod:`sparkdl._internal.ckpt.sharded`)."""
# Of a skipped checkpoint's reason, what goes to the driver (its record must fit one atomic write).
_REASON_CHARS = 1000


class CheckpointStore:
    """The checkpoints of one run. Plain and picklable: the URL and settings are all it holds.

    ``refused``: why nothing may be written here (a directory some host of the gang does not
    share, see :mod:`sparkdl._internal.spark.reach`); reads work, every write raises a ConfigError
    saying it. ``writer``: the run and attempt that write (inside a run), fenced against stale
    attempts. ``sync``: fsync every file and directory entry of a commit before it counts
    (``RunConfig.checkpoint_sync``). ``finite_only``: refuse to commit a checkpoint holding a NaN
    or infinite number (``RunConfig.checkpoint_finite_only``)."""

    def __init__(self, url: str | os.PathLike[str], keep: int = 3, *, refused: str | None = None,
                 writer: Writer | None = None, sync: bool = False, finite_only: bool = False) -> None:
        int_at_least("keep_checkpoints", keep, 1)
        self.url = normalize_url(url)
        self.keep = keep
        self.refused = refused
        self.writer = writer
        self.sync = sync
        self.finite_only = finite_only
        # The data file :meth:`verify` just read and found good, for the :meth:`load` that follows
        # (a restore verifies, then loads: one read and one checksum of a large file, not two).
        self._verified: tuple[int, bytes] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_verified": None}

    def __repr__(self) -> str:
        return f"CheckpointStore({redact(self.url)!r}, keep={self.keep})"

    def child(self, name: str) -> CheckpointStore:
        """The store of a subdirectory (a rank's own checkpoints), under the same terms."""
        return CheckpointStore(f"{self.url}/{name}", keep=self.keep, refused=self.refused, writer=self.writer,
                               sync=self.sync, finite_only=self.finite_only)

    def check_writable(self) -> None:
        """Raises the ConfigError of a store that must not be written (``refused``)."""
        if self.refused is not None:
            raise ConfigError(self.refused)

    def _fs(self) -> tuple[pafs.FileSystem, str]:
        return filesystem(self.url)

    def _entries(self) -> dict[str, Any]:
        import pyarrow.fs as pafs

        fs, root = self._fs()
        return {posixpath.basename(i.path): i for i in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))}

    def sequence_numbers(self) -> list[int]:
        """Sequence numbers of the committed checkpoints (a record, and a data file of the size
        it records), oldest first. :meth:`newest_good` also checks their contents."""
        import pyarrow.fs as pafs

        fs, root = self._fs()
        entries = self._entries()
        found = []
        for name, info in entries.items():
            match = _NAME.match(name)
            if not (match and match.group(2) == "json" and info.type == pafs.FileType.File):
                continue
            seq = int(match.group(1))
            data = entries.get(records.data_name(seq))
            record = self._record(fs, root, seq)
            if data is not None and isinstance(record, dict) and data.size == record["size"]:
                found.append(seq)
        return sorted(found)

    def latest(self) -> int | None:
        seqs = self.sequence_numbers()
        return seqs[-1] if seqs else None

    def record(self, seq: int) -> dict[str, Any] | str:
        """Checkpoint ``seq``'s commit record, or why there is none to trust."""
        fs, root = self._fs()
        return self._record(fs, root, seq)

    def _record(self, fs: Any, root: str, seq: int) -> dict[str, Any] | str:
        try:
            with fs.open_input_stream(posixpath.join(root, records.record_name(seq))) as f:
                raw = f.read()
        except FileNotFoundError:
            return records.NO_RECORD
        return records.parse(raw, seq)

    def verify(self, seq: int) -> str | None:
        """Why checkpoint ``seq`` is not to be trusted (torn, missing shards, no commit record);
        None when its data file and shards are as its record says."""
        fs, root = self._fs()
        record = self._record(fs, root, seq)
        if isinstance(record, str):
            return record
        try:
            with fs.open_input_file(posixpath.join(root, records.data_name(seq))) as f:
                data = f.read()
        except FileNotFoundError:
            return "its data file is missing"
        problem = records.data_problem(record, data)
        if problem is None and record.get("shards") is not None:
            problem = records.shards_problem(fs, root, record["shards"])
        self._verified = (seq, data) if problem is None else None
        return problem

    def newest_good(self) -> tuple[int | None, list[tuple[int, str]]]:
        """The newest checkpoint that verifies (None when none does), and the newer ones skipped,
        with why. Each skipped one is also said on stderr. A store with a writer first claims the
        directory for its attempt (:func:`sparkdl._internal.ckpt.fence.claim`)."""
        if self.writer is not None and self.refused is None:
            fence.claim(self.url, self.writer)
        entries = self._entries()
        seqs = sorted({int(m.group(1)) for name in entries if (m := _NAME.match(name))}, reverse=True)
        skipped: list[tuple[int, str]] = []
        for seq in seqs:
            problem = self.verify(seq)
            if problem is None:
                return seq, skipped
            skipped.append((seq, problem))
            print(f"sparkdl: skipped checkpoint {seq} of {redact(self.url)}: {problem}; resuming from an "
                  "older one", file=sys.stderr, flush=True)
            # And to the driver, for the run's result and its report (inside a run; nothing outside).
            note = {SKIPPED_CHECKPOINT_KEY: seq, "reason": problem[:_REASON_CHARS]}
            rankspec.send_record((json.dumps(note, separators=(",", ":")) + "\n").encode())
        return None, skipped

    def save(self, obj: Any, *, weights_only: bool = False) -> int:
        """Writes ``obj`` as the next checkpoint, atomically; returns its sequence number.

        With ``weights_only=True``, an ``obj`` that :meth:`load` would refuse under its default
        (it holds objects of classes other than tensors, numbers, strings and containers) is
        refused now, with a :class:`SparkDLError` naming them, and nothing is written.
        """
        return self.commit(self.next_seq(), obj, weights_only=weights_only)

    def next_seq(self) -> int:
        """One past every checkpoint number in the directory, committed or not: a number is never reused."""
        seqs = [int(m.group(1)) for name in self._entries() if (m := _NAME.match(name))]
        return max(seqs, default=0) + 1

    def commit(self, seq: int, obj: Any, *, weights_only: bool = False, shards: dict[str, Any] | None = None) -> int:
        """Writes ``obj`` as checkpoint ``seq``, atomically, then its commit record, then lets go
        of what is no longer kept: committed checkpoints beyond the last ``keep`` and their shard
        directories, and what this writer's run left half-written (temporary files, shard
        directories of saves that never committed), never another writer's. ``shards``: a
        sharded checkpoint's shard directory as its record describes it (``dir``, ``files``,
        ``metadata_sha256``)."""
        self.check_writable()
        import torch

        if self.finite_only:
            refuse_nonfinite(nonfinite_paths(obj), f"checkpoint {seq} of {redact(self.url)}")
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
        if self.writer is not None:
            fence.claim(self.url, self.writer)
        fs, root = self._fs()
        make_dirs(fs, root)
        data = buf.getbuffer()
        self._put(fs, root, seq, records.data_name(seq), data)
        if self.writer is not None:
            fence.claim(self.url, self.writer)  # again, right before the commit point
        self._put(fs, root, seq, records.record_name(seq),
                  records.build(seq, data, self.writer.tag if self.writer else None, shards))
        self._let_go(fs, root, seq)
        return seq

    def _put(self, fs: Any, root: str, seq: int, name: str, data: bytes | memoryview) -> None:
        """``data`` as ``root/name``, atomically: written to this writer's temporary name, moved."""
        tag = f"{self.writer.tag}-" if self.writer is not None else ""
        tmp = posixpath.join(root, f".tmp-ckpt-{seq:08d}-{tag}{uuid.uuid4().hex}")
        try:
            with fs.open_output_stream(tmp) as out:
                out.write(data)
            if self.sync:
                _fsync(fs, tmp)
            fs.move(tmp, posixpath.join(root, name))
        except BaseException:
            with contextlib.suppress(Exception):
                fs.delete_file(tmp)
            raise
        if self.sync:
            _fsync(fs, root)

    def _shard_dirs(self, fs: Any, root: str, seqs: Any) -> set[str]:
        """The shard directories the commit records of checkpoints ``seqs`` name."""
        named = set()
        for n in seqs:
            record = self._record(fs, root, n)
            if isinstance(record, dict) and record.get("shards"):
                named.add(record["shards"]["dir"])
        return named

    def _let_go(self, fs: Any, root: str, seq: int) -> None:
        kept = set(self.sequence_numbers()[-self.keep:])
        kept_shards = self._shard_dirs(fs, root, kept)
        # Older than every kept checkpoint: pruned, committed or not (a torn one newer than that
        # is skipped by restores until it falls behind too).
        oldest = min(kept, default=seq)
        for name, info in self._entries().items():
            done, shard, tmp = _NAME.match(name), _SHARDS.match(name), _TMP.match(name)
            if done and int(done.group(1)) < oldest:
                fs.delete_file(info.path)
            elif shard and name not in kept_shards and (int(shard.group(1)) < oldest or self._made(shard.group(2))):
                fs.delete_dir(info.path)
            elif tmp and self._made(tmp.group(1)):
                # What this run's earlier attempts (or this one) left half-written is garbage now.
                fs.delete_file(info.path)

    def remove_leftovers_of(self, run: str) -> list[str]:
        """Removes what run ``run`` left half-written here (temporary files, shard directories no
        commit record names): the run whose lease this one took over, whose driver died. Returns
        the names removed."""
        fs, root = self._fs()
        named = self._shard_dirs(fs, root, self.sequence_numbers())
        removed = []
        for name, info in self._entries().items():
            shard, tmp = _SHARDS.match(name), _TMP.match(name)
            tag = shard.group(2) if shard else tmp.group(1) if tmp else None
            if fence.run_of(tag) != run or name in named:
                continue
            (fs.delete_dir if shard else fs.delete_file)(info.path)
            removed.append(name)
        return sorted(removed)

    def _made(self, tag: str | None) -> bool:
        return self.writer is not None and self.writer.made(tag)

    def load(self, seq: int | None = None, *, weights_only: bool = True, sharded_ok: bool = False) -> Any:
        """The checkpoint ``seq`` (default: the newest that verifies), or None when there is none.

        Args:
            seq: the sequence number of the checkpoint to read; None: the newest one whose data
                matches its commit record (newer, torn ones are skipped, and said on stderr).
            weights_only: True (the default) loads tensors, numbers, strings and containers of
                them only, and never runs code from the file: a checkpoint that holds anything
                else raises :class:`SparkDLError` naming the file and what was refused. False
                unpickles anything, which runs whatever code the file holds: pass it only for
                checkpoints you wrote yourself, on storage nobody else writes to.
            sharded_ok: return a sharded checkpoint's commit record (for
                :mod:`sparkdl._internal.ckpt.sharded`); by default a sharded checkpoint raises
                :class:`SparkDLError`, since its shards load only inside the run.
        """
        import torch

        if seq is None:
            seq = self.newest_good()[0]
            if seq is None:
                return None
        fs, root = self._fs()
        name = records.data_name(seq)
        verified, self._verified = self._verified, None
        if verified is not None and verified[0] == seq:
            data, problem = verified[1], None
        else:
            with fs.open_input_file(posixpath.join(root, name)) as f:
                data = f.read()
            record = self._record(fs, root, seq)
            # A checkpoint named by its number loads without a record (one an earlier sparkdl
            # wrote), never with a record it does not match.
            problem = record if isinstance(record, str) and record != records.NO_RECORD else (
                records.data_problem(record, data) if isinstance(record, dict) else None)
        if problem:
            raise SparkDLError(f"checkpoint {redact(self.url)}/{name} cannot be trusted: {problem}. "
                               "Load an older one (CheckpointStore.newest_good() finds the newest good one)")
        try:
            obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
        except pickle.UnpicklingError as exc:
            if not weights_only:
                raise
            raise _refused(f"{redact(self.url)}/{name}", data, exc) from None
        if not sharded_ok and isinstance(obj, dict) and obj.get(SHARDED):
            raise SparkDLError(
                f"checkpoint {redact(self.url)}/{name} is sharded: every rank wrote its part of the model with "
                "torch.distributed.checkpoint. Load it inside the run, on every rank, into the sharded "
                "model: with sparkdl.TrainState, or sparkdl.context().load_checkpoint(into=...)"
            )
        return obj


def _fsync(fs: Any, path: str) -> None:
    """fsync of a local file or directory; other stores make a closed file durable themselves."""
    import pyarrow.fs as pafs

    if not isinstance(fs, pafs.LocalFileSystem):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
