"""Datasets Petastorm's ``materialize_dataset`` wrote, read without Petastorm (issue 55).

The dataset under tests/resources/petastorm_dataset/ was written by real Petastorm (0.12.1, on the
classic stack) with every codec sparkdl reads; tests/resources/petastorm_dataset_expected.npz
holds what Petastorm's own ``make_reader`` decoded from it. Both were written by
tests/resources/write_petastorm_fixture.py. Here ``sparkdl.Dataset`` reads the same files,
without Petastorm (absent on the modern stack) and without a JVM, and must give the same values,
dtypes and shapes; a planted ``_common_metadata`` must be refused by name and run nothing.
"""

from __future__ import annotations

import os
import pickle
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import sparkdl
from sparkdl._internal.common.errors import DatasetError
from sparkdl._internal.data.decoding.petastorm_codecs import PetastormDecoder
from sparkdl._internal.data.decoding.samples import ROW
from sparkdl._internal.data.format.petastorm_schema import METADATA_FILE, UNISCHEMA_KEY

RESOURCES = Path(__file__).resolve().parents[2] / "resources"
FIXTURE = RESOURCES / "petastorm_dataset"
EXPECTED = RESOURCES / "petastorm_dataset_expected.npz"
ENCODED = ("matrix", "counts", "image_png", "mask_png", "image_jpeg")


def _all_rows(ds: sparkdl.Dataset, **kwargs: Any) -> dict[str, list[Any]]:
    """Every row of a one-rank, unshuffled epoch, as lists per column (tensors split into rows)."""
    out: dict[str, list[Any]] = {}
    for batch in ds.loader(4, rank=0, world_size=1, shuffle=False, **kwargs):
        for k, v in batch.items():
            out.setdefault(k, []).extend(list(v))
    return out


def _copy(tmp_path: Path) -> Path:
    target = tmp_path / "ds"
    shutil.copytree(FIXTURE, target)
    return target


def _set_unischema(root: Path, raw: bytes | None) -> None:
    """Rewrites ``root``'s _common_metadata with ``raw`` as the pickled Unischema (None: no such key)."""
    path = root / METADATA_FILE
    schema = pq.read_schema(path)
    meta = {k: v for k, v in (schema.metadata or {}).items() if k != UNISCHEMA_KEY}
    if raw is not None:
        meta[UNISCHEMA_KEY] = raw
    pq.write_metadata(schema.with_metadata(meta), path)


def _fixture_unischema() -> bytes:
    return pq.read_schema(FIXTURE / METADATA_FILE).metadata[UNISCHEMA_KEY]


