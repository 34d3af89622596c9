"""TorchEstimator / TorchModel on a real local[2] Spark session: a Pipeline on scikit-learn's digits,
persistence alone and in a PipelineModel, bad input refused before training, vectorized scoring
that loads the model once per Python worker, gang rerun and resume of fit. Bad params, refused
without a JVM, are in tests/unit/ml/test_ml_params.py."""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest
import torch
from resources import recording_net
from resources.recording_net import RecordingNet, per_pid

import sparkdl
from sparkdl import ConfigError, TorchEstimator, TorchModel

# Models, factories and losses below travel to the ranks and executors by value, as a notebook's do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(recording_net)

pytestmark = pytest.mark.spark

FAST = sparkdl.RunConfig(start_timeout_s=60, slot_wait_s=2, connect_timeout_s=20, kill_grace_s=20)
PIXELS = [f"p{i}" for i in range(64)]


def digits_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


@pytest.fixture(scope="module")
def digits(spark):  # type: ignore[no-untyped-def]
    """scikit-learn's digits (real 8x8 images, 10 classes) as train and held-out DataFrames."""
    import pandas as pd
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    frame = pd.DataFrame(data.data, columns=PIXELS)
    frame["label"] = data.target.astype("int64")
    frame["id"] = np.arange(len(frame))
    train, test = train_test_split(frame, test_size=0.2, stratify=frame["label"], random_state=0)
    return spark.createDataFrame(train), spark.createDataFrame(test)


def test_digits_pipeline_trains_scores_saves_and_reloads(spark, digits, tmp_path, no_leaks):  # type: ignore[no-untyped-def]
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import StandardScaler, VectorAssembler
    from pyspark.sql import types as T

    train, test = digits
    estimator = TorchEstimator(
        model=digits_mlp,
        optimizer=lambda params: torch.optim.Adam(params, lr=3e-3),
        loss="cross_entropy",
        featuresCol="scaled",
        labelCol="label",
        batchSize=32,
        epochs=8,
        numWorkers=2,
        validationFraction=0.1,
        seed=0,
        runConfig=FAST,
    )
    pipeline = Pipeline(
        stages=[
            VectorAssembler(inputCols=PIXELS, outputCol="raw"),
            StandardScaler(inputCol="raw", outputCol="scaled", withMean=True, withStd=True),
            estimator,
        ]
    )
    started = time.monotonic()
    fitted = pipeline.fit(train)
    fit_s = time.monotonic() - started
    torch_model = fitted.stages[-1]
    assert isinstance(torch_model, TorchModel)

    history = torch_model.history
    assert [h["epoch"] for h in history] == list(range(1, 9))
    assert {"train_loss", "train_rows", "val_loss", "val_accuracy", "seconds"} <= set(history[0])
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert history[-1]["val_accuracy"] > 0.9
    assert torch_model.getHistory() == history

    scored = fitted.transform(test)
    assert scored.schema["prediction"].dataType == T.DoubleType()
    rows = scored.select("id", "label", "scaled", "prediction").orderBy("id").collect()
    predictions = np.array([r["prediction"] for r in rows])
    labels = np.array([r["label"] for r in rows])
    accuracy = float((predictions == labels).mean())
    print(f"\ndigits: held-out accuracy {accuracy:.4f} on {len(rows)} rows; fit {fit_s:.1f} s; history {history[-1]}")
    assert accuracy >= 0.95

    # The UDF computes what the module computes on the driver.
    module = torch_model.getModule()
    with torch.no_grad():
        local = module(torch.tensor(np.stack([r["scaled"].toArray() for r in rows]), dtype=torch.float32))
    assert np.array_equal(local.argmax(dim=1).numpy().astype(np.float64), predictions)

    # Saved and reloaded inside a PipelineModel: the same class, history and predictions.
    path = str(tmp_path / "pipeline")
    fitted.write().overwrite().save(path)
    reloaded = PipelineModel.load(path)
    assert type(reloaded.stages[-1]) is TorchModel
    assert reloaded.stages[-1].history == history
    again = reloaded.transform(test).select("id", "prediction").orderBy("id").collect()
    assert [r["prediction"] for r in again] == list(predictions)

    # And alone.
    alone = str(tmp_path / "alone")
    torch_model.save(alone)
    single = TorchModel.load(alone)
    assert single.getFeaturesCol() == "scaled" and single.getTask() == "classification"
    features = fitted.stages[1].transform(fitted.stages[0].transform(test))
    once_more = single.transform(features).select("id", "prediction").orderBy("id").collect()
    assert [r["prediction"] for r in once_more] == list(predictions)


