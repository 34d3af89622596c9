"""write_dataset from real Spark DataFrames, opening what Spark, pyarrow and sparkdl wrote, locally,
through file:// and over a real FTP server on loopback; then one end-to-end training run."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from resources.ftp import ftp_server as serve_ftp

import sparkdl
from sparkdl import ConfigError, Dataset, DatasetError
from sparkdl._internal.data.format.manifest import MANIFEST_NAME
from sparkdl._internal.data.writing.cache import CACHE_DIR_CONF

# The rank function below travels by value, as a notebook's functions do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.spark

FAST = sparkdl.RunConfig(start_timeout_s=60, slot_wait_s=2, connect_timeout_s=20, kill_grace_s=20, max_attempts=1)

ROWS = 240


def _all_types_df(spark: Any) -> Any:
    from pyspark.ml.linalg import Vectors, VectorUDT
    from pyspark.mllib.linalg import Vectors as OldVectors
    from pyspark.mllib.linalg import VectorUDT as OldVectorUDT
    from pyspark.sql import types as T

    schema = T.StructType(
        [
            T.StructField("id", T.LongType()),
            T.StructField("i32", T.IntegerType()),
            T.StructField("i16", T.ShortType()),
            T.StructField("i8", T.ByteType()),
            T.StructField("f32", T.FloatType()),
            T.StructField("f64", T.DoubleType()),
            T.StructField("flag", T.BooleanType()),
            T.StructField("fixed", T.ArrayType(T.FloatType())),
            T.StructField("var", T.ArrayType(T.IntegerType())),
            T.StructField("vec", VectorUDT()),
            T.StructField("old_vec", OldVectorUDT()),
            T.StructField("image", T.BinaryType()),
            T.StructField("name", T.StringType()),
        ]
    )

    def row(i: int) -> tuple[Any, ...]:
        # dense and sparse vectors mixed in one column
        vec = Vectors.dense([float(i), 1.0, 2.0]) if i % 2 else Vectors.sparse(3, {0: float(i)})
        return (
            i, i * 2, i % 100, i % 50, i / 2, i / 4, i % 3 == 0, [float(i)] * 3, list(range(i % 4)),
            vec, OldVectors.sparse(2, {1: float(i)}), bytes([i % 256]) * (1 + i % 3), f"name-{i}",
        )

    return spark.createDataFrame([row(i) for i in range(ROWS)], schema)


def _read_all(ds: Dataset, **kwargs: Any) -> dict[int, dict[str, Any]]:
    """Every row, by id, with one rank and no shuffle."""
    out: dict[int, dict[str, Any]] = {}
    for batch in ds.loader(64, shuffle=False, rank=0, world_size=1, **kwargs):
        for j, row_id in enumerate(batch["id"].tolist()):
            out[row_id] = {k: v[j] for k, v in batch.items()}
    return out


@pytest.fixture(scope="module")
def written(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    root = tmp_path_factory.mktemp("written") / "all_types"
    return sparkdl.write_dataset(_all_types_df(spark), root, num_files=3, row_group_bytes=2048)


def test_every_column_type_round_trips(written: Dataset) -> None:
    assert written.schema == {
        "id": "int64",
        "i32": "int32",
        "i16": "int16",
        "i8": "int8",
        "f32": "float32",
        "f64": "float64",
        "flag": "bool",
        "fixed": "array<float32>[3]",
        "var": "array<int32>[variable]",
        "vec": "array<float32>[3]",
        "old_vec": "array<float32>[2]",
        "image": "binary",
        "name": "string",
    }
    rows = _read_all(written)
    assert sorted(rows) == list(range(ROWS))
    for i, r in rows.items():
        assert (r["i32"].item(), r["i16"].item(), r["i8"].item()) == (i * 2, i % 100, i % 50)
        assert r["f32"].item() == pytest.approx(i / 2) and r["f64"].item() == i / 4
        assert r["flag"].item() == (i % 3 == 0)
        assert r["fixed"].tolist() == [float(i)] * 3
        n = i % 4
        assert r["var_lengths"].item() == n and r["var"][:n].tolist() == list(range(n))
        assert r["vec"].tolist() == ([float(i), 1.0, 2.0] if i % 2 else [float(i), 0.0, 0.0])
        assert r["old_vec"].tolist() == [0.0, float(i)]
        assert r["image"] == bytes([i % 256]) * (1 + i % 3)
        assert r["name"] == f"name-{i}"
    batch = next(iter(written.loader(8, rank=0, world_size=1)))
    assert batch["fixed"].shape == (8, 3) and str(batch["vec"].dtype) == "torch.float32"


def test_manifest_records_files_row_groups_and_counts(written: Dataset) -> None:
    root = Path(written.url.removeprefix("file://"))
    raw = json.loads((root / MANIFEST_NAME).read_text())
    assert raw["format"] == "sparkdl.dataset" and raw["written_by"] == "sparkdl"
    assert raw["num_rows"] == ROWS == written.num_rows
    assert [c["name"] for c in raw["columns"]][:3] == ["id", "i32", "i16"]
    assert {c["name"]: c["length"] for c in raw["columns"] if c["kind"] == "array"} == {
        "fixed": 3, "var": None, "vec": 3, "old_vec": 2,
    }
    assert len(raw["files"]) == 3
    for f in raw["files"]:
        meta = pq.ParquetFile(root / f["path"]).metadata
        assert f["row_groups"] == [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        assert f["num_rows"] == meta.num_rows == sum(f["row_groups"])
    # files balanced for readers: round-robin spreads rows evenly
    counts = [f["num_rows"] for f in raw["files"]]
    assert max(counts) - min(counts) <= 2
    # small row_group_bytes gave several row groups per file
    assert all(len(f["row_groups"]) > 1 for f in raw["files"])
    # data files on disk are exactly the manifest's
    on_disk = sorted(p.name for p in root.iterdir() if not p.name.startswith(("_", ".")))
    assert on_disk == sorted(f["path"] for f in raw["files"])


def test_row_group_rows_caps_row_groups(spark: Any, tmp_path: Path) -> None:
    import pyspark

    if int(pyspark.__version__.split(".")[0]) < 4:
        with pytest.raises(ConfigError, match="row_group_rows=30 needs Spark 4"):
            sparkdl.write_dataset(spark.range(100), tmp_path / "rg", num_files=1, row_group_rows=30)
        return
    ds = sparkdl.write_dataset(spark.range(100), tmp_path / "rg", num_files=1, row_group_rows=30)
    assert [f.row_groups for f in ds.manifest.files] == [(30, 30, 30, 10)]
    with pytest.raises(ConfigError, match=r"row_group_rows must be an integer >= 1 or None.*; got 0"):
        sparkdl.write_dataset(spark.range(100), tmp_path / "bad", row_group_rows=0)


def test_written_dataset_feeds_equal_steps(written: Dataset) -> None:
    seen: list[int] = []
    lens = set()
    for rank in range(3):
        loader = written.loader(16, rank=rank, world_size=3, seed=2, columns=["id"], drop_last=True)
        batches = [b["id"].tolist() for b in loader]
        lens.add((len(loader), len(batches)))
        seen += [i for b in batches for i in b]
    assert lens == {(5, 5)}  # 240 // (3 * 16)
    assert len(seen) == len(set(seen)) == 240


def test_cache_reuses_the_same_plan(spark: Any, tmp_path: Path) -> None:
    src = tmp_path / "src"
    spark.range(0, 500, numPartitions=2).selectExpr("id", "cast(id * 2 as double) as x").write.parquet(str(src))
    spark.conf.set(CACHE_DIR_CONF, str(tmp_path / "cache"))
    try:

        def make() -> Any:  # built anew each time: same plan, other DataFrame objects
            return spark.read.parquet(str(src)).where("id % 2 = 0")

        first = sparkdl.write_dataset(make(), num_files=2)
        assert first.url.startswith((tmp_path / "cache").as_uri()) and first.num_rows == 250
        stamps = _mtimes(first)
        time.sleep(0.05)
        again = sparkdl.write_dataset(make(), num_files=2)
        assert again.url == first.url
        assert _mtimes(again) == stamps  # nothing rewritten
        assert sorted(_read_all(again)) == list(range(0, 500, 2))
        # another plan, or other write options, is another entry
        other = sparkdl.write_dataset(make().where("id > 100"), num_files=2)
        assert other.url != first.url and other.num_rows == 199
        assert sparkdl.write_dataset(make(), num_files=1).url != first.url
        # changed inputs are another entry too
        time.sleep(0.05)
        spark.range(0, 10).selectExpr("id", "cast(id as double) as x").write.mode("overwrite").parquet(str(src))
        changed = sparkdl.write_dataset(make(), num_files=2)
        assert changed.url != first.url and changed.num_rows == 5
        leftovers = [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tmp")]
        assert leftovers == []
    finally:
        spark.conf.unset(CACHE_DIR_CONF)


def _mtimes(ds: Dataset) -> dict[str, int]:
    root = Path(ds.url.removeprefix("file://"))
    return {p.name: p.stat().st_mtime_ns for p in root.iterdir()}


def test_unsupported_types_are_named_with_their_types(spark: Any, tmp_path: Path) -> None:
    df = spark.sql(
        "select 1L as ok, current_timestamp() as ts, map('a', 1) as m, cast(1.5 as decimal(10,2)) as dec, "
        "array('x') as words, current_date() as day, named_struct('a', 1) as st"
    )
    with pytest.raises(ConfigError) as info:
        sparkdl.write_dataset(df, tmp_path / "out")
    message = str(info.value)
    for part in ("'m' (map<string,int>)", "'dec' (decimal(10,2))", "'words' (array<string>)", "'day' (date)",
                 "'st' (struct<a:int>)"):
        assert part in message
    assert "'ok'" not in message and "'ts'" not in message and "cast" in message
    assert not (tmp_path / "out").exists()


def test_timestamps_are_written_as_microseconds(spark: Any, tmp_path: Path) -> None:
    df = spark.sql("select timestamp'2026-11-26 01:02:03.000004' as ts, 1L as id")
    ds = sparkdl.write_dataset(df, tmp_path / "ts")
    got = int(next(iter(ds.loader(1)))["ts"][0])
    from datetime import datetime, timezone

    want = spark.sql("select unix_micros(timestamp'2026-11-26 01:02:03.000004') as m").first()["m"]
    assert got == want and datetime.fromtimestamp(got / 1e6, timezone.utc).year == 2026


def test_empty_dataframe_is_refused(spark: Any, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no rows"):
        sparkdl.write_dataset(spark.range(0), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_path_needs_overwrite_and_nothing_is_deleted(spark: Any, tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.mkdir()
    (target / "precious.txt").write_text("keep me")
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(ConfigError, match=r"already holds data.*overwrite=True"):
        sparkdl.write_dataset(spark.range(10), target)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    ds = sparkdl.write_dataset(spark.range(10), target, overwrite=True)
    assert ds.num_rows == 10 and not (target / "precious.txt").exists()
    # an empty directory is not "data": it is used as it is
    (tmp_path / "empty").mkdir()
    assert sparkdl.write_dataset(spark.range(3), tmp_path / "empty").num_rows == 3


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port that is bound but never listens: connections to it are refused at once."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def test_unreachable_url_is_reported(spark: Any, closed_port: int) -> None:
    url = f"ftp://user:secret@127.0.0.1:{closed_port}/data"
    started = time.monotonic()
    with pytest.raises(DatasetError, match=rf"cannot reach ftp://user:\*\*\*@127.0.0.1:{closed_port}/data.*Refused"):
        Dataset(url)
    with pytest.raises(DatasetError, match="cannot reach"):
        sparkdl.write_dataset(spark.range(3), url)
    assert time.monotonic() - started < 30
    with pytest.raises(ConfigError, match="no filesystem for the scheme 'nosuchfs'"):
        Dataset("nosuchfs://somewhere/data")


def test_opens_plain_spark_parquet(spark: Any, tmp_path: Path) -> None:
    from pyspark.sql import functions as F

    path = tmp_path / "plain"
    df = spark.range(0, 100, numPartitions=3).select(
        "id", F.array(F.col("id").cast("float"), F.lit(1.0).cast("float")).alias("pair")
    )
    df.write.parquet(str(path))  # Spark's own layout: _SUCCESS, .crc files, no manifest
    ds = Dataset(path)
    assert not ds.manifest.written_by_sparkdl and ds.num_rows == 100
    rows = _read_all(ds)
    assert sorted(rows) == list(range(100))
    assert rows[7]["pair"].tolist() == [7.0, 1.0] and rows[7]["pair_lengths"].item() == 2
    fixed = Dataset(path, fixed_lengths={"pair": 2})
    assert next(iter(fixed.loader(10, rank=0, world_size=1)))["pair"].shape == (10, 2)


def test_opens_pyarrow_parquet_and_file_urls(spark: Any, tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": np.arange(50), "x": np.arange(50) * 0.5}), tmp_path / "a.parquet", row_group_size=7)
    ds = Dataset((tmp_path).as_uri())
    assert ds.url == "file://" + str(tmp_path) and ds.num_rows == 50
    assert {k: v["x"].item() for k, v in _read_all(ds).items()} == {i: i * 0.5 for i in range(50)}
    # and Spark reads what write_dataset wrote to a file:// URL
    out = sparkdl.write_dataset(spark.range(20), (tmp_path / "out").as_uri())
    assert out.url == (tmp_path / "out").as_uri()
    assert spark.read.parquet(out.url).count() == 20


@pytest.fixture
def ftp_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A real FTP server (pyftpdlib) on 127.0.0.1, serving a temp dir read-only; stopped at the end."""
    root = tmp_path / "ftp-root"
    root.mkdir()
    with serve_ftp(root, perm="elr") as base:
        yield base, root


