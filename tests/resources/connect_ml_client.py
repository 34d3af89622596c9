"""A Spark Connect client program for TorchEstimator / TorchModel (tests/e2e/test_connect_ml.py runs it
against a real Connect server).

``python connect_ml_client.py URL SCENARIO WORKDIR``: the session is ``SparkSession.builder.remote(URL)``,
which has no SparkContext, no broadcast and no py4j. Each scenario prints one ``RESULT <json>``
line. This file runs as a script, so its models, factories and losses travel by value.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import recording_net  # next to this script
import torch
from recording_net import RecordingNet, per_pid

import sparkdl
from sparkdl import ConfigError, TorchEstimator, TorchModel

cloudpickle.register_pickle_by_value(recording_net)  # the executors cannot import it

FAST = sparkdl.RunConfig(start_timeout_s=120, slot_wait_s=5, connect_timeout_s=30, kill_grace_s=20)
PIXELS = [f"p{i}" for i in range(64)]


def digits_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def digits(spark: Any) -> tuple[Any, Any]:
    """scikit-learn's digits (real 8x8 images, 10 classes), split into train and held-out DataFrames."""
    import pandas as pd
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    frame = pd.DataFrame(data.data, columns=PIXELS)
    frame["label"] = data.target.astype("int64")
    frame["id"] = np.arange(len(frame))
    train, test = train_test_split(frame, test_size=0.2, stratify=frame["label"], random_state=0)
    return spark.createDataFrame(train), spark.createDataFrame(test)


def _predictions(df: Any) -> list[float]:
    return [r["prediction"] for r in df.select("id", "prediction").orderBy("id").collect()]


def scenario_pipeline(spark: Any, work: str) -> dict[str, Any]:
    """A Pipeline with TorchEstimator fitted on real data, scored, saved and reloaded, over Connect."""
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import StandardScaler, VectorAssembler

    train, test = digits(spark)
    estimator = TorchEstimator(
        model=digits_mlp,
        optimizer=lambda params: torch.optim.Adam(params, lr=3e-3),
        loss="cross_entropy",
        featuresCol="scaled",
        labelCol="label",
        batchSize=32,
        epochs=6,
        numWorkers=2,
        validationFraction=0.1,
        seed=0,
        runConfig=FAST,
    )
    pipeline = Pipeline(stages=[
        VectorAssembler(inputCols=PIXELS, outputCol="raw"),
        StandardScaler(inputCol="raw", outputCol="scaled", withMean=True, withStd=True),
        estimator,
    ])
    fitted = pipeline.fit(train)
    torch_model = fitted.stages[-1]
    out: dict[str, Any] = {"stage_type": type(torch_model).__name__, "history": torch_model.history}

    scored = fitted.transform(test)
    out["prediction_type"] = scored.schema["prediction"].dataType.simpleString()
    rows = scored.select("id", "label", "scaled", "prediction").orderBy("id").collect()
    predictions = [r["prediction"] for r in rows]
    labels = [float(r["label"]) for r in rows]
    out["accuracy"] = float(np.mean(np.array(predictions) == np.array(labels)))
    # The UDF on the executors computes what the module computes here.
    with torch.no_grad():
        local = torch_model.getModule()(torch.tensor(np.stack([r["scaled"].toArray() for r in rows]), dtype=torch.float32))
    out["matches_local_module"] = local.argmax(dim=1).numpy().astype(np.float64).tolist() == predictions

    # Saved (twice: overwrite goes through the server) and reloaded inside a PipelineModel.
    path = f"{work}/pipeline"
    fitted.write().overwrite().save(path)
    fitted.write().overwrite().save(path)
    reloaded = PipelineModel.load(path)
    out["reloaded_stage_type"] = type(reloaded.stages[-1]).__name__
    out["reloaded_history_equal"] = reloaded.stages[-1].history == torch_model.history
    out["reloaded_same_predictions"] = _predictions(reloaded.transform(test)) == predictions

    # The model alone, and the estimator with its callables.
    alone = f"{work}/alone"
    torch_model.save(alone)
    single = TorchModel.load(alone)
    features = fitted.stages[1].transform(fitted.stages[0].transform(test))
    out["alone_same_predictions"] = _predictions(single.transform(features)) == predictions
    estimator.save(f"{work}/estimator")
    est = TorchEstimator.load(f"{work}/estimator")
    out["estimator_params"] = [est.getEpochs(), est.getFeaturesCol(), est.getRunConfig() == FAST,
                               type(est.getOptimizer()(digits_mlp().parameters())).__name__]

    # The trust check of a saved model holds over Connect: a file others may write is refused.
    data_dir = Path(alone) / "data"
    os.chmod(data_dir, 0o777)
    try:
        TorchModel.load(alone)
        out["untrusted_error"] = None
    except ConfigError as exc:
        out["untrusted_error"] = str(exc)
    out["trusted_same_predictions"] = _predictions(TorchModel.load(alone, trusted=True).transform(features)) == predictions
    spark.conf.set("spark.sparkdl.ml.trustSavedModels", "true")  # the opt-in by conf, read over Connect
    out["trusted_by_conf"] = TorchModel.load(alone).uid == torch_model.uid
    spark.conf.unset("spark.sparkdl.ml.trustSavedModels")
    os.chmod(data_dir, 0o755)
    return out


