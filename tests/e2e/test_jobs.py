"""The training job of jobs/ end to end, with plain ``python`` on a local Spark session it creates
itself. Its options and defaults file (no JVM) are in tests/unit/jobs/test_job_options.py;
tests/cluster/test_standalone.py submits all three jobs with spark-submit to a real standalone cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

JOBS = REPO / "jobs"


@pytest.mark.one_stack("classic", "the modern stack runs the same jobs by spark-submit on a standalone cluster "
                        "(tests/cluster/test_standalone.py) and the job's own code in the notebooks")
@pytest.mark.spark
@pytest.mark.timeout(300)
def test_train_job_with_plain_python_from_nothing_to_a_saved_model(tmp_path: Path, spark: Any) -> None:
    """As tools/demo runs it: no dataset yet, so the job runs the ETL first, then trains, evaluates, saves."""
    env = {k: v for k, v in os.environ.items() if k not in ("SPARK_LOCAL_IP", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    out = subprocess.run(
        [sys.executable, str(JOBS / "train.py"), "--data", "digits", "--model", "model", "--epochs", "4",
         "--min-accuracy", "0.85", "--conf", "spark.sql.shuffle.partitions=2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "running the ETL job (jobs/etl.py) first" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr
    # Relative paths were made absolute against the directory the job started in.
    summary = json.loads((tmp_path / "model" / "summary.json").read_text())
    assert summary["accuracy"] >= 0.85 and summary["model"] == str(tmp_path / "model")
    assert len(summary["epoch_loss"]) == 4 and summary["epoch_loss"][-1] < summary["epoch_loss"][0]
    assert (tmp_path / "digits" / "train" / "_sparkdl_manifest.json").is_file()
    # The session the job created itself logged through conf/log4j2.properties (warnings only).
    assert "Using Spark's default log4j profile" not in out.stderr

    # The saved model is a Spark ML model that loads and scores elsewhere.
    from pyspark.sql import functions as F

    import sparkdl

    model = sparkdl.TorchModel.load(str(tmp_path / "model"))
    scored = model.transform(spark.read.parquet(str(tmp_path / "digits" / "test")))
    accuracy = scored.select(F.avg((F.col("prediction") == F.col("label")).cast("double"))).first()[0]
    assert accuracy == pytest.approx(summary["accuracy"])


@pytest.mark.one_stack("classic", "sparkdl.tune itself runs on both stacks in tests/integration/test_tune.py")
@pytest.mark.spark
@pytest.mark.timeout(300)
def test_tune_job_searches_and_a_second_run_finishes_the_same_search(tmp_path: Path) -> None:
    """jobs/tune.py from nothing: the ETL, then a search of 3 trials, 2 at once; run again with
    --trials 4, it keeps the 3 finished trials and adds one."""
    env = {k: v for k, v in os.environ.items() if k not in ("SPARK_LOCAL_IP", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}

    def search(trials: int) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [sys.executable, str(JOBS / "tune.py"), "--data", "digits", "--study", "study", "--trials", str(trials),
             "--epochs", "2", "--conf", "spark.sql.shuffle.partitions=2"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
        assert "Traceback" not in out.stdout
        return out

    first = search(3)
    assert "sparkdl tune: trial 1 started: 2 running" in first.stderr  # two trials at once
    best = json.loads((tmp_path / "study" / "best.json").read_text())
    assert best["error"] < 0.5 and set(best["params"]) == {"lr", "momentum"}
    second = search(4)
    assert "trial 3 started" in second.stderr and "trial 0 started" not in second.stderr
    assert "4 trials:" in second.stdout