def test_remote_dataset_over_ftp(written: Dataset, ftp_server: tuple[str, Path]) -> None:
    base, root = ftp_server
    shutil.copytree(written.url.removeprefix("file://"), root / "data")
    remote = Dataset(f"{base}/data")
    assert remote.manifest == written.manifest  # read from the manifest on the server
    assert "s3cret" not in repr(remote)
    local_rows = _read_all(written, columns=["id", "vec", "name"])
    remote_rows = _read_all(pickle.loads(pickle.dumps(remote)), columns=["id", "vec", "name"])
    assert sorted(remote_rows) == sorted(local_rows)
    for i in (0, 17, ROWS - 1):
        assert remote_rows[i]["vec"].tolist() == local_rows[i]["vec"].tolist()
        assert remote_rows[i]["name"] == local_rows[i]["name"]
    # plain Parquet without a manifest too (footers read over FTP)
    os.remove(root / "data" / MANIFEST_NAME)
    plain = Dataset(f"{base}/data")
    assert plain.num_rows == ROWS and not plain.manifest.written_by_sparkdl


def _train(ds: Dataset, epochs: int) -> list[tuple[int, int, int, list[float]]]:
    """Each rank fits y = w.x + b from its shard; returns (rank, steps, len, loss per epoch) of all ranks."""
    import torch
    import torch.distributed as dist

    ctx = sparkdl.context()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    loader = ds.loader(32, seed=1, columns=["x", "y"], drop_last=True)
    steps = 0
    losses = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        total = 0.0
        for batch in loader:
            loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(1), batch["y"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            steps += 1
        losses.append(total / len(loader))
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, (ctx.rank, steps, len(loader), losses))
    return gathered


def test_end_to_end_write_then_train_on_two_ranks(spark: Any, tmp_path: Path, no_leaks: None) -> None:
    from pyspark.sql import functions as F

    x = [((F.col("id") * (k + 3) % 11) / 10).cast("float") for k in range(4)]
    df = spark.range(0, 1000).select(F.array(*x).alias("x"))
    df = df.withColumn("y", (F.col("x")[0] * 2 - F.col("x")[1] + F.col("x")[3] * 0.5 + 1).cast("float"))
    ds = sparkdl.write_dataset(df, tmp_path / "train", num_files=3, row_group_bytes=2048)
    results = sparkdl.run(_train, ds, 3, num_workers=2, config=FAST)
    assert sorted(r[0] for r in results) == [0, 1]
    for _, steps, per_epoch, losses in results:
        assert per_epoch == 1000 // (2 * 32)
        assert steps == 3 * per_epoch  # the same on both ranks
        assert losses[-1] < losses[0] * 0.5
