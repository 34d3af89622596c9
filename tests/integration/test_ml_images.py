"""TorchEstimator and TorchModel on an image column, through the image job's own pipeline
(jobs/images.py): real handwritten digits (scikit-learn's, written as PNG files) read by Spark's
``binaryFile`` source, decoded and augmented on 2 ranks by ``ImageDecoder``, scored by the fitted
PipelineModel decoding on the executors, saved and loaded. Bad image input is refused before
training, naming the param. The job's command line is in tests/unit/jobs/test_job_options.py."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

import sparkdl
from sparkdl import ConfigError, ImageDecoder, TorchEstimator

pytestmark = pytest.mark.spark
# The decoder below travels to the executors inside the scoring UDF, pickled by pyspark's cloudpickle.
pytest.importorskip("pyspark.cloudpickle").register_pickle_by_value(sys.modules[__name__])

FAST = sparkdl.RunConfig(start_timeout_s=60, slot_wait_s=2, connect_timeout_s=20, kill_grace_s=20)


@pytest.fixture(scope="module")
def job() -> Any:
    """jobs/images.py, imported the way a job script imports its neighbours."""
    import importlib

    sys.path.insert(0, str(REPO / "jobs"))
    try:
        yield importlib.import_module("images")
    finally:
        sys.path.remove(str(REPO / "jobs"))
        sys.modules.pop("images", None)
        sys.modules.pop("_common", None)


@pytest.fixture(scope="module")
def digit_files(job: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digit-images")
    assert job.write_digit_images(root) == 1797
    return root


@pytest.mark.one_stack("classic", "the modern stack fits, scores, saves and reloads the same image pipeline in "
                        "notebooks/images.ipynb; the decoders' own tests run on both")
def test_the_image_pipeline_fits_on_two_ranks_scores_held_out_images_and_reloads(spark, job, digit_files,  # type: ignore[no-untyped-def]
                                                                                 tmp_path, no_leaks) -> None:
    from pyspark.ml import PipelineModel
    from pyspark.sql import functions as F

    summary = job.fit_and_score(spark, str(digit_files), str(tmp_path / "pipeline"), epochs=5, image_size=16,
                                num_workers=2, seed=0, run_config=FAST)
    assert summary["test_images"] == 360 and len(summary["history"]) == 5
    assert summary["accuracy"] >= 0.85, summary  # images never seen in training; chance is 0.1

    loaded = PipelineModel.load(str(tmp_path / "pipeline"))
    # The fitted model decodes with the training decoder's deterministic form: the center crop.
    assert loaded.stages[-1].getFeaturesDecoder() == ImageDecoder(16, scale=(0.6, 1.0), ratio=(0.8, 1.25),
                                                                  flip=False, crop="center")
    test = job.read_images(spark, str(digit_files))[1]
    scored = loaded.transform(test).select("id", "label", "prediction").orderBy("id").collect()
    assert sum(r["prediction"] == r["label"] for r in scored) / len(scored) == pytest.approx(summary["accuracy"])

    # The same model scores the same files read by Spark's image source (a struct of raw pixels):
    # decoded to the same RGB pixels, they get the same predictions.
    images = spark.read.format("image").option("recursiveFileLookup", "true").load(str(digit_files)).coalesce(2)
    images = images.withColumn("id", F.regexp_extract("image.origin", r"(\d+)\.png$", 1).cast("int"))
    model = loaded.stages[-1].copy().setFeaturesCol("image")
    by_struct = model.transform(images.where(F.col("id") % 5 == 0)).select("id", "prediction").orderBy("id").collect()
    assert [(r["id"], r["prediction"]) for r in by_struct] == [(r["id"], r["prediction"]) for r in scored]

    # With spark.sparkdl.ml.decodeThreads=2 each task decodes on two threads (Together fails
    # otherwise), while the model scores the chunk before: the same predictions, in row order.
    model = loaded.stages[-1].copy()
    model.setFeaturesDecoder(Together(model.getFeaturesDecoder()))
    spark.conf.set("spark.sparkdl.ml.decodeThreads", "2")
    try:
        threaded = model.setInferenceBatchSize(64).transform(test)
        threaded_rows = threaded.select("id", "prediction").orderBy("id").collect()
    finally:
        spark.conf.unset("spark.sparkdl.ml.decodeThreads")
    assert [(r["id"], r["prediction"]) for r in threaded_rows] == [(r["id"], r["prediction"]) for r in scored]


class Together:
    """A decoder whose first call in a task waits (20 s at most) for a second call to be under way:
    it decodes only where a task decodes on at least two threads at once, and fails otherwise."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.__setstate__({"inner": inner})

    def __getstate__(self) -> dict[str, Any]:
        return {"inner": self.inner}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.inner = state["inner"]
        self.met, self.both = threading.Event(), threading.Barrier(2)

    def __call__(self, value: Any, rng: Any) -> Any:
        if not self.met.is_set():
            try:
                self.both.wait(timeout=20)
            except threading.BrokenBarrierError:
                raise RuntimeError("no other row was being decoded at the same time") from None
            self.met.set()
        return self.inner(value, rng)


@pytest.mark.parametrize("case", ["no_decoder", "eval_size", "not_callable"])
def test_bad_image_input_is_refused_before_training(spark, job, digit_files, case: str) -> None:  # type: ignore[no-untyped-def]
    from pyspark.ml.feature import SQLTransformer

    train = SQLTransformer(statement=job.LABEL_SQL).transform(job.read_images(spark, str(digit_files))[0])
    kwargs: dict[str, Any] = {"model": job.small_cnn, "featuresCol": "content", "numWorkers": 2, "runConfig": FAST}
    if case == "not_callable":
        with pytest.raises(ConfigError, match=r"featuresDecoder must be a per-sample function.*got int"):
            TorchEstimator(featuresDecoder=224, **kwargs)
        return
    if case == "eval_size":
        kwargs.update(featuresDecoder=ImageDecoder(16), evalDecoder=ImageDecoder(24, crop="center"))
    expected = {
        "no_decoder": r"featuresCol='content' holds images \(binary\); set featuresDecoder",
        "eval_size": r"evalDecoder gives arrays of shape \(3, 24, 24\) and featuresDecoder \(3, 16, 16\)",
    }[case]
    with pytest.raises(ConfigError, match=expected):
        TorchEstimator(**kwargs).fit(train)
