"""Image job: image files read by Spark's ``binaryFile`` source, a small CNN trained on N
gang-scheduled Spark workers with random crops, and the fitted Spark ML Pipeline scoring held-out
images (decoded on the executors), then saved.

The images are scikit-learn's handwritten digits (1,797 real 8x8 scans of 10 classes, shipped
with the package), written once as PNG files in one folder per class; the label is read from the
path by the pipeline's first stage. Point ``--images`` at any folder of ``<class index>/<file>``
images (JPEG, PNG, ...) to train on those instead.

    python jobs/images.py                                # embedded local Spark, 2 workers
    spark-submit --master spark://host:7077 jobs/images.py --images hdfs:///digit-images --pipeline hdfs:///models/cnn
    python jobs/images.py --help
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import _common

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

EPILOG = """\
inputs:
  IMAGES/<class>/<file>   image files, the class index as the folder's name (written from
                          scikit-learn's digits when IMAGES is a local path without images)
outputs:
  PIPELINE                the fitted Spark ML PipelineModel (PipelineModel.load(PIPELINE)): the label
                          stage and the trained sparkdl.TorchModel, which decodes images itself
  PIPELINE/summary.json   held-out accuracy, per-epoch history, timings (local paths only)

Every fifth image (by the number in its file name) is held out from training.
exit status: 0, or 1 when the held-out accuracy is below --min-accuracy.
"""
# The label: the name of the image's folder, as a class index.
LABEL_SQL = "SELECT *, CAST(element_at(split(path, '/'), -2) AS INT) AS label FROM __THIS__"


def parse_args(argv: Sequence[str] | None = None) -> Any:
    p = _common.job_parser("images", "Trains a small CNN on image files with sparkdl's TorchEstimator "
                                     "(DDP on N Spark workers) in a Spark ML Pipeline.", EPILOG)
    p.add_argument("--images", default=None, help=f"folder of <class>/<image> files {_common.private_help('images')}")
    p.add_argument("--pipeline", default=None,
                   help=f"where to save the fitted pipeline (directory or URL) {_common.private_help('pipeline')}")
    p.add_argument("--epochs", type=int, default=5, help="passes over the training images (default: %(default)s)")
    p.add_argument("--image-size", type=int, default=16, help="side of the crops the CNN sees (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, the shuffle and the crops (default: %(default)s)")
    p.add_argument("--min-accuracy", type=float, default=0.85, help="exit 1 below this held-out accuracy (default: %(default)s)")
    args = _common.parse_job_args(p, "images", argv)
    _common.fill_private_defaults(args, "images", "pipeline")
    return args


def small_cnn() -> Any:
    """Two convolution blocks and a linear classifier (any image size of at least 8 pixels)."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
    )


def write_digit_images(root: Path) -> int:
    """scikit-learn's digits as PNG files ``root/<label>/<index>.png``; returns how many."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i, (image, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        folder = root / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((image * 255 / 16).astype(np.uint8), mode="L").save(folder / f"{i:04d}.png")
    return len(digits.target)


def read_images(spark: SparkSession, images: str) -> tuple[DataFrame, DataFrame]:
    """The image files as (train, held-out) DataFrames of ``binaryFile`` rows plus ``id``."""
    from pyspark.sql import functions as F

    df = spark.read.format("binaryFile").option("recursiveFileLookup", "true").load(images)
    # Spark counts each file as at least 4 MiB (spark.sql.files.openCostInBytes) when it splits a
    # scan: small images become a task per few dozen files. One partition per core is enough.
    df = df.coalesce(spark.sparkContext.defaultParallelism)
    df = df.withColumn("id", F.regexp_extract("path", r"(\d+)\.[A-Za-z]+$", 1).cast("int"))
    return df.where(F.col("id") % 5 != 0), df.where(F.col("id") % 5 == 0)


def fit_and_score(spark: SparkSession, images: str, pipeline_dir: str, *, epochs: int, image_size: int,
                  num_workers: int, seed: int, run_config: Any = None) -> dict[str, Any]:
    """Fits the pipeline on the training images, saves it, scores the held-out ones."""
    import cloudpickle
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import SQLTransformer
    from pyspark.sql import functions as F

    import sparkdl

    # The model factory travels to the ranks by value, also when this file is imported as a module
    # (the executors need not have it).
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    train, test = read_images(spark, images)
    estimator = sparkdl.TorchEstimator(
        model=small_cnn, featuresCol="content", labelCol="label", numWorkers=num_workers, epochs=epochs,
        batchSize=32, learningRate=0.01, validationFraction=0.1, seed=seed, runConfig=run_config,
        # Random crops of 60-100% of each image, at 4:5 to 5:4, resized; no flips (digits are not symmetric).
        featuresDecoder=sparkdl.ImageDecoder(image_size, scale=(0.6, 1.0), ratio=(0.8, 1.25), flip=False),
    )
    started = time.perf_counter()
    model = Pipeline(stages=[SQLTransformer(statement=LABEL_SQL), estimator]).fit(train)
    fit_s = time.perf_counter() - started
    model.write().overwrite().save(pipeline_dir)
    scored = model.transform(test)
    row = scored.agg(F.avg((F.col("prediction") == F.col("label")).cast("double")).alias("acc"),
                     F.count("*").alias("n")).first()
    return {
        "accuracy": float(row["acc"]),
        "test_images": int(row["n"]),
        "history": model.stages[-1].history,
        "fit_seconds": round(fit_s, 2),
        "pipeline": pipeline_dir,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    images = _common.absolute(args.images).rstrip("/")
    pipeline_dir = _common.absolute(args.pipeline).rstrip("/")
    local = "://" not in images or images.startswith("file://")
    if local and not any(Path(images.removeprefix("file://")).glob("*/*")):
        n = write_digit_images(Path(images.removeprefix("file://")))
        print(f"no images in {images}: wrote scikit-learn's {n} digits there as PNG files")
    spark = _common.session(args, "sparkdl-images")
    try:
        summary = fit_and_score(spark, images, pipeline_dir, epochs=args.epochs, image_size=args.image_size,
                                num_workers=args.num_workers, seed=args.seed)
    finally:
        spark.stop()
    for record in summary["history"]:
        print(f"epoch {record['epoch']}: train loss {record['train_loss']:.4f}, "
              f"validation accuracy {record.get('val_accuracy', float('nan')):.4f}")
    if local:
        Path(pipeline_dir, "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"held-out accuracy {summary['accuracy']:.4f} on {summary['test_images']} images "
          f"(fit in {summary['fit_seconds']:.1f} s); pipeline saved to {pipeline_dir}")
    if summary["accuracy"] < args.min_accuracy:
        print(f"accuracy {summary['accuracy']:.4f} is below --min-accuracy {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
