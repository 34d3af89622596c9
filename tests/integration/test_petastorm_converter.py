"""``sparkdl.compat.petastorm``: Petastorm's ``make_spark_converter`` as its documentation and the
Databricks notebooks use it, only the import changed; side by side with real Petastorm on the
classic stack (same rows, same tensor types); its shards take equal steps. Over Spark Connect:
tests/e2e/test_connect.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from sparkdl import ConfigError
from sparkdl.compat.petastorm import SparkDatasetConverter, make_spark_converter

pytestmark = pytest.mark.spark

ROWS = 230


@pytest.fixture
def frame(spark, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A DataFrame of the types Petastorm's torch loader takes, and the cache conf set."""
    from pyspark.ml.linalg import Vectors, VectorUDT
    from pyspark.sql import types as T

    fields = [("id", T.LongType()), ("i", T.IntegerType()), ("s", T.ShortType()), ("b", T.ByteType()),
              ("f", T.FloatType()), ("d", T.DoubleType()), ("flag", T.BooleanType()),
              ("arr", T.ArrayType(T.DoubleType())), ("vec", VectorUDT())]
    schema = T.StructType([T.StructField(name, kind) for name, kind in fields])
    rows = [(i, i, i, i % 100, i / 4, i / 3, i % 3 == 0, [float(i), -1.0], Vectors.dense([i, 2.0])) for i in range(ROWS)]
    spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, f"file://{tmp_path}/cache")
    try:
        yield spark.createDataFrame(rows, schema).repartition(3)
    finally:
        spark.conf.unset(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF)


def read_all(converter: Any, **kwargs: Any) -> list[dict[str, Any]]:
    with converter.make_torch_dataloader(num_epochs=1, **kwargs) as loader:
        return list(loader)


def test_code_written_for_petastorms_converter_runs(spark, frame, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import torch

    converter = make_spark_converter(frame, parquet_row_group_size_bytes=2048)
    assert len(converter) == ROWS and converter.cache_dir_url.startswith(f"file://{tmp_path}/cache/")
    assert make_spark_converter(frame, parquet_row_group_size_bytes=2048).cache_dir_url == converter.cache_dir_url
    # One epoch, no shuffle: every row once, in Petastorm's types (dtype='float32' made the
    # doubles float; booleans come as uint8; vectors and arrays as 2-D tensors).
    batches = read_all(converter, batch_size=32, shuffle_row_groups=False)
    ids = torch.cat([b["id"] for b in batches]).tolist()
    assert sorted(ids) == list(range(ROWS))
    first = batches[0]
    assert {k: str(v.dtype) for k, v in first.items()} == {
        "id": "torch.int64", "i": "torch.int32", "s": "torch.int16", "b": "torch.int8", "f": "torch.float32",
        "d": "torch.float32", "flag": "torch.uint8", "arr": "torch.float32", "vec": "torch.float32"}
    assert first["vec"].shape[1] == 2 and first["arr"].shape[1] == 2
    row = {int(i): k for k, i in enumerate(first["id"])}
    n = next(iter(row))
    assert first["flag"][row[n]].item() == (n % 3 == 0) and first["d"][row[n]].item() == pytest.approx(n / 3)
    # As the Databricks notebook does: steps from len(converter), next() on a loader without end.
    with converter.make_torch_dataloader(batch_size=32, workers_count=2) as loader:
        steps = len(converter) // 32
        it = iter(loader)
        seen = Counter(int(i) for _ in range(3 * steps) for i in next(it)["id"])
    assert set(seen) <= set(range(ROWS)) and len(seen) > ROWS * 0.9
    # What has no equivalent is refused by name, with what to do instead.
    with pytest.raises(ConfigError, match=r"predicate=\.\.\.\) has no equivalent.*df\.filter"):
        converter.make_torch_dataloader(predicate=object())
    with pytest.raises(ConfigError, match=r"cur_shard, shard_count must be both.*; got \(3, 2\)"):
        converter.make_torch_dataloader(cur_shard=3, shard_count=2)
    converter.delete()
    assert not Path(converter.cache_dir_url[len("file://"):]).exists()
    spark.conf.unset(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF)
    with pytest.raises(ValueError, match=r"petastorm\.spark\.converter\.parentCacheDirUrl, which is unset"):
        make_spark_converter(frame)


def test_every_shard_takes_the_same_steps(spark, frame) -> None:  # type: ignore[no-untyped-def]
    converter = make_spark_converter(frame, parquet_row_group_size_bytes=2048)
    shards = [read_all(converter, batch_size=16, cur_shard=r, shard_count=3, seed=5) for r in range(3)]
    # ceil(230 / 3) = 77 rows a shard, in 5 batches each; 231 - 230 = 1 row is seen twice.
    assert [len(s) for s in shards] == [5, 5, 5]
    ids = Counter(int(i) for shard in shards for b in shard for i in b["id"])
    assert set(ids) == set(range(ROWS)) and sum(ids.values()) == 231
    converter.delete()


def test_the_same_rows_and_types_as_petastorms_own(spark, frame) -> None:  # type: ignore[no-untyped-def]
    petastorm_spark = pytest.importorskip("petastorm.spark", reason="Petastorm is on the classic stack only")
    ours = make_spark_converter(frame)
    theirs = petastorm_spark.make_spark_converter(frame)
    try:
        got = [read_all(c, batch_size=50, shuffle_row_groups=False) for c in (ours, theirs)]
    finally:
        ours.delete()
        theirs.delete()
    import torch

    def table(batches: list[dict[str, Any]]) -> dict[str, Any]:
        return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}

    mine, real = (table(b) for b in got)
    assert {k: (v.dtype, v.shape) for k, v in mine.items()} == {k: (v.dtype, v.shape) for k, v in real.items()}
    order_mine, order_real = mine["id"].argsort(), real["id"].argsort()
    for name in mine:
        assert torch.equal(mine[name][order_mine], real[name][order_real]), name


