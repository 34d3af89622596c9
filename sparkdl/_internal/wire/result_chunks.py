"""What a run's barrier stage returns to the driver: rows of ``chunk long, data binary``
(:data:`SCHEMA`). Task 0 writes them (:func:`result_rows`, :func:`record_rows`); the driver reads
them (:func:`join`).

Chunks 0, 1, ... are rank 0's pickled return value, cut in pieces of :data:`CHUNK_BYTES`; chunks
-1, -2, ... are the relay hub's record of the attempt (:mod:`sparkdl._internal.wire.relay_record`), when the
ranks reported through it. Rows arrive in any order; their numbers put them back.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

SCHEMA = "chunk long, data binary"
CHUNK_BYTES = 16 * 1024 * 1024


def _row(pa: Any, index: int, data: bytes) -> Any:
    return pa.RecordBatch.from_arrays([pa.array([index], pa.int64()), pa.array([data], pa.binary())],
                                      names=["chunk", "data"])


def result_rows(pa: Any, path: Path) -> Iterator[Any]:
    """Rank 0's return value, read from ``path``, as rows 0, 1, ... (an empty file: one empty row)."""
    with open(path, "rb") as f:
        index = 0
        while True:
            data = f.read(CHUNK_BYTES)
            if not data and index > 0:
                return
            yield _row(pa, index, data)
            index += 1


def record_rows(pa: Any, blob: bytes) -> Iterator[Any]:
    """The hub's record of the attempt as rows -1, -2, ..."""
    for i in range(0, max(len(blob), 1), CHUNK_BYTES):
        yield _row(pa, -1 - i // CHUNK_BYTES, blob[i : i + CHUNK_BYTES])


def join(rows: Iterable[tuple[int, bytes]]) -> tuple[bytes | None, bytes]:
    """Rank 0's value (None when no row holds it) and the hub's record (empty when none), from the
    stage's ``(chunk, data)`` rows in any order."""
    ordered = sorted(rows)
    result = [data for index, data in ordered if index >= 0]
    record = b"".join(data for index, data in sorted(ordered, reverse=True) if index < 0)
    return (b"".join(result) if result else None), record
