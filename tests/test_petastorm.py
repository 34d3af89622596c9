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
