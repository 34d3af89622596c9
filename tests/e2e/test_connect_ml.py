"""TorchEstimator / TorchModel from a Spark Connect client, against a real Connect server on 127.0.0.1.

The server is pip pyspark 4's own (tools/connect_server.py), ``local[2]``; each scenario is a client
program of its own (tests/resources/connect_ml_client.py) whose session is
``SparkSession.builder.remote("sc://127.0.0.1:PORT")``: no SparkContext, no broadcast, no py4j. The
classic stack (pyspark 3.5, no Connect client) skips here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import REPO
from connect_server import ConnectServer

ROOT = REPO
CLIENT = ROOT / "tests" / "resources" / "connect_ml_client.py"

pytestmark = [pytest.mark.spark]



def client(connect_server: ConnectServer, scenario: str, work: Path, timeout: float = 420) -> dict[str, Any]:
    out = subprocess.run([sys.executable, str(CLIENT), connect_server.url, scenario, str(work)], capture_output=True,
                         text=True, timeout=timeout, cwd=work)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, f"{out.stdout[-3000:]}\n{out.stderr[-5000:]}\n--- server\n{connect_server.tail()}"
    result: dict[str, Any] = json.loads(lines[-1].split(" ", 1)[1])
    return result


def test_a_pipeline_with_torchestimator_fits_scores_saves_and_reloads_over_connect(
    connect_server: ConnectServer, tmp_path: Path
) -> None:
    r = client(connect_server, "pipeline", tmp_path)
    history = r["history"]
    assert r["stage_type"] == "TorchModel"
    assert [h["epoch"] for h in history] == list(range(1, 7))
    assert history[-1]["train_loss"] < history[0]["train_loss"] / 3
    assert history[-1]["val_accuracy"] > 0.9, history[-1]
    assert r["prediction_type"] == "double"
    assert r["accuracy"] >= 0.93, r["accuracy"]  # held-out digits, scored on the executors
    assert r["matches_local_module"]
    # Saved (with overwrite) and reloaded as a PipelineModel, alone, and the estimator's callables.
    assert r["reloaded_stage_type"] == "TorchModel" and r["reloaded_history_equal"]
    assert r["reloaded_same_predictions"] and r["alone_same_predictions"]
    assert r["estimator_params"] == [6, "scaled", True, "Adam"]
    assert (tmp_path / "pipeline" / "stages").is_dir()
    # The trust check of a saved model, and both opt-ins, hold over Connect.
    error = r["untrusted_error"]
    assert error and "is writable by other users" in error and "trusted=True" in error, error
    assert r["trusted_same_predictions"] and r["trusted_by_conf"]


def test_transform_uploads_the_model_once_and_loads_it_once_per_python_worker(
    connect_server: ConnectServer, tmp_path: Path
) -> None:
    r = client(connect_server, "once", tmp_path)
    assert r["prediction_type"] == "array<float>" and r["close"] and r["classified_ok"]
    # One upload of one file named by the content hash, for two transforms (a copy of the model).
    assert len(r["uploads"]) == 1 and r["uploads"][0].startswith("sparkdl-model-"), r["uploads"]
    workers = {pid: loads for pid, loads in r["loads"].items() if pid != r["client_pid"]}
    assert workers and all(loads == ["load"] for loads in workers.values()), r["loads"]
    assert r["partitions"] > len(workers), "every task loaded the model: no per-worker cache"
    assert {pid: v for pid, v in r["loads_first"].items() if pid != r["client_pid"]} == workers  # none in job 2
    calls = r["forward_calls"]
    assert max(calls) <= 128 and len(calls) <= 2000 // 50, calls  # batches, not rows
    # A server that refuses the file: the bytes go with the UDF, the predictions are right, and a warning says so.
    assert r["fallback_ok"]
    assert any("could not add the model's file" in w and "artifacts are disabled here" in w
               for w in r["fallback_warnings"]), r["fallback_warnings"]


def test_a_worker_refuses_model_bytes_that_do_not_match_the_model_id() -> None:
    # No JVM: the check a Python worker makes before it unpickles what reached it.
    import hashlib

    import cloudpickle
    import torch

    from sparkdl import SparkDLError
    from sparkdl._internal.ml.scoring import Scorer

    data = cloudpickle.dumps(torch.nn.Linear(2, 1))
    good = dict(model_id=hashlib.sha256(data).hexdigest()[:24], task="regression", num_features=2, batch_rows=8,
                use_gpu=False, features_col="features", vector_out=False)
    assert Scorer(source=data, **good).module_bytes() == data  # type: ignore[arg-type]
    with pytest.raises(SparkDLError, match="do not match the model"):
        Scorer(source=data + b"x", **good).module_bytes()  # type: ignore[arg-type]


def test_bad_input_gives_the_same_clear_errors_over_connect(connect_server: ConnectServer, tmp_path: Path) -> None:
    r = client(connect_server, "bad", tmp_path)
    kind, message = r["fractional"]
    assert kind == "ConfigError" and "labelCol='label'" in message and "not whole numbers" in message, message
    kind, message = r["wrong_type"]
    assert kind == "ConfigError" and "featuresCol='features' has type string" in message, message
    assert not r["rank_started"] and not r["checkpoints"]
    assert r["prediction_clash"][0] == "ConfigError" and "predictionCol='id'" in r["prediction_clash"][1]
    # useGpu=True reads the server's confs over Connect: no GPU is assigned to tasks there.
    assert r["gpu"][0] == "ConfigError" and "spark.task.resource.gpu.amount" in r["gpu"][1], r["gpu"]
    assert "featuresCol='features' is null in 1 of the" in r["nulls"][1], r["nulls"]


def test_models_saved_classic_load_over_connect_and_back(connect_server: ConnectServer, any_spark: Any, tmp_path: Path) -> None:
    # The classic side runs on whichever session is running (this test comes late, with the
    # Connect server): a model saved and scored there is what any classic application saves.
    spark = any_spark
    import torch
    from pyspark.ml import PipelineModel
    from pyspark.ml.feature import SQLTransformer

    from sparkdl import TorchModel

    rows = np.random.default_rng(2).normal(size=(40, 8)).round(3).tolist()
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    df = spark.createDataFrame([(i, r) for i, r in enumerate(rows)], "id long, features array<double>")
    torch.manual_seed(4)
    classifier = TorchModel(model=torch.nn.Linear(8, 3), task="classification")
    pipeline = PipelineModel(stages=[SQLTransformer(statement="SELECT * FROM __THIS__ WHERE id >= 0"),
                                     TorchModel(model=torch.nn.Linear(8, 1), task="regression")])

    def predictions(scored: Any) -> list[float]:
        return [r["prediction"] for r in scored.select("id", "prediction").orderBy("id").collect()]

    want_model, want_pipeline = predictions(classifier.transform(df)), predictions(pipeline.transform(df))
    classifier.save(str(tmp_path / "classic-model"))
    pipeline.save(str(tmp_path / "classic-pipeline"))

    r = client(connect_server, "compat", tmp_path)
    assert r["model"] == want_model and r["pipeline"] == want_pipeline

    back = TorchModel.load(str(tmp_path / "connect-model"))
    assert predictions(back.transform(df)) == want_model
    assert predictions(PipelineModel.load(str(tmp_path / "connect-pipeline")).transform(df)) == want_pipeline
