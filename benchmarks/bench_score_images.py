"""Scoring images: ``TorchModel.transform`` decoding an image column on one thread per task
against as many threads as the machine has cores.

The case it is for: GPU executors, where the GPUs, not the cores, bound how many tasks run at once
(``spark.executor.cores=8`` with one GPU per executor and per task runs one task and leaves seven
cores to it), so decoding on one thread starves the GPU. Here, with no GPU, ``local[1]`` plays
such an executor: one task at a time on a machine of several cores.

``--images`` real photos (300-427 x 350-640 pixels, ~53 KiB JPEGs, as in bench_images.py) are read
by Spark's ``binaryFile`` source and cached; a small CNN (an 4x4 average pool, two strided
convolutions and a linear layer: the GPU's part on a GPU executor; here the decode, not the model,
is the work) scores them at 224 px with ``ImageDecoder(224,
crop="center")``, once with ``spark.sparkdl.ml.decodeThreads=1`` (each task decoding on one thread,
as before the setting) and once with the machine's cores, alternating, ``--runs`` times each after a
warm-up, forced with the ``noop`` writer. Both must give the same predictions. Prints each way's
median images/s and the ratio, and beside them the decode alone (the same decoder over the same
photos in this process, ``--batch`` at a time, on 1 and on all threads): the ceiling of each way
where nothing else shared the cores (here Spark's hand-over and the model share them).

    .venv/bin/python benchmarks/bench_score_images.py [--images 2000] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def small_cnn() -> object:
    import torch.nn as nn

    return nn.Sequential(
        nn.AvgPool2d(4), nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256, help="inferenceBatchSize")
    args = parser.parse_args()
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the executors' Python: this venv's
    sys.path.insert(0, str(ROOT / "tests" / "resources"))
    import torch
    from photos import photos
    from pyspark.sql import SparkSession

    import sparkdl
    from sparkdl._internal.ml.decoding import decode_values

    cores = len(os.sched_getaffinity(0))
    torch.manual_seed(0)
    model = sparkdl.TorchModel(model=small_cnn(), featuresCol="content", task="classification",
                               featuresDecoder=sparkdl.ImageDecoder(224, crop="center"),
                               inferenceBatchSize=args.batch)
    spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
             .config("spark.driver.memory", "2g").getOrCreate())
    with tempfile.TemporaryDirectory(prefix="bench-score-images-") as tmp:
        for i, data in enumerate(photos(args.images)):
            (Path(tmp) / f"img_{i:05d}.jpg").write_bytes(data)
        files = spark.read.format("binaryFile").load(tmp).select("path", "content").coalesce(1).cache()
        files.count()

        def score(threads: int) -> float:
            spark.conf.set("spark.sparkdl.ml.decodeThreads", str(threads))
            started = time.perf_counter()
            model.transform(files).write.format("noop").mode("overwrite").save()
            return args.images / (time.perf_counter() - started)

        ways = {"1 thread per task": 1, f"{cores} threads per task": cores}
        predictions = {}
        for name, threads in ways.items():  # warm-up: the model reaches the worker; same predictions
            spark.conf.set("spark.sparkdl.ml.decodeThreads", str(threads))
            predictions[name] = [r["prediction"] for r in model.transform(files).orderBy("path").collect()]
        assert len(set(map(tuple, predictions.values()))) == 1, "the ways disagree"
        rates: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.runs):
            for name, threads in ways.items():
                rates[name].append(score(threads))
        alone = {}
        data = photos(args.images)
        for name, threads in ways.items():
            started = time.perf_counter()
            for start in range(0, len(data), args.batch):
                decode_values(model.getFeaturesDecoder(), data[start : start + args.batch], "content", threads=threads)
            alone[name] = len(data) / (time.perf_counter() - started)
    spark.stop()
    medians = {name: statistics.median(r) for name, r in rates.items()}
    for name, rate in medians.items():
        print(f"{name:>24}: {rate:8.0f} images/s  (runs: {', '.join(f'{r:.0f}' for r in rates[name])}); "
              f"decoding alone {alone[name]:.0f} images/s")
    one, many = medians.values()
    print(f"TorchModel.transform, local[1] on {cores} cores, {args.images} photos at 224 px: "
          f"{many / one:.2f}x with {cores} decode threads against 1")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
