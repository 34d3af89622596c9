"""The barrier stage's result rows (sparkdl._internal.wire.result_chunks): what task 0 cuts, the
driver joins back, in whatever order Spark returns the rows."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pytest

from sparkdl._internal.wire import result_chunks


def _pairs(batches: list[pa.RecordBatch]) -> list[tuple[int, bytes]]:
    assert all(b.schema.names == ["chunk", "data"] for b in batches)
    return [(b.column(0)[0].as_py(), b.column(1)[0].as_py()) for b in batches]


def test_a_value_and_a_record_cut_in_chunks_come_back_whole_in_any_order(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(result_chunks, "CHUNK_BYTES", 10)
    value, record = bytes(range(25)), b"record-of-the-attempt" * 2
    (tmp_path / "value").write_bytes(value)
    rows = _pairs([*result_chunks.result_rows(pa, tmp_path / "value"), *result_chunks.record_rows(pa, record)])
    assert sorted(i for i, _ in rows) == [-5, -4, -3, -2, -1, 0, 1, 2]
    random.Random(3).shuffle(rows)
    assert result_chunks.join(rows) == (value, record)


def test_an_empty_value_is_one_empty_row_and_no_row_is_no_value(tmp_path: Path) -> None:
    (tmp_path / "value").write_bytes(b"")
    rows = _pairs(list(result_chunks.result_rows(pa, tmp_path / "value")))
    assert rows == [(0, b"")] and result_chunks.join(rows) == (b"", b"")
    assert result_chunks.join(_pairs(list(result_chunks.record_rows(pa, b"r")))) == (None, b"r")