# --------------------------------------------------------------------------------------------
# Bad input: a clear error before any training
# --------------------------------------------------------------------------------------------


def _marking_factory(marker: str, n_in: int, n_out: int) -> torch.nn.Module:
    # A rank that starts training builds the model; the marker proves no rank ever did.
    if os.environ.get("SPARKDL_RUN_ID"):
        Path(marker).write_text("a rank started")
    return torch.nn.Linear(n_in, n_out)


def _bad_case(spark: Any, case: str) -> tuple[Any, dict[str, Any], list[str]]:
    """A DataFrame, estimator params and the words the error must contain."""
    from pyspark.ml.linalg import Vectors

    vectors = spark.createDataFrame(
        [(Vectors.dense([float(i), 1.0, 2.0, 3.0]), i % 3) for i in range(12)], ["features", "label"]
    )
    if case == "missing features column":
        return vectors, {"featuresCol": "pixels"}, ["featuresCol='pixels'", "is not a column", "features"]
    if case == "missing label column":
        return vectors, {"labelCol": "target"}, ["labelCol='target'", "is not a column"]
    if case == "features of the wrong type":
        df = spark.createDataFrame([("a b c d", 0)] * 4, "features string, label long")
        return df, {}, ["featuresCol='features'", "has type string", "Spark ML vector", "array of numbers"]
    if case == "features of inconsistent length":
        df = spark.createDataFrame(
            [([1.0, 2.0, 3.0, 4.0], 0), ([1.0, 2.0, 3.0], 1)] * 3, "features array<double>, label long"
        )
        return df, {}, ["featuresCol='features'", "different lengths", "from 3 to 4"]
    if case == "class labels beyond the model's outputs":
        df = spark.createDataFrame([(Vectors.dense([1.0, 2.0, 3.0, 4.0]), i) for i in range(6)], ["features", "label"])
        return df, {}, ["labelCol='label'", "up to 5", "outputs 3", "0..2"]
    if case == "fractional class labels":
        df = spark.createDataFrame([(Vectors.dense([1.0, 2.0, 3.0, 4.0]), i / 2) for i in range(6)], ["features", "label"])
        return df, {}, ["labelCol='label'", "not whole numbers", "class indices"]
    if case == "string labels for cross_entropy":
        df = spark.createDataFrame([(Vectors.dense([1.0, 2.0, 3.0, 4.0]), "cat")] * 4, ["features", "label"])
        return df, {}, ["labelCol='label'", "has type string", "StringIndexer"]
    if case == "bce labels outside [0, 1]":
        df = spark.createDataFrame([(Vectors.dense([1.0, 2.0, 3.0, 4.0]), float(i)) for i in range(3)], ["features", "label"])
        return df, {"loss": "bce_with_logits", "n_out": 1}, ["labelCol='label'", "bce_with_logits", "[0, 1]"]
    if case == "model output shape vs regression label":
        df = spark.createDataFrame([(Vectors.dense([1.0, 2.0, 3.0, 4.0]), 0.5)] * 4, ["features", "label"])
        return df, {"loss": "mse"}, ["output", "has shape (4, 3)", "labelCol='label'", "one value per row", "expected"]
    if case == "model input size vs features":
        return vectors, {"n_in": 5}, ["the model failed", "featuresCol='features'", "4 features per row"]
    raise AssertionError(case)


BAD_CASES = [
    "missing features column",
    "missing label column",
    "features of the wrong type",
    "features of inconsistent length",
    "class labels beyond the model's outputs",
    "fractional class labels",
    "string labels for cross_entropy",
    "bce labels outside [0, 1]",
    "model output shape vs regression label",
    "model input size vs features",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_fails_before_training(spark, tmp_path, case):  # type: ignore[no-untyped-def]
    df, params, words = _bad_case(spark, case)
    marker = str(tmp_path / "rank-started")
    checkpoints = tmp_path / "checkpoints"
    n_in, n_out = params.pop("n_in", 4), params.pop("n_out", 3)
    estimator = TorchEstimator(
        model=functools.partial(_marking_factory, marker, n_in, n_out),
        numWorkers=2,
        epochs=1,
        checkpointDir=str(checkpoints),
        runConfig=FAST,
        **params,
    )
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        estimator.fit(df)
    elapsed = time.monotonic() - started
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in: {message}"
    assert not os.path.exists(marker), "a rank started training"
    assert not checkpoints.exists()
    assert elapsed < 20, f"the check took {elapsed:.1f} s"


# --------------------------------------------------------------------------------------------
# Scoring: vectorized, loaded once per Python worker, vector or array features
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def feature_rows(spark):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4000, 8)).astype(np.float32)
    df = spark.createDataFrame([(i, x[i].tolist()) for i in range(len(x))], "id long, features array<double>").repartition(8)
    return x, df


