"""Writes tests/resources/petastorm_dataset/ with real Petastorm, and what Petastorm's own reader
gives back for it (tests/resources/petastorm_dataset_expected.npz).

The modern stack has no Petastorm; its tests (tests/unit/data/test_petastorm_format.py) read
this stored dataset with ``sparkdl.Dataset`` and compare every field with the values Petastorm's
``make_reader`` decoded here. JPEG is lossy, so the JPEG column is compared with what Petastorm
decoded, not with the array that was encoded.

Run again on the classic stack (Petastorm, and OpenCV for its image codec)::

    .venv-classic/bin/python tests/resources/write_petastorm_fixture.py

The script starts a local Spark session of its own (loopback, no UI) and stops it.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DATASET = HERE / "petastorm_dataset"
EXPECTED = HERE / "petastorm_dataset_expected.npz"
ROWS = 6


def schema():  # type: ignore[no-untyped-def]
    """The Unischema: every codec sparkdl reads, with a variable dimension and a gray image."""
    from petastorm.codecs import (
        CompressedImageCodec,
        CompressedNdarrayCodec,
        NdarrayCodec,
        ScalarCodec,
    )
    from petastorm.unischema import Unischema, UnischemaField
    from pyspark.sql.types import IntegerType, LongType, StringType

    return Unischema("Fixture", [
        UnischemaField("id", np.int64, (), ScalarCodec(LongType()), False),
        UnischemaField("label", np.int32, (), ScalarCodec(IntegerType()), False),
        UnischemaField("name", np.str_, (), ScalarCodec(StringType()), False),
        UnischemaField("matrix", np.float32, (3, 4), NdarrayCodec(), False),
        UnischemaField("counts", np.int16, (None, 2), CompressedNdarrayCodec(), False),
        UnischemaField("image_png", np.uint8, (8, 8, 3), CompressedImageCodec("png"), False),
        UnischemaField("mask_png", np.uint8, (8, 8), CompressedImageCodec("png"), False),
        UnischemaField("image_jpeg", np.uint8, (16, 16, 3), CompressedImageCodec("jpeg", quality=90), False),
    ])


def source_rows() -> list[dict[str, object]]:
    """The rows as written: deterministic, and each row's arrays unlike the others'."""
    rng = np.random.default_rng(55)
    rows = []
    for i in range(ROWS):
        # A smooth gradient with a little noise: JPEG keeps it close, but not exactly.
        yy, xx = np.mgrid[0:16, 0:16]
        jpeg = np.stack([xx * 15, yy * 15, np.full((16, 16), 40 * i)], axis=-1) + rng.integers(0, 8, (16, 16, 3))
        rows.append({
            "id": np.int64(i),
            "label": np.int32(i % 3),
            "name": f"row-{i}",
            "matrix": (rng.standard_normal((3, 4)) + i).astype(np.float32),
            "counts": rng.integers(-300, 300, (i % 3 + 1, 2)).astype(np.int16),
            # Channels unlike each other, so that an RGB/BGR swap would show.
            "image_png": np.stack([np.full((8, 8), 200), rng.integers(0, 256, (8, 8)), np.full((8, 8), 10 * i)],
                                  axis=-1).astype(np.uint8),
            "mask_png": rng.integers(0, 256, (8, 8)).astype(np.uint8),
            "image_jpeg": np.clip(jpeg, 0, 255).astype(np.uint8),
        })
    return rows


def write(spark, url: str, rows: list[dict[str, object]], files: int = 2) -> None:  # type: ignore[no-untyped-def]
    """``rows`` written as a Petastorm dataset at ``url`` (``files`` Parquet files), with its metadata."""
    from petastorm.etl.dataset_metadata import materialize_dataset
    from petastorm.unischema import dict_to_spark_row

    unischema = schema()
    with materialize_dataset(spark, url, unischema, row_group_size_mb=1):
        encoded = [dict_to_spark_row(unischema, r) for r in rows]
        rdd = spark.sparkContext.parallelize(encoded, files)
        spark.createDataFrame(rdd, unischema.as_spark_schema()).write.mode("overwrite").parquet(url)


def read_back(url: str) -> dict[int, dict[str, object]]:
    """Every row as Petastorm's own ``make_reader`` decodes it, by id."""
    from petastorm import make_reader

    with make_reader(url, reader_pool_type="dummy", shuffle_row_groups=False, num_epochs=1) as reader:
        return {int(row.id): row._asdict() for row in reader}


def expected_arrays(decoded: dict[int, dict[str, object]]) -> dict[str, np.ndarray]:
    """What the npz holds: a column per field, stacked by id; the variable-shaped field row by row."""
    ids = sorted(decoded)
    out: dict[str, np.ndarray] = {}
    for name in decoded[ids[0]]:
        if name == "counts":
            for i in ids:
                out[f"counts/{i}"] = np.asarray(decoded[i][name])
        else:
            out[name] = np.stack([np.asarray(decoded[i][name]) for i in ids])
    return out


def main() -> None:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[1]").appName("petastorm-fixture")
             .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1").getOrCreate())
    try:
        shutil.rmtree(DATASET, ignore_errors=True)
        rows = source_rows()
        write(spark, DATASET.as_uri(), rows)
    finally:
        spark.stop()
    for path in list(DATASET.rglob("*")):
        if path.name.endswith(".crc") or path.name == "_SUCCESS":
            path.unlink()
    decoded = read_back(DATASET.as_uri())
    for r in rows:  # the lossless columns come back as written
        got = decoded[int(r["id"])]  # type: ignore[call-overload]
        for name in ("matrix", "counts", "image_png", "mask_png"):
            assert np.array_equal(got[name], r[name]), name
    arrays = expected_arrays(decoded)
    np.savez(EXPECTED, **arrays)
    import petastorm

    print(f"wrote {DATASET} ({sum(p.stat().st_size for p in DATASET.rglob('*'))} bytes) and {EXPECTED.name} "
          f"with petastorm {petastorm.__version__}: {sorted(arrays)}")


if __name__ == "__main__":
    main()
