"""The image tutorial that Databricks and Petastorm document, as users run it, with one import
changed: photos in class folders read with Spark's ``binaryFile`` source, ``make_spark_converter``,
a ``TransformSpec`` whose function decodes and resizes each pandas batch with PIL, then a
learning-rate search with Hyperopt's ``SparkTrials`` (each trial reads the converter's cache on an
executor) and distributed training under ``HorovodRunner(np=2)`` with ``cur_shard=hvd.rank()``
and the validation loss averaged by ``hvd.allreduce``.

Each test runs the tutorial's code with ``sparkdl.compat.petastorm``, and on the classic stack
also with real Petastorm (the baseline): both must pass; the TensorFlow batches hold the same
values, and each shard the same rows.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest

# The objective and the training function travel to executors and ranks by value, as a notebook's
# do: by sparkdl (cloudpickle) and by SparkTrials' Spark jobs (pyspark's own copy of cloudpickle).
cloudpickle.register_pickle_by_value(sys.modules[__name__])
importlib.import_module("pyspark.cloudpickle").register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.spark

CLASSES = ("daisy", "roses")
PHOTOS = 16
SIZE = 16

CONVERTERS = ["sparkdl.compat.petastorm"] + (["petastorm.spark"] if importlib.util.find_spec("petastorm") else [])


@pytest.fixture(scope="module")
def photo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from resources.photos import photos

    root = tmp_path_factory.mktemp("flowers")
    for i, data in enumerate(photos(PHOTOS, seed=11)):
        folder = root / CLASSES[i % 2]
        folder.mkdir(exist_ok=True)
        (folder / f"{i:03d}.jpg").write_bytes(data)
    return root


@pytest.fixture(scope="module")
def images(spark, photo_dir: Path):  # type: ignore[no-untyped-def]
    """The tutorial's DataFrame: the photos' bytes, the class index from the folder name, and an id."""
    from pyspark.sql import functions as F

    df = (spark.read.format("binaryFile").option("pathGlobFilter", "*.jpg").option("recursiveFileLookup", "true")
          .load(str(photo_dir)))
    label = F.regexp_extract("path", r"/(\w+)/\d+\.jpg$", 1)
    return (df.select("content",
                      F.when(label == CLASSES[0], 0).otherwise(1).alias("label_index"),
                      F.regexp_extract("path", r"(\d+)\.jpg$", 1).cast("long").alias("id"))
            .repartitionByRange(2, "id"))  # two files of 8 photos: even shards for Petastorm too


def _spec(module: str) -> Any:
    """The tutorial's TransformSpec, built with the TransformSpec of ``module``'s package."""
    spec_class = importlib.import_module("petastorm").TransformSpec if module == "petastorm.spark" else \
        importlib.import_module(module).TransformSpec

    def transform_row(pdf: Any) -> Any:
        import io

        from PIL import Image

        def preprocess(content: bytes) -> Any:
            image = Image.open(io.BytesIO(content)).convert("RGB").resize((SIZE, SIZE))
            return np.ascontiguousarray((np.asarray(image, np.float32) / 255.0).transpose(2, 0, 1))

        pdf["features"] = pdf["content"].map(preprocess)
        return pdf[["features", "label_index", "id"]]

    return spec_class(transform_row, edit_fields=[("features", np.float32, (3, SIZE, SIZE), False)],
                      selected_fields=["features", "label_index", "id"])


def _net() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(4, len(CLASSES)))


def _step(model: Any, optimizer: Any, batch: dict[str, Any]) -> float:
    """One training step of the tutorial's loop on a batch of the converter's loader."""
    import torch

    loss = torch.nn.functional.cross_entropy(model(batch["features"]), batch["label_index"].long())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.item())


@pytest.fixture(params=CONVERTERS)
def converter(request, spark, images, tmp_path: Path):  # type: ignore[no-untyped-def]
    module = importlib.import_module(request.param)
    spark.conf.set(module.SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, f"file://{tmp_path}/cache")
    made = module.make_spark_converter(images)
    try:
        yield request.param, made
    finally:
        made.delete()
        spark.conf.unset(module.SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF)


def test_a_learning_rate_search_with_sparktrials_reads_the_cache_on_executors(converter) -> None:  # type: ignore[no-untyped-def]
    hyperopt = pytest.importorskip("hyperopt")
    module, conv = converter
    spec = _spec(module)

    def train_and_evaluate(lr: float) -> dict[str, Any]:  # runs in an executor's Python worker
        import torch

        model = _net()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        rows, losses = 0, []
        with conv.make_torch_dataloader(transform_spec=spec, batch_size=4, num_epochs=2) as loader:
            for batch in loader:
                losses.append(_step(model, optimizer, batch))
                rows += len(batch["id"])
        return {"loss": float(np.mean(losses[-4:])), "status": hyperopt.STATUS_OK, "rows": rows}

    trials = hyperopt.SparkTrials(parallelism=2)
    best = hyperopt.fmin(train_and_evaluate, space=hyperopt.hp.loguniform("lr", -5, -1), algo=hyperopt.tpe.suggest,
                         max_evals=2, trials=trials, rstate=np.random.default_rng(0), show_progressbar=False)
    assert trials.statuses() == ["ok", "ok"], [t.get("misc") for t in trials.trials]
    # Each trial read every photo twice (num_epochs=2) from the cache, on an executor.
    assert [r["rows"] for r in trials.results] == [2 * PHOTOS, 2 * PHOTOS]
    assert all(np.isfinite(r["loss"]) for r in trials.results)
    assert np.exp(-5) <= best["lr"] <= np.exp(-1)


def test_horovodrunner_trains_on_the_converters_shards_and_averages_the_validation_loss(converter) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("horovod.torch")
    from sparkdl import HorovodRunner  # Databricks' import; sparkdl's drop-in answers it

    module, conv = converter
    spec = _spec(module)

    def train_hvd(lr: float) -> dict[str, Any]:  # as the tutorial: one rank per Spark task
        import horovod.torch as hvd
        import torch

        hvd.init()
        model = _net()
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr * hvd.size()),
                                             named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        shard = {"cur_shard": hvd.rank(), "shard_count": hvd.size()}
        trained = 0
        with conv.make_torch_dataloader(transform_spec=spec, batch_size=4, num_epochs=1, **shard) as loader:
            for batch in loader:
                _step(model, optimizer, batch)
                trained += len(batch["id"])
        ids, losses = [], []
        with torch.no_grad(), conv.make_torch_dataloader(transform_spec=spec, batch_size=4, num_epochs=1,
                                                         shuffle_row_groups=False, **shard) as loader:
            for batch in loader:
                losses.append(torch.nn.functional.cross_entropy(model(batch["features"]), batch["label_index"].long()))
                ids.extend(batch["id"].tolist())
        local = torch.stack(losses).mean()
        return {"val_loss": hvd.allreduce(local, name="val_loss").item(),  # averaged over the ranks
                "local": hvd.allgather_object(local.item()), "ids": hvd.allgather_object(sorted(ids)),
                "trained": hvd.allgather_object(trained), "size": hvd.size()}

    out = HorovodRunner(np=2).run(train_hvd, lr=0.05)
    assert out["size"] == 2
    assert out["val_loss"] == pytest.approx(float(np.mean(out["local"])), rel=1e-5)
    assert out["trained"] == [PHOTOS // 2, PHOTOS // 2]
    # Each rank validated on its own shard, Petastorm's with either converter: the DataFrame's two
    # partitions are its files, a row group each, and rank r reads the row groups g with g % 2 == r
    # in the order of converter.file_urls (Petastorm's: Spark's inputFiles(), a hash set's order).
    groups = [ids for url in conv.file_urls for ids in _row_group_ids(url)]
    assert len(groups) == 2
    assert out["ids"] == [sorted(int(i) for g in groups[r::2] for i in g) for r in range(2)]


def _row_group_ids(url: str) -> list[Any]:
    import pyarrow.parquet as pq

    f = pq.ParquetFile(url.removeprefix("file:"))
    return [f.read_row_group(i, columns=["id"]).column("id").to_pylist() for i in range(f.num_row_groups)]


def test_make_tf_dataset_gives_the_transformed_rows_as_petastorms_namedtuples(converter) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("tensorflow")
    module, conv = converter
    with conv.make_tf_dataset(transform_spec=_spec(module), batch_size=4, num_epochs=1, shuffle_row_groups=False,
                              workers_count=1) as dataset:
        batches = list(dataset)
    fields = {tuple(sorted(b._fields)) for b in batches}
    assert fields == {("features", "id", "label_index")}, fields
    ids = np.concatenate([b.id.numpy() for b in batches])
    assert sorted(ids.tolist()) == list(range(PHOTOS))
    features = np.concatenate([b.features.numpy() for b in batches])
    assert features.dtype == np.float32 and features.shape == (PHOTOS, 3, SIZE, SIZE)
    assert features.min() >= 0.0 and features.max() <= 1.0 and features.std() > 0.01
    _TF_ROWS[module] = features[np.argsort(ids)]
    if len(_TF_ROWS) == 2:  # the classic stack: Petastorm's converter gave the same values
        np.testing.assert_array_equal(_TF_ROWS["sparkdl.compat.petastorm"], _TF_ROWS["petastorm.spark"])


_TF_ROWS: dict[str, Any] = {}
