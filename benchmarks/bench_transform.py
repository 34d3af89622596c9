"""Scoring throughput: ``TorchModel.transform`` against one row at a time in a plain Python UDF.

Both score the same model (an MLP classifier, 64 -> 128 -> 10) on the same cached DataFrame of
``--rows`` rows of 64 float features, on the same local Spark session, in the same run,
alternating, after one warm-up of each (so Python workers are started and torch is imported).
The baseline is how horovod.spark's ``transform`` scores: a ``pyspark.sql.functions.udf`` that
turns one row into a tensor and calls the model on it; its model travels in the UDF's closure, so
it too is unpickled once per task, not once per row. Evaluation is forced with the ``noop``
writer, which computes every column and writes nothing. Prints both medians in rows/s and their
ratio (target: transform / baseline >= 10), after checking that both give the same predictions.

A Spark job with a Python UDF stage has a fixed cost (task launch, worker hand-over, Arrow
plumbing) of 0.4 to 0.9 s on a busy 2-core machine, even for 400 rows. At 200k rows that cost is
most of transform's time, so its rows/s grow with ``--rows`` while the baseline's stay flat; the
default of 1M rows measures rows/s where the rows, not the job, dominate.

    .venv/bin/python benchmarks/bench_transform.py [--rows 1000000] [--runs 3] [--master local[2]]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

FEATURES = 64


def make_model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
    ).eval()


def row_at_a_time_udf(model: Any) -> Any:
    """The baseline: a plain Python UDF that scores one row per call."""
    import torch
    from pyspark.sql.functions import udf

    # No type hints here: pyspark reads a plain udf's hints to look for an Arrow-optimized kind,
    # and warns when it finds none; this is the plain, pickled, row-at-a-time UDF on purpose.
    def score_one(features):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            return float(model(torch.tensor(features, dtype=torch.float32).unsqueeze(0)).argmax(dim=1).item())

    return udf(score_one, "double")


def _timed(action: Any) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows to score (default 1000000)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each way (default 3)")
    parser.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    parser.add_argument("--partitions", type=int, default=None, help="partitions (default: one per core)")
    args = parser.parse_args()

    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    import sparkdl

    spark = (
        SparkSession.builder.master(args.master)
        .appName("sparkdl-bench-transform")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.python.worker.reuse", "true")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    partitions = args.partitions or spark.sparkContext.defaultParallelism

    def features_df(rows: int) -> Any:
        # Generated in the JVM and cached, so that neither timing includes making the data.
        df = spark.range(0, rows, 1, partitions).select(
            "id", F.array(*[F.rand(seed=i).cast("float") for i in range(FEATURES)]).alias("features")
        )
        df = df.cache()
        df.count()
        return df

    net = make_model()
    model = sparkdl.TorchModel(model=net, featuresCol="features", task="classification")
    baseline = row_at_a_time_udf(net)
    data = features_df(args.rows)
    warm = features_df(4 * partitions * 100)

    def vectorized(df: Any) -> None:
        model.transform(df).write.format("noop").mode("overwrite").save()

    def row_by_row(df: Any) -> None:
        df.withColumn("prediction", baseline("features")).write.format("noop").mode("overwrite").save()

    sample = data.limit(2000)
    both = model.transform(sample).withColumn("baseline", baseline("features"))
    agree = both.filter(F.col("prediction") == F.col("baseline")).count()
    total = both.count()
    if agree != total:
        raise SystemExit(f"the two ways disagree on {total - agree} of {total} rows")
    print(f"both ways agree on {agree}/{total} sampled rows", flush=True)

    print("warming up both ways ...", flush=True)
    vectorized(warm)
    row_by_row(warm)
    ours, theirs = [], []
    for i in range(args.runs):
        ours.append(_timed(lambda: vectorized(data)))
        theirs.append(_timed(lambda: row_by_row(data)))
        print(f"run {i}: transform {ours[-1]:.2f} s, row-at-a-time UDF {theirs[-1]:.2f} s", flush=True)
    m_ours, m_theirs = statistics.median(ours), statistics.median(theirs)
    print()
    print(
        f"{args.rows} rows x {FEATURES} features, MLP {FEATURES}-128-10, master {args.master}, "
        f"{partitions} partitions"
    )
    print(f"TorchModel.transform (Arrow batches)   {args.rows / m_ours:12,.0f} rows/s  (median {m_ours:.2f} s)")
    print(f"row-at-a-time Python UDF               {args.rows / m_theirs:12,.0f} rows/s  (median {m_theirs:.2f} s)")
    print(f"ratio transform / row-at-a-time        {m_theirs / m_ours:12.1f}x  (target >= 10x)")
    spark.stop()


if __name__ == "__main__":
    main()
