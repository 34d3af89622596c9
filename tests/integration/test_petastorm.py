"""The classic stack: Petastorm's reader and sparkdl's Arrow reader feed the same data alike.

Runs where Petastorm imports (the classic stack, .venv-classic: pyspark 3.5, pyarrow 14).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import sparkdl

petastorm = pytest.importorskip("petastorm", exc_type=ImportError)
pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def written(spark, tmp_path_factory):  # type: ignore[no-untyped-def]
    rows = [(i, [float(i), float(-i), 0.5], i % 3) for i in range(403)]  # 403: uneven on purpose
    df = spark.createDataFrame(rows, "id long, x array<float>, label int")
    return sparkdl.write_dataset(df, str(tmp_path_factory.mktemp("peta") / "ds"), num_files=3, row_group_bytes=1024)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [True, False])
def test_both_readers_give_the_same_steps_and_format(written, world_size: int, drop_last: bool) -> None:  # type: ignore[no-untyped-def]
    for rank in range(world_size):
        kwargs = {"rank": rank, "world_size": world_size, "drop_last": drop_last, "seed": 1}
        arrow = written.loader(32, reader="arrow", **kwargs)
        peta = written.loader(32, reader="petastorm", **kwargs)
        assert len(arrow) == len(peta)
        a_batches, p_batches = list(arrow), list(peta)
        assert len(a_batches) == len(p_batches) == len(arrow)
        for a, p in zip(a_batches, p_batches, strict=True):
            assert a.keys() == p.keys()
            for key in a:
                assert a[key].dtype == p[key].dtype and a[key].shape == p[key].shape, key


def test_a_dataset_written_by_petastorm_with_a_unischema_is_opened_and_fed(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from petastorm.codecs import ScalarCodec
    from petastorm.etl.dataset_metadata import materialize_dataset
    from petastorm.unischema import Unischema, UnischemaField, dict_to_spark_row
    from pyspark.sql.types import FloatType, IntegerType, LongType

    schema = Unischema("Points", [
        UnischemaField("id", np.int64, (), ScalarCodec(LongType()), False),
        UnischemaField("value", np.float32, (), ScalarCodec(FloatType()), False),
        UnischemaField("label", np.int32, (), ScalarCodec(IntegerType()), False),
    ])
    url = f"file://{tmp_path / 'petastorm_ds'}"
    with materialize_dataset(spark, url, schema, row_group_size_mb=1):
        rows = spark.sparkContext.parallelize(range(250), 4).map(
            lambda i: dict_to_spark_row(schema, {"id": i, "value": np.float32(i) / 10, "label": np.int32(i % 2)})
        )
        spark.createDataFrame(rows, schema.as_spark_schema()).write.mode("overwrite").parquet(url)

    ds = sparkdl.Dataset(url)
    assert ds.num_rows == 250 and set(ds.columns) == {"id", "value", "label"}
    for reader in ("arrow", "petastorm"):
        seen = []
        for rank in range(2):
            for batch in ds.loader(25, rank=rank, world_size=2, shuffle=False, reader=reader):
                assert batch["value"].dtype.is_floating_point
                seen.extend(batch["id"].tolist())
        assert len(seen) == 250
        if reader == "arrow":
            assert sorted(seen) == list(range(250))  # every row exactly once


def _same_steps_and_format(ds: sparkdl.Dataset, batch_size: int, world_size: int, **kwargs: object) -> int:
    """Both readers over every rank: the same steps, keys, dtypes and shapes; the rows fed."""
    fed = 0
    for rank in range(world_size):
        common = {"rank": rank, "world_size": world_size, "seed": 1, **kwargs}
        arrow = list(ds.loader(batch_size, reader="arrow", **common))  # type: ignore[arg-type]
        peta = list(ds.loader(batch_size, reader="petastorm", **common))  # type: ignore[arg-type]
        assert len(arrow) == len(peta) == len(ds.loader(batch_size, **common))  # type: ignore[arg-type]
        for a, p in zip(arrow, peta, strict=True):
            assert a.keys() == p.keys()
            for key in a:
                assert a[key].dtype == p[key].dtype and a[key].shape == p[key].shape, key
        fed += sum(len(b["id"]) for b in peta)
    return fed


def test_a_table_written_by_spark_with_array_columns_feeds_through_petastorm(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # What Spark writes for array<float> and array<double>: Parquet LIST columns, no manifest, so
    # the lengths are not known up front.
    rows = [(i, [float(i), float(-i), 0.5], [float(i)] * 4, i % 3) for i in range(301)]
    df = spark.createDataFrame(rows, "id long, x array<float>, y array<double>, label int")
    df.repartition(3).write.option("parquet.block.size", 2048).parquet(str(tmp_path / "spark"))
    ds = sparkdl.Dataset(str(tmp_path / "spark"))
    assert ds.schema["x"] == "array<float32>[variable]"
    assert _same_steps_and_format(ds, 32, world_size=2, shuffle=False) >= 301
    batch = next(iter(ds.loader(16, reader="petastorm", rank=0, world_size=1, shuffle=False)))
    assert tuple(batch["x"].shape) == (16, 3) and batch["x_lengths"].tolist() == [3] * 16
    assert tuple(batch["y"].shape) == (16, 4) and str(batch["y"].dtype) == "torch.float64"
    ids = batch["id"].numpy()
    assert np.array_equal(batch["x"].numpy(), np.stack([ids, -ids, np.full(16, 0.5)], 1).astype(np.float32))


def test_a_petastorm_converter_cache_feeds_through_both_readers(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from petastorm.spark import SparkDatasetConverter, make_spark_converter

    rows = [(i, [float(i)] * 8, i % 2) for i in range(257)]
    df = spark.createDataFrame(rows, "id long, features array<double>, label int")
    spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, (tmp_path / "cache").as_uri())
    try:
        converter = make_spark_converter(df, parquet_row_group_size_bytes=4096)
        ds = sparkdl.Dataset(converter.cache_dir_url)
        assert ds.num_rows == 257
        assert _same_steps_and_format(ds, 20, world_size=2, drop_last=True) == 2 * (257 // 40) * 20
        for batch in ds.loader(20, reader="petastorm", rank=0, world_size=1, shuffle=False):
            # the converter turns array<double> into float32 (its dtype='float32' default)
            assert batch["features"].shape[1] == 8 and str(batch["features"].dtype) == "torch.float32"
            assert batch["features"].numpy().tolist() == [[float(i)] * 8 for i in batch["id"].tolist()]
        converter.delete()
    finally:
        spark.conf.unset(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF)


def test_rows_of_unequal_length_in_a_row_group_name_the_column_and_the_row_group(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = [[1.0, 2.0]] * 10
    table = pa.table({"id": list(range(30)), "v": good + good[:5] + [[1.0, 2.0, 3.0]] + good[:4] + good})
    pq.write_table(table, tmp_path / "part-0.parquet", row_group_size=10)
    ds = sparkdl.Dataset(str(tmp_path))
    with pytest.raises(sparkdl.DatasetError, match=r"column 'v' has rows of 2 to 3 elements in row group 1 of .*part-0\.parquet"):
        list(ds.loader(10, reader="petastorm", rank=0, world_size=1, shuffle=False, petastorm_workers=1))
    assert sum(len(b["id"]) for b in ds.loader(10, reader="arrow", rank=0, world_size=1)) == 30  # the Arrow reader pads


def test_an_arrow_fixed_size_list_column_is_refused_by_name(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    values = pa.array(np.arange(40, dtype=np.float32))
    table = pa.table({"id": list(range(10)), "v": pa.FixedSizeListArray.from_arrays(values, 4)})
    pq.write_table(table, tmp_path / "part-0.parquet")
    ds = sparkdl.Dataset(str(tmp_path))
    with pytest.raises(sparkdl.ConfigError, match=r"skips the column\(s\) \['v'\].*fixed-size lists"):
        list(ds.loader(5, reader="petastorm", rank=0, world_size=1))
    assert [len(b["id"]) for b in ds.loader(5, reader="petastorm", rank=0, world_size=1, columns=["id"])] == [5, 5]
