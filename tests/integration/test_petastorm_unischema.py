"""The classic stack: a dataset real Petastorm writes with a Unischema, read back by Petastorm's
``make_reader`` and by ``sparkdl.Dataset``, field by field (issue 55).

Runs where Petastorm imports (.venv-classic). Petastorm's image codec needs OpenCV, which the
classic stack installs (the ``petastorm-images`` extra); elsewhere that test is skipped, and the
stored fixture of tests/unit/data/test_petastorm_format.py covers images on every stack.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sparkdl

petastorm = pytest.importorskip("petastorm", exc_type=ImportError)
pytestmark = pytest.mark.spark


def _write(spark: Any, url: str, fields: list[Any], rows: list[dict[str, Any]]) -> None:
    from petastorm.etl.dataset_metadata import materialize_dataset
    from petastorm.unischema import Unischema, dict_to_spark_row

    schema = Unischema("Test", fields)
    with materialize_dataset(spark, url, schema, row_group_size_mb=1):
        encoded = [dict_to_spark_row(schema, r) for r in rows]
        df = spark.createDataFrame(spark.sparkContext.parallelize(encoded, 2), schema.as_spark_schema())
        df.write.mode("overwrite").parquet(url)


def _by_id_petastorm(url: str) -> dict[int, dict[str, Any]]:
    from petastorm import make_reader

    with make_reader(url, reader_pool_type="dummy", shuffle_row_groups=False, num_epochs=1) as reader:
        return {int(r.id): r._asdict() for r in reader}


def _by_id_sparkdl(url: str) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for batch in sparkdl.Dataset(url).loader(3, rank=0, world_size=1, shuffle=False, decode_workers=2):
        for i, row_id in enumerate(batch["id"].tolist()):
            out[row_id] = {k: v[i] for k, v in batch.items()}
    return out


def _same(peta: dict[int, dict[str, Any]], ours: dict[int, dict[str, Any]]) -> None:
    assert sorted(peta) == sorted(ours)
    for row_id, want_row in peta.items():
        got_row = ours[row_id]
        assert set(got_row) == set(want_row)
        for name, want in want_row.items():
            got = got_row[name]
            got = got.numpy() if hasattr(got, "numpy") else np.asarray(got)
            want = np.asarray(want)
            assert got.dtype == want.dtype and got.shape == want.shape, (row_id, name, got.dtype, want.dtype)
            assert np.array_equal(got, want), (row_id, name)


def test_ndarrays_and_scalars_read_as_petastorm_reads_them(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from petastorm.codecs import CompressedNdarrayCodec, NdarrayCodec, ScalarCodec
    from petastorm.unischema import UnischemaField
    from pyspark.sql.types import DoubleType, LongType, ShortType

    fields = [
        UnischemaField("id", np.int64, (), ScalarCodec(LongType()), False),
        # Stored as a Spark short; Petastorm's reader gives the declared uint8.
        UnischemaField("small", np.uint8, (), ScalarCodec(ShortType()), False),
        UnischemaField("weight", np.float64, (), ScalarCodec(DoubleType()), False),
        # A dtype object rather than a scalar type: pickled as numpy.dtype('f8').
        UnischemaField("matrix", np.dtype("float64"), (2, 3), NdarrayCodec(), False),
        UnischemaField("ragged", np.int32, (2, None), CompressedNdarrayCodec(), False),
    ]
    rng = np.random.default_rng(7)
    rows = [{"id": np.int64(i), "small": np.uint8(200 + i), "weight": float(i) / 4,
             "matrix": rng.standard_normal((2, 3)), "ragged": rng.integers(-9, 9, (2, i % 3 + 1)).astype(np.int32)}
            for i in range(7)]
    url = (tmp_path / "ds").as_uri()
    _write(spark, url, fields, rows)
    ds = sparkdl.Dataset(url)
    assert ds.schema["matrix"] == "ndarray<float64>[2, 3]" and ds.schema["small"] == "uint8"
    assert ds.schema["ragged"] == "ndarray<int32>[2, ?] (compressed)"
    _same(_by_id_petastorm(url), _by_id_sparkdl(url))


def test_images_read_as_petastorm_reads_them(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("cv2", exc_type=ImportError)
    from petastorm.codecs import CompressedImageCodec, ScalarCodec
    from petastorm.unischema import UnischemaField
    from pyspark.sql.types import LongType

    fields = [
        UnischemaField("id", np.int64, (), ScalarCodec(LongType()), False),
        UnischemaField("rgb", np.uint8, (12, 10, 3), CompressedImageCodec("png"), False),
        UnischemaField("photo", np.uint8, (None, None, 3), CompressedImageCodec("jpeg", quality=85), False),
        UnischemaField("depth", np.uint16, (6, 6), CompressedImageCodec("png"), False),
    ]
    rng = np.random.default_rng(3)
    rows = [{"id": np.int64(i),
             "rgb": np.dstack([np.full((12, 10), 250), rng.integers(0, 256, (12, 10)), np.full((12, 10), 5 * i)]).astype(np.uint8),
             "photo": rng.integers(0, 256, (16 + 8 * (i % 2), 24, 3)).astype(np.uint8),
             "depth": rng.integers(0, 65536, (6, 6)).astype(np.uint16)}
            for i in range(5)]
    url = (tmp_path / "images").as_uri()
    _write(spark, url, fields, rows)
    peta = _by_id_petastorm(url)
    for r in rows:  # lossless: Petastorm gives back the RGB arrays that were written
        assert np.array_equal(peta[int(r["id"])]["rgb"], r["rgb"])
    _same(peta, _by_id_sparkdl(url))