def _tutorial_spec(transform_spec: Any) -> Any:
    """The image tutorial's TransformSpec: PIL decodes each photo of the pandas batch to CHW float32."""
    import numpy as np

    def preprocess(pdf: Any) -> Any:
        import io

        from PIL import Image

        def one(data: bytes) -> Any:
            im = Image.open(io.BytesIO(data)).convert("RGB").resize((24, 24))
            return np.ascontiguousarray((np.asarray(im, np.float32) / 255.0).transpose(2, 0, 1))  # Petastorm: row major

        pdf["features"] = pdf["content"].map(one)
        return pdf[["features", "label", "id"]]  # as the tutorials do: Petastorm wants exactly the fields selected

    return transform_spec(preprocess, edit_fields=[("features", np.float32, (3, 24, 24), False)],
                          selected_fields=["features", "label", "id"])


def test_the_image_tutorials_transform_spec_gives_petastorms_rows(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import torch
    from resources.photos import photos

    from sparkdl.compat.petastorm import TransformSpec

    rows = [(i, i % 3, bytearray(p)) for i, p in enumerate(photos(18, seed=5))]
    df = spark.createDataFrame(rows, "id long, label int, content binary").repartition(2)
    spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, f"file://{tmp_path}/cache")
    converters = [("sparkdl", make_spark_converter(df), TransformSpec)]
    try:
        petastorm_spark = pytest.importorskip("petastorm.spark") if _classic() else None
        if petastorm_spark is not None:
            from petastorm import TransformSpec as TheirSpec

            converters.append(("petastorm", petastorm_spark.make_spark_converter(df), TheirSpec))
        got = {}
        for name, converter, spec in converters:
            shards = [read_all(converter, batch_size=4, transform_spec=_tutorial_spec(spec), cur_shard=r,
                               shard_count=2, shuffle_row_groups=False) for r in (0, 1)]
            assert all(sorted(b) == ["features", "id", "label"] for s in shards for b in s)
            ids = torch.cat([b["id"] for s in shards for b in s])
            feats = torch.cat([b["features"] for s in shards for b in s])
            assert feats.dtype == torch.float32 and feats.shape[1:] == (3, 24, 24)
            got[name] = {int(i): f for i, f in zip(ids, feats, strict=True)}
    finally:
        for _, converter, _ in converters:
            converter.delete()
        spark.conf.unset(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF)
    assert set(got["sparkdl"]) == set(range(18))  # every photo, once (the shards here are even)
    if "petastorm" in got:  # the baseline: Petastorm's own converter, the same function
        assert set(got["petastorm"]) == set(range(18))
        for i in range(18):
            assert torch.equal(got["sparkdl"][i], got["petastorm"][i]), i


def _classic() -> bool:
    import importlib.util

    return importlib.util.find_spec("petastorm") is not None