def scenario_once(spark: Any, work: str) -> dict[str, Any]:
    """TorchModel.transform: the model's file is uploaded once, and loaded once per Python worker."""
    from pyspark.ml.functions import array_to_vector

    uploads: list[str] = []
    add = spark.addArtifacts

    def counting_add(*paths: str, **kwargs: Any) -> Any:
        result = add(*paths, **kwargs)
        uploads.extend(os.path.basename(p) for p in paths)
        return result

    spark.addArtifacts = counting_add
    log_dir = Path(work) / "log"
    log_dir.mkdir()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2000, 8)).astype(np.float32)
    df = spark.createDataFrame([(i, x[i].tolist()) for i in range(len(x))], "id long, features array<double>").repartition(8)
    net = RecordingNet(str(log_dir), 8, 3)
    model = TorchModel(model=net, featuresCol="features", task="regression", inferenceBatchSize=128)

    scored = model.transform(df)
    out: dict[str, Any] = {"prediction_type": scored.schema["prediction"].dataType.simpleString()}
    rows = sorted(scored.select("id", "prediction").collect(), key=lambda r: r["id"])
    got = np.array([r["prediction"] for r in rows], dtype=np.float32)
    with torch.no_grad():
        want = net.linear(torch.from_numpy(x)).numpy()
    out["close"] = bool(np.allclose(got, want, rtol=1e-5, atol=1e-6))
    out["forward_calls"] = [int(n) for sizes in per_pid(log_dir, "forward").values() for n in sizes]
    out["loads_first"] = per_pid(log_dir, "load")

    # Another job, on ML vectors, by a copy (the same module): no upload, no load in a warm worker.
    classified = model.copy().setTask("classification")
    as_vectors = df.withColumn("features", array_to_vector("features"))
    by_id = {r["id"]: r["prediction"] for r in classified.transform(as_vectors).select("id", "prediction").collect()}
    out["classified_ok"] = [by_id[i] for i in range(len(x))] == want.argmax(axis=1).astype(np.float64).tolist()
    out["loads"] = per_pid(log_dir, "load")
    out["uploads"] = list(uploads)
    out["client_pid"] = str(os.getpid())
    out["partitions"] = 8

    # A server that takes no files: the bytes travel with the UDF instead, and the user is told.
    def refusing_add(*paths: str, **kwargs: Any) -> Any:
        raise RuntimeError("artifacts are disabled here")

    spark.addArtifacts = refusing_add
    torch.manual_seed(5)
    other = torch.nn.Linear(8, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scored = TorchModel(model=other, task="classification").transform(df.limit(50))
        got_other = {r["id"]: r["prediction"] for r in scored.select("id", "prediction").collect()}
    with torch.no_grad():
        want_other = other(torch.from_numpy(x)).argmax(dim=1).double().tolist()  # limit(50) takes any 50 ids
    out["fallback_ok"] = len(got_other) == 50 and all(got_other[i] == want_other[i] for i in got_other)
    out["fallback_warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return out


def _marking_factory(marker: str, n_in: int, n_out: int) -> torch.nn.Module:
    # A rank that starts training builds the model; the marker proves no rank ever did.
    if os.environ.get("SPARKDL_RUN_ID"):
        Path(marker).write_text("a rank started")
    return torch.nn.Linear(n_in, n_out)


def _error(call: Any) -> list[str] | None:
    try:
        call()
        return None
    except Exception as exc:
        return [type(exc).__name__, str(exc)]


def scenario_bad(spark: Any, work: str) -> dict[str, Any]:
    """Bad input over Connect: the same clear errors as on a classic session, before any training."""
    from pyspark.ml.linalg import Vectors

    marker = f"{work}/rank-started"
    fractional = spark.createDataFrame([(Vectors.dense([1.0, 2.0, 3.0, 4.0]), i / 2) for i in range(6)], ["features", "label"])
    estimator = TorchEstimator(model=functools.partial(_marking_factory, marker, 4, 3), numWorkers=2, epochs=1,
                               checkpointDir=f"{work}/checkpoints", runConfig=FAST)
    wrong_type = spark.createDataFrame([("a b c d", 0)] * 4, "features string, label long")
    rows = spark.createDataFrame([(i, [float(i)] * 8) for i in range(20)], "id long, features array<double>")
    nulls = spark.createDataFrame([([1.0] * 8,), (None,)], "features array<double>")
    model = TorchModel(model=torch.nn.Linear(8, 2), task="classification")
    return {
        "fractional": _error(lambda: estimator.fit(fractional)),
        "wrong_type": _error(lambda: estimator.fit(wrong_type)),
        "rank_started": os.path.exists(marker),
        "checkpoints": os.path.exists(f"{work}/checkpoints"),
        "prediction_clash": _error(lambda: model.copy().setPredictionCol("id").transform(rows)),
        "gpu": _error(lambda: model.copy().setUseGpu(True).transform(rows)),
        "nulls": _error(lambda: model.transform(nulls).collect()),
    }


def scenario_compat(spark: Any, work: str) -> dict[str, Any]:
    """Loads what a classic session saved (work/classic-*), scores it, and saves it again (work/connect-*)."""
    from pyspark.ml import PipelineModel

    rows = json.loads(Path(work, "rows.json").read_text())
    df = spark.createDataFrame([(i, r) for i, r in enumerate(rows)], "id long, features array<double>")
    pipeline = PipelineModel.load(f"{work}/classic-pipeline")
    model = TorchModel.load(f"{work}/classic-model")
    out = {
        "pipeline": _predictions(pipeline.transform(df)),
        "model": _predictions(model.transform(df)),
        "history": model.history,
    }
    pipeline.write().overwrite().save(f"{work}/connect-pipeline")
    model.save(f"{work}/connect-model")
    return out


def main() -> None:
    from pyspark.sql import SparkSession

    url, scenario, work = sys.argv[1:4]
    spark = SparkSession.builder.remote(url).getOrCreate()
    assert type(spark).__module__.startswith("pyspark.sql.connect")
    try:
        result = globals()[f"scenario_{scenario}"](spark, work)
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