def test_every_field_comes_out_as_petastorms_reader_gave_it() -> None:
    expected = np.load(EXPECTED, allow_pickle=False)
    rows = _all_rows(sparkdl.Dataset(FIXTURE))
    ids = [int(i) for i in rows["id"]]
    assert sorted(ids) == list(range(6))
    order = np.argsort(ids)
    for name in ("id", "label", "matrix", "image_png", "mask_png", "image_jpeg"):
        got = np.stack([rows[name][i].numpy() for i in order])
        want = expected[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        # JPEG too: simplejpeg (or Pillow) and OpenCV run libjpeg-turbo with the same settings.
        assert np.array_equal(got, want), name
    assert [rows["name"][i] for i in order] == list(expected["name"])
    for i in order:  # a None dimension: each row as stored, a list of arrays
        got, want = rows["counts"][i], expected[f"counts/{ids[i]}"]
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and np.array_equal(got, want)


def test_the_schema_describes_the_unischema_fields() -> None:
    ds = sparkdl.Dataset(str(FIXTURE))
    assert ds.columns == ("id", "label", "name", "matrix", "counts", "image_png", "mask_png", "image_jpeg")
    assert ds.schema == {
        "id": "int64", "label": "int32", "name": "str", "matrix": "ndarray<float32>[3, 4]",
        "counts": "ndarray<int16>[?, 2] (compressed)", "image_png": "image<uint8>[8, 8, 3] (png)",
        "mask_png": "image<uint8>[8, 8] (png)", "image_jpeg": "image<uint8>[16, 16, 3] (jpeg)",
    }
    field = ds.manifest.field("counts")
    assert field is not None and field.shape == (None, 2) and field.codec == "compressed_ndarray"
    assert pickle.loads(pickle.dumps(ds)).manifest.fields == ds.manifest.fields  # the fields travel to the ranks


def test_decoding_runs_on_the_decode_workers_and_a_given_decoder_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: set[str] = set()
    real = PetastormDecoder.__call__

    def spy(self: PetastormDecoder, value: Any, rng: Any) -> Any:
        threads.add(threading.current_thread().name)
        return real(self, value, rng)

    monkeypatch.setattr(PetastormDecoder, "__call__", spy)
    main = threading.current_thread().name
    rows = _all_rows(sparkdl.Dataset(FIXTURE), decode={"image_jpeg": sparkdl.ImageDecoder(8, crop="full")},
                     decode_workers=2, columns=["id", "image_jpeg", "image_png"])
    assert threads and all(t.startswith("sparkdl-decode") for t in threads) and main not in threads
    assert set(rows) == {"id", "image_jpeg", "image_png"}
    assert tuple(rows["image_jpeg"][0].shape) == (3, 8, 8)  # the user's ImageDecoder: CHW, resized
    assert tuple(rows["image_png"][0].shape) == (8, 8, 3)  # the default: HWC as stored


def test_a_transform_of_whole_rows_sees_decoded_fields() -> None:
    seen: list[tuple[str, tuple[int, ...]]] = []

    def row_fn(row: dict[str, Any], rng: Any) -> dict[str, Any]:
        seen.append((type(row["matrix"]).__name__, row["matrix"].shape))
        return {"total": np.float32(row["matrix"].sum())}

    rows = _all_rows(sparkdl.Dataset(FIXTURE), decode={ROW: row_fn}, columns=["id", "matrix"])
    assert set(seen) == {("ndarray", (3, 4))} and len(rows["total"]) == 6


def test_a_transform_spec_over_a_petastorm_dataset_takes_its_rows_decoded_a_chunk_at_once() -> None:
    """The converter's TransformSpec path (a RowTransform) over the decoded fields: a func that
    draws nothing runs on many rows a call, and gives each row what it gives it alone."""
    from sparkdl._internal.data.decoding.row_transform import RowTransform, TransformSpec

    expected = np.load(EXPECTED, allow_pickle=False)
    calls: list[int] = []

    def total(pdf: Any) -> Any:
        calls.append(len(pdf))
        pdf["total"] = [np.float64(m.sum()) for m in pdf["matrix"]]
        return pdf[["id", "total"]]

    spec = TransformSpec(total, edit_fields=[("total", np.float64, (), False)], selected_fields=["id", "total"])
    # prefetch=0: the prefetch thread reads ahead into the next epoch, whose chunks would count too
    # (as many as it decoded before the loop closed it: a number that depends on timing).
    loader = sparkdl.Dataset(FIXTURE).loader(6, rank=0, world_size=1, shuffle=False, decode={ROW: RowTransform(spec)},
                                             columns=["id", "matrix"], decode_in="threads", decode_workers=1, prefetch=0)
    [batch] = list(loader)
    by_id = dict(zip((int(i) for i in batch["id"]), (float(t) for t in batch["total"]), strict=True))
    assert by_id == {int(i): float(m.sum()) for i, m in zip(expected["id"], expected["matrix"], strict=True)}
    assert calls == [2, 2, 2], calls  # a batch of 6 rows, in chunks of a quarter per worker


class _Payload:
    """Unpickled by a trusting reader, this runs ``fn(arg)``: what a planted file would carry."""

    def __init__(self, fn: Any, arg: str) -> None:
        self.fn, self.arg = fn, arg

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, (self.arg,))