def test_transform_is_vectorized_and_loads_once_per_worker(spark, feature_rows, tmp_path):  # type: ignore[no-untyped-def]
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import types as T

    x, df = feature_rows
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    net = RecordingNet(str(log_dir), 8, 3)
    model = TorchModel(model=net, featuresCol="features", task="regression", inferenceBatchSize=256)

    scored = model.transform(df)
    assert scored.schema["prediction"].dataType == T.ArrayType(T.FloatType(), True)
    rows = scored.select("id", "prediction").collect()
    got = np.array([r["prediction"] for r in sorted(rows, key=lambda r: r["id"])], dtype=np.float32)
    with torch.no_grad():
        want = net.linear(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    calls = [int(n) for sizes in per_pid(log_dir, "forward", skip_pid=os.getpid()).values() for n in sizes]
    assert sum(calls) == len(x)
    assert max(calls) <= 256
    assert len(calls) <= len(x) // 100, f"{len(calls)} model calls for {len(x)} rows: not vectorized"
    loads = per_pid(log_dir, "load", skip_pid=os.getpid())
    assert loads and all(len(v) == 1 for v in loads.values()), loads
    assert df.rdd.getNumPartitions() > len(loads), "every task loaded the model: no per-worker cache"

    # Another job, on ML vectors this time: workers that scored before do not load the model again.
    as_vectors = df.withColumn("features", array_to_vector("features"))
    classified = model.copy().setTask("classification")  # the same module, so the same cache entry
    by_id = {r["id"]: r["prediction"] for r in classified.transform(as_vectors).select("id", "prediction").collect()}
    assert [by_id[i] for i in range(len(x))] == want.argmax(axis=1).astype(np.float64).tolist()
    assert all(len(v) == 1 for v in per_pid(log_dir, "load", skip_pid=os.getpid()).values()), "a worker loaded the model twice"


def test_transform_on_the_pandas_path_matches(spark, feature_rows, monkeypatch):  # type: ignore[no-untyped-def]
    # pyspark < 4.1 has no arrow_udf; the pandas_udf path serves it and must score the same.
    import sparkdl._internal.ml.scoring

    _, df = feature_rows
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 2)
    arrow = TorchModel(model=net, task="regression").transform(df).select("id", "prediction").collect()
    monkeypatch.setattr(sparkdl._internal.ml.scoring, "_arrow_udf_available", lambda: False)
    pandas = TorchModel(model=net, task="regression").transform(df).select("id", "prediction").collect()
    key = lambda r: r["id"]  # noqa: E731
    assert [r["prediction"] for r in sorted(arrow, key=key)] == [r["prediction"] for r in sorted(pandas, key=key)]
    single = TorchModel(model=torch.nn.Linear(8, 1), task="regression").transform(df)
    assert single.schema["prediction"].dataType.simpleString() == "double"


class TwoInputs(torch.nn.Module):
    """A model of two inputs, as predict_batch_udf(...)(col_a, col_b) users have them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(5, 2), torch.nn.Linear(3, 2)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.a(a) * self.b(b)


class Split(torch.nn.Module):
    """The wrapper the featuresCol message tells users to write, as it says it."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(*torch.split(x, [5, 3], dim=1))


