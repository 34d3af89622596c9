"""TensorFlow on the gang: ``backend="tensorflow"`` and spark-tensorflow-distributor's runner.

Each rank is a worker of ``tf.distribute.MultiWorkerMirroredStrategy`` whose ``TF_CONFIG`` comes
from the gang; a Keras ``model.fit`` under the strategy trains the same weights on every rank
from different data. TensorFlow is installed in the modern stack only (constraints/modern.txt).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import sparkdl
from sparkdl.compat import MirroredStrategyRunner

pytest.importorskip("tensorflow", reason="TensorFlow is installed on the modern stack only (tools/bootstrap.sh)")
cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.spark

CFG = sparkdl.RunConfig(timeout_s=180, start_timeout_s=120)


def fit_on_every_rank(out: str) -> dict[str, Any]:
    import numpy as np
    import tensorflow as tf

    ctx = sparkdl.context()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
        model.compile(tf.keras.optimizers.SGD(0.1, momentum=0.9), "mse")
        start = sparkdl.keras_resume(model)  # attempt 1: after attempt 0's last checkpoint
    if ctx.rank == 0:
        np.save(f"{out}/start{ctx.attempt}.npy", np.concatenate([w.ravel() for w in model.get_weights()]))
    rng = np.random.default_rng(ctx.rank)  # each rank's own data
    x = rng.random((64, 4), dtype=np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, x.sum(axis=1, keepdims=True))).batch(16)
    epochs = 2 if ctx.attempt == 0 else 3
    history = model.fit(data, epochs=epochs, initial_epoch=start, verbose=0, callbacks=[sparkdl.keras_checkpoint()])
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    np.save(f"{out}/end{ctx.attempt}-rank{ctx.rank}.npy", weights)
    if ctx.attempt == 0 and ctx.rank == 1:
        raise RuntimeError("rank 1 fails after two epochs of attempt 0")
    return {"replicas": strategy.num_replicas_in_sync, "start": start, "epochs": history.epoch,
            "tf_config": json.loads(__import__("os").environ["TF_CONFIG"]), "keras": type(model).__module__}


def test_keras_fit_under_multi_worker_mirrored_strategy_trains_on_every_rank_and_resumes(  # type: ignore[no-untyped-def]
    spark, no_leaks, tmp_path: Path
) -> None:
    import numpy as np

    result = sparkdl.launch(fit_on_every_rank, str(tmp_path), num_workers=2, backend="tensorflow",
                            config=CFG.replace(max_attempts=2))
    out = result.value
    assert result.attempts == 2 and out["replicas"] == 2
    # Attempt 1 went on from attempt 0's checkpoint of epoch 1: one epoch left, from its weights.
    assert out["start"] == 2 and out["epochs"] == [2]
    np.testing.assert_array_equal(np.load(tmp_path / "start1.npy"), np.load(tmp_path / "end0-rank0.npy"))
    # The cluster is the gang: each worker on its task's own address (never a wildcard), rank order.
    workers = out["tf_config"]["cluster"]["worker"]
    assert len(workers) == 2 and all(w.startswith("127.0.0.1:") for w in workers) and len(set(workers)) == 2
    assert out["tf_config"]["task"] == {"type": "worker", "index": 0}
    # Keras 2 (tf-keras), the Keras that trains under the strategy.
    assert out["keras"].startswith("tf_keras.")
    # Different data on each rank, the same weights after training: the gradients were all-reduced.
    for attempt in (0, 1):
        first, second = (np.load(tmp_path / f"end{attempt}-rank{r}.npy") for r in range(2))
        np.testing.assert_allclose(first, second, rtol=1e-6)


def single_worker_keras(epochs: int) -> dict[str, Any]:
    # Written for spark-tensorflow-distributor: no distribution code, the runner supplies the strategy.
    import numpy as np
    import tensorflow as tf

    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(8, activation="relu"),
                                 tf.keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(0).random((128, 3), dtype=np.float32)
    history = model.fit(tf.data.Dataset.from_tensor_slices((x, x[:, :1] * 2)).batch(32), epochs=epochs, verbose=0)
    return {"loss": history.history["loss"], "replicas": tf.distribute.get_strategy().num_replicas_in_sync}


def test_mirrored_strategy_runner_runs_code_written_for_it(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    runner = MirroredStrategyRunner(num_slots=2, use_gpu=False, config=CFG)
    assert runner.get_num_tasks() == 2
    out = runner.run(single_worker_keras, epochs=2)
    assert out["replicas"] == 2 and len(out["loss"]) == 2
    # Local mode: one worker on the driver, the strategy supplied all the same.
    local = MirroredStrategyRunner(num_slots=1, local_mode=True, use_gpu=False, config=CFG).run(single_worker_keras, epochs=1)
    assert local["replicas"] == 1 and len(local["loss"]) == 1


@pytest.mark.parametrize(("kwargs", "raised", "says"), [
    ({"num_slots": 0}, ValueError, r"num_slots cannot be less than or equal to 0"),
    ({"num_slots": 2, "local_mode": True, "use_gpu": False}, ValueError, r"local mode runs one CPU worker.*num_slots=1"),
    ({"num_slots": 2}, RuntimeError, r"'spark\.task\.resource\.gpu\.amount' is unset.*use_gpu=False"),
    ({"num_slots": 2, "gpu_resource_name": "accelerator"}, ValueError, r"name them 'gpu'"),
])
def test_mirrored_strategy_runner_refuses_what_it_cannot_run(spark, kwargs: dict[str, Any], raised: type, says: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(raised, match=says):
        MirroredStrategyRunner(**kwargs)


def fit_from_the_dataset(ds: Any, out: str) -> int:
    import numpy as np
    import tensorflow as tf

    ctx = sparkdl.context()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # TensorFlow wants it before any other op
    data = ds.tf_dataset(8, seed=3)
    ids = np.concatenate([batch["id"].numpy() for batch in data])  # one pass: this rank's share
    np.save(f"{out}/ids{ctx.rank}.npy", ids)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1)])
        model.compile(tf.keras.optimizers.SGD(0.05), "mse")
    history = model.fit(data.map(lambda b: (b["features"], b["label"])), epochs=2, verbose=0)
    return int(data.cardinality().numpy()) * 100 + len(history.history["loss"])


def test_a_dataset_feeds_keras_as_tf_data_with_equal_steps_and_disjoint_shares(  # type: ignore[no-untyped-def]
    spark, no_leaks, tmp_path: Path
) -> None:
    import numpy as np
    from pyspark.sql import functions as F

    df = spark.range(50).select(
        "id", F.array(*(F.col("id").cast("float") / 50 for _ in range(3))).alias("features"),
        (F.col("id").cast("float") / 25).alias("label"))
    ds = sparkdl.write_dataset(df, tmp_path / "ds", num_files=2, row_group_rows=10)
    generated = set(Path(tempfile.gettempdir()).glob("__autograph_generated_file*"))
    steps_and_epochs = sparkdl.run(fit_from_the_dataset, ds, str(tmp_path), num_workers=2, backend="tensorflow",
                                   config=CFG)
    # AutoGraph's generated modules went with the ranks' workdirs, not left in the temp directory.
    assert set(Path(tempfile.gettempdir()).glob("__autograph_generated_file*")) <= generated
    # 50 rows, 2 ranks, batches of 8: 25 rows and 4 steps on each rank, 2 epochs.
    assert steps_and_epochs == 4 * 100 + 2
    first, second = (np.load(tmp_path / f"ids{r}.npy") for r in range(2))
    assert len(first) == len(second) == 25
    assert sorted([*first, *second]) == list(range(50))  # every row once, on one rank or the other


def keras_model_under_ddp() -> dict[str, Any]:
    import os

    os.environ["KERAS_BACKEND"] = "torch"  # before Keras is imported in the rank
    import keras
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = sparkdl.context()
    keras.utils.set_random_seed(0)  # the same initial weights on every rank (DDP checks it too)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    ddp = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.rand(32, 4, generator=torch.Generator().manual_seed(ctx.rank))  # each rank's own data
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = [torch.zeros_like(weights) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, weights)
    return {"backend": keras.backend.backend(), "module": isinstance(model, torch.nn.Module),
            "same": all(torch.equal(everyone[0], w) for w in everyone), "params": weights.numel(),
            "first": losses[0], "last": losses[-1]}


def test_a_keras_3_model_trains_with_ddp_on_the_torch_backend(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    out = sparkdl.run(keras_model_under_ddp, num_workers=2, config=CFG)
    # Keras 3 on torch: the model is a torch module, DDP all-reduces its gradients.
    assert out["backend"] == "torch" and out["module"]
    assert out["params"] == 4 * 8 + 8 + 8 + 1 and out["same"]
    assert out["last"] < out["first"]


def converter_feeds_keras(converter: Any, out: str) -> list[int]:
    # As Petastorm's documentation feeds Keras: make_tf_dataset, the namedtuple batches mapped to (x, y).
    import numpy as np
    import tensorflow as tf

    ctx = sparkdl.context()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with converter.make_tf_dataset(batch_size=8, num_epochs=1, cur_shard=ctx.rank, shard_count=ctx.world_size) as ds:
        ids = np.concatenate([batch.id.numpy() for batch in ds])
    np.save(f"{out}/conv{ctx.rank}.npy", ids)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1)])
        model.compile(tf.keras.optimizers.SGD(0.05), "mse")
    with converter.make_tf_dataset(batch_size=8, cur_shard=ctx.rank, shard_count=ctx.world_size) as ds:
        history = model.fit(ds.map(lambda x: (x.features, x.label)), steps_per_epoch=3, epochs=2, verbose=0)
    return history.epoch


def test_petastorms_make_tf_dataset_feeds_keras_on_every_rank(spark, no_leaks, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import numpy as np
    from pyspark.sql import functions as F

    from sparkdl.compat.petastorm import SparkDatasetConverter, make_spark_converter

    spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, f"file://{tmp_path}/cache")
    try:
        df = spark.range(40).select(
            "id", F.array(*(F.col("id").cast("double") / 40 for _ in range(3))).alias("features"),
            (F.col("id").cast("double") / 20).alias("label"))
        converter = make_spark_converter(df)
        epochs = sparkdl.run(converter_feeds_keras, converter, str(tmp_path), num_workers=2, backend="tensorflow",
                             config=CFG)
        converter.delete()
    finally:
        spark.conf.unset(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF)
    assert epochs == [0, 1]  # without end (num_epochs=None): fit took 3 steps twice
    first, second = (np.load(tmp_path / f"conv{r}.npy") for r in range(2))
    assert len(first) == len(second) == 20 and sorted([*first, *second]) == list(range(40))