@pytest.mark.parametrize(("fn", "named"), [(os.system, "system"), (eval, "builtins.eval")])
def test_a_planted_unischema_is_refused_by_name_and_runs_nothing(tmp_path: Path, fn: Any, named: str) -> None:
    root = _copy(tmp_path)
    marker = tmp_path / "ran"
    arg = f"touch {marker}" if fn is os.system else f"open({str(marker)!r}, 'w')"
    # The payload sits where a codec would, inside an otherwise ordinary structure.
    _set_unischema(root, pickle.dumps({"_name": "x", "_fields": {"matrix": _Payload(fn, arg)}}))
    with pytest.raises(DatasetError) as caught:
        sparkdl.Dataset(root)
    message = str(caught.value)
    assert named in message and METADATA_FILE in message and "ran nothing" in message
    assert not marker.exists()
    pickle.loads(pickle.dumps(_Payload(fn, arg)))  # the same bytes, trusted, would have run it
    assert marker.exists()


def test_a_damaged_unischema_is_an_error_that_says_what_to_do(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    _set_unischema(root, _fixture_unischema()[:100])
    with pytest.raises(DatasetError, match=r"cannot be read .*delete _common_metadata"):
        sparkdl.Dataset(root)
    _set_unischema(root, pickle.dumps({"a": 1}))
    with pytest.raises(DatasetError, match="holds a dict, not a Petastorm Unischema"):
        sparkdl.Dataset(root)


@pytest.mark.parametrize("how", ["no key", "no file"])
def test_without_a_unischema_the_files_are_plain_parquet(tmp_path: Path, how: str) -> None:
    root = _copy(tmp_path)
    if how == "no key":
        _set_unischema(root, None)
    else:
        (root / METADATA_FILE).unlink()
    ds = sparkdl.Dataset(root)
    assert ds.schema["matrix"] == "binary" and not ds.manifest.fields
    assert all(isinstance(v, bytes) for v in _all_rows(ds)["matrix"])


def _small(tmp_path: Path, matrices: list[Any]) -> Path:
    """A dataset of ``id`` and ``matrix`` (np.save bytes of ``matrices``) with the fixture's Unischema,
    whose other fields have no column here (as partition columns would not)."""
    import io

    def saved(a: Any) -> bytes:
        buf = io.BytesIO()
        np.save(buf, a)
        return buf.getvalue()

    root = tmp_path / "small"
    root.mkdir()
    table = pa.table({"id": pa.array(range(len(matrices)), pa.int64()),
                      "matrix": pa.array([saved(m) if isinstance(m, np.ndarray) else m for m in matrices], pa.binary())})
    pq.write_table(table, root / "part-0.parquet")
    pq.write_metadata(table.schema.with_metadata({UNISCHEMA_KEY: _fixture_unischema()}), root / METADATA_FILE)
    return root


def test_a_value_unlike_its_field_follows_on_bad_sample(tmp_path: Path) -> None:
    good = np.ones((3, 4), np.float32)
    root = _small(tmp_path, [good, np.ones((4, 3), np.float32), good, np.ones((3, 4), np.float64), b"junk"])
    ds = sparkdl.Dataset(root)
    assert ds.schema == {"id": "int64", "matrix": "ndarray<float32>[3, 4]"}
    with pytest.raises(DatasetError, match=r"column 'matrix', row 1 .*declares float32 \(3, 4\).*float32 \(4, 3\)"):
        _all_rows(ds)
    loader = ds.loader(5, rank=0, world_size=1, shuffle=False, on_bad_sample="skip")
    (batch,) = list(loader)
    assert batch["id"].tolist() == [0, 2] and tuple(batch["matrix"].shape) == (2, 3, 4)
    assert loader.skipped == 3


def test_a_codec_on_a_column_that_holds_no_bytes_is_refused_by_field(tmp_path: Path) -> None:
    root = tmp_path / "wrong"
    root.mkdir()
    table = pa.table({"id": pa.array([1, 2], pa.int64()), "matrix": pa.array([1.0, 2.0], pa.float32())})
    pq.write_table(table, root / "part-0.parquet")
    pq.write_metadata(table.schema.with_metadata({UNISCHEMA_KEY: _fixture_unischema()}), root / METADATA_FILE)
    with pytest.raises(DatasetError, match=r"field 'matrix' is encoded .*not bytes"):
        sparkdl.Dataset(root)