def test_torchscript_models_and_models_of_several_inputs_score(spark, feature_rows, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pyspark.ml.feature import VectorAssembler

    x, df = feature_rows
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy()
    key = lambda r: r["id"]  # noqa: E731
    # TorchScript, scripted or traced (torch.jit.load gives the same): no pickle takes these.
    for module in (torch.jit.script(net), torch.jit.trace(net, torch.from_numpy(x[:2]))):
        model = TorchModel(model=module, task="regression")
        got = np.array([r["prediction"] for r in sorted(model.transform(df).collect(), key=key)], dtype=np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    model.save(str(tmp_path / "traced"))
    loaded = TorchModel.load(str(tmp_path / "traced"))
    assert isinstance(loaded.getModule(), torch.jit.ScriptModule)
    got = np.array([r["prediction"] for r in sorted(loaded.transform(df).collect(), key=key)], dtype=np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    # Several input columns: refused with a recipe, which, followed as written, scores.
    two = TwoInputs()
    cols = spark.createDataFrame(
        [(i, x[i, :5].tolist(), *map(float, x[i, 5:])) for i in range(200)], "id long, a array<float>, b0 double, b1 double, b2 double"
    )
    with pytest.raises(ConfigError, match=r"featuresCol takes one column.*VectorAssembler.*torch\.split"):
        TorchModel(model=two, featuresCol=["a", "b0", "b1", "b2"])
    from pyspark.ml.functions import array_to_vector

    assembled = VectorAssembler(inputCols=["a", "b0", "b1", "b2"], outputCol="features").transform(
        cols.withColumn("a", array_to_vector("a"))
    )
    rows = sorted(TorchModel(model=Split(two), task="regression").transform(assembled).collect(), key=key)
    with torch.no_grad():
        want_two = two(torch.from_numpy(x[:200, :5]), torch.from_numpy(x[:200, 5:])).numpy()
    np.testing.assert_allclose(np.array([r["prediction"] for r in rows], dtype=np.float32), want_two, rtol=1e-5, atol=1e-6)


def test_transform_refuses_bad_columns(spark, feature_rows) -> None:  # type: ignore[no-untyped-def]
    from pyspark.errors import PythonException

    _, df = feature_rows
    model = TorchModel(model=torch.nn.Linear(8, 2), task="classification")
    with pytest.raises(ConfigError, match="predictionCol='id' is already a column"):
        model.copy().setPredictionCol("id").transform(df)
    with pytest.raises(ConfigError, match="featuresCol='id' has type bigint"):
        model.copy().setFeaturesCol("id").transform(df)
    with pytest.raises(ConfigError, match=r"spark\.task\.resource\.gpu\.amount"):
        model.copy().setUseGpu(True).transform(df)
    nulls = spark.createDataFrame([([1.0] * 8,), (None,)], "features array<double>")
    with pytest.raises(PythonException, match="featuresCol='features' is null in 1 of the"):
        model.transform(nulls).collect()


# --------------------------------------------------------------------------------------------
# Persistence of the estimator; gang rerun and resume of fit
# --------------------------------------------------------------------------------------------


def test_estimator_saves_and_loads_its_callables(spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pyspark.ml import Pipeline

    estimator = TorchEstimator(
        model=digits_mlp,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
        loss=lambda out, y: (out - y).abs().mean(),
        epochs=3,
        numWorkers=2,
        runConfig=FAST,
        featuresCol="scaled",
    )
    path = str(tmp_path / "pipeline")
    Pipeline(stages=[estimator]).save(path)
    loaded = Pipeline.load(path).getStages()[0]
    assert isinstance(loaded, TorchEstimator) and loaded.uid == estimator.uid
    assert (loaded.getEpochs(), loaded.getNumWorkers(), loaded.getFeaturesCol()) == (3, 2, "scaled")
    assert loaded.getRunConfig() == FAST
    assert loaded.getLoss()(torch.tensor([3.0]), torch.tensor([1.0])).item() == 2.0
    module = loaded.getModel()()
    assert [tuple(p.shape) for p in module.parameters()] == [tuple(p.shape) for p in digits_mlp().parameters()]
    assert isinstance(loaded.getOptimizer()(module.parameters()), torch.optim.SGD)


def flaky_mse(out: torch.Tensor, y: torch.Tensor, *, log_dir: str, fail_at: int) -> torch.Tensor:
    """MSE that fails once, on rank 1 of the first attempt, and counts the calls of rank 0."""
    if os.environ.get("SPARKDL_RUN_ID"):
        ctx = sparkdl.context()
        calls = _LOSS_CALLS.get(ctx.attempt, 0) + 1
        _LOSS_CALLS[ctx.attempt] = calls
        if ctx.rank == 0:
            Path(log_dir, f"calls-{ctx.run_id}-{ctx.attempt}").write_text(str(calls))
        if ctx.rank == 1 and ctx.attempt == 0 and calls == fail_at:
            raise RuntimeError("injected failure in the loss")
    return torch.nn.functional.mse_loss(out.squeeze(-1), y)


_LOSS_CALLS: dict[int, int] = {}


def test_fit_reruns_the_gang_and_resumes(spark, tmp_path, no_leaks):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.1
    df = spark.createDataFrame([(x[i].tolist(), float(y[i])) for i in range(len(x))], "features array<double>, label double")
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    checkpoints = str(tmp_path / "checkpoints")
    # 256 rows, 2 ranks, batches of 16: 8 steps per epoch. Rank 1 fails in the 4th step of epoch 2.
    steps = 8
    loss = functools.partial(flaky_mse, log_dir=str(log_dir), fail_at=steps + 4)
    estimator = TorchEstimator(
        model=lambda: torch.nn.Linear(4, 1),
        optimizer="sgd",
        learningRate=0.02,
        loss=loss,
        batchSize=16,
        epochs=3,
        numWorkers=2,
        checkpointDir=checkpoints,
        runConfig=FAST,
    )
    first = estimator.fit(df)
    history = first.history
    assert [h["epoch"] for h in history] == [1, 2, 3]
    counts = {p.name.rsplit("-", 1)[1]: int(p.read_text()) for p in log_dir.glob("calls-*")}
    # Attempt 1 resumed from the checkpoint at the end of epoch 1: it ran epochs 2 and 3 only.
    assert counts == {"0": steps + 4, "1": 2 * steps}, counts
    assert history[-1]["train_loss"] < history[0]["train_loss"]

    # The same directory again, one more epoch: the fit resumes after epoch 3, history included.
    for p in log_dir.glob("calls-*"):
        p.unlink()
    second = estimator.copy().setEpochs(4).fit(df)
    assert second.history[:3] == history
    assert [h["epoch"] for h in second.history] == [1, 2, 3, 4]
    assert [int(p.read_text()) for p in log_dir.glob("calls-*")] == [steps]
    with torch.no_grad():
        pred = second.getModule()(torch.tensor(x, dtype=torch.float32)).squeeze(-1).numpy()
    assert float(np.mean((pred - y) ** 2)) < float(np.var(y))


@pytest.mark.one_stack("modern", "Spark ML's CrossValidator copies the params the same way in Spark 3.5 and 4; "
                        "the fit directory is sparkdl's, and the fits' resume is tested on both stacks")
def test_cross_validator_fits_sharing_a_checkpoint_dir_each_keep_their_own(spark, tmp_path, no_leaks):  # type: ignore[no-untyped-def]
    """Spark ML copies the estimator, checkpointDir included, for every fit: two learning rates on
    two folds, two fits at a time, then the best on all the data. Each fit trains from scratch in
    a directory of its own (none resumes another's state, none is refused by another's lease).
    The same fit made again resumes from its own: test_fit_reruns_the_gang_and_resumes."""
    import json

    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    from sparkdl._internal.ckpt.fence import run_of

    rng = np.random.default_rng(1)
    x = rng.normal(size=(96, 3))
    y = x @ np.array([1.0, -1.0, 2.0])
    df = spark.createDataFrame([(x[i].tolist(), float(y[i])) for i in range(len(x))], "features array<double>, label double")
    shared = tmp_path / "checkpoints"
    estimator = TorchEstimator(model=lambda: torch.nn.Linear(3, 1), optimizer="sgd", loss="mse", batchSize=16,
                               epochs=2, numWorkers=1, checkpointDir=str(shared), runConfig=FAST)
    grid = ParamGridBuilder().addGrid(estimator.learningRate, [0.01, 0.05]).build()
    cv = CrossValidator(estimator=estimator, estimatorParamMaps=grid, evaluator=RegressionEvaluator(),
                        numFolds=2, parallelism=2, seed=3)
    fitted = cv.fit(df)
    fits = sorted(p for p in shared.iterdir() if p.is_dir())
    # 2 learning rates x 2 folds, and the best learning rate on all the rows: 5 fits, 5 directories.
    assert len(fits) == 5 and all(p.name.startswith("fit-") for p in fits), [p.name for p in shared.iterdir()]
    runs = set()
    for fit in fits:
        records = [json.loads(p.read_text()) for p in fit.glob("ckpt-*.json")]
        # Each trained its 2 epochs from scratch: a checkpoint per epoch, both by one run.
        assert len(records) == 2 and len({run_of(r["writer"]) for r in records}) == 1, records
        runs.add(run_of(records[0]["writer"]))
    assert len(runs) == 5, runs
    assert [h["epoch"] for h in fitted.bestModel.history] == [1, 2]
