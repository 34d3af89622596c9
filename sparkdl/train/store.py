"""Checkpoints on shared storage: one atomic file per checkpoint, the last ``keep`` kept.

A checkpoint is one file, ``ckpt-<seq>.pt`` (``torch.save`` format), in the run's checkpoint
directory, which may be a local or shared path or any URL pyarrow/fsspec reach. It is written to
a temporary name and moved into place, so a crash in the middle of a write leaves the previous
checkpoint the latest complete one. Only complete files count; the last ``keep`` are kept.
"""

from __future__ import annotations

import io
import os
import posixpath
import re
import uuid
from typing import TYPE_CHECKING, Any

from sparkdl._validate import int_at_least
from sparkdl.storage import filesystem, normalize_url

if TYPE_CHECKING:
    import pyarrow.fs as pafs

_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")


class CheckpointStore:
    """The checkpoints of one run. Plain and picklable: the URL and ``keep`` are all it holds."""

    def __init__(self, url: str | os.PathLike[str], keep: int = 3) -> None:
        int_at_least("keep_checkpoints", keep, 1)
        self.url = normalize_url(url)
        self.keep = keep

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r}, keep={self.keep})"

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

    def save(self, obj: Any) -> int:
        """Writes ``obj`` as the next checkpoint, atomically; returns its sequence number."""
        import torch

        fs, root = self._fs()
        fs.create_dir(root, recursive=True)
        seq = (self.latest() or 0) + 1
        final = posixpath.join(root, f"ckpt-{seq:08d}.pt")
        tmp = posixpath.join(root, f".tmp-ckpt-{seq:08d}-{uuid.uuid4().hex}")
        buf = io.BytesIO()
        torch.save(obj, buf)
        with fs.open_output_stream(tmp) as out:
            out.write(buf.getbuffer())
        fs.move(tmp, final)
        for old in self.sequence_numbers()[: -self.keep]:
            fs.delete_file(posixpath.join(root, f"ckpt-{old:08d}.pt"))
        # Temporary files of earlier writers that crashed mid-write are garbage now.
        import pyarrow.fs as pafs

        for info in fs.get_file_info(pafs.FileSelector(root)):
            name = posixpath.basename(info.path)
            if name.startswith(".tmp-ckpt-") and info.path != tmp:
                fs.delete_file(info.path)
        return seq

    def load(self, seq: int | None = None) -> Any:
        """The checkpoint ``seq`` (default: the latest complete one), or None when there is none."""
        import torch

        if seq is None:
            seq = self.latest()
            if seq is None:
                return None
        fs, root = self._fs()
        with fs.open_input_file(posixpath.join(root, f"ckpt-{seq:08d}.pt")) as f:
            data = f.read()
        # Checkpoints are this run's own files on the user's storage, so full unpickling is intended.
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
