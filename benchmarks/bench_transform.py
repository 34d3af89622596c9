"""Scoring throughput: ``TorchModel.transform`` against torch itself and Spark's ``predict_batch_udf``.

Three ways score the same model on the same ``--rows`` rows of 64 float features, in one run:

- **torch alone**, the ceiling: the model over the rows as one in-memory tensor in this process,
  ``--batch`` rows per call, with as many torch threads as Spark has task slots (the same cores);
- **TorchModel.transform**, sparkdl's way;
- **predict_batch_udf**, Spark's own (``pyspark.ml.functions``): its ``make_predict_fn`` builds the
  model once per Python worker and caches it, the way Spark's docs recommend; for a vector column
  it reads ``vector_to_array(features)``, since it takes arrays only.

A fourth line, **Spark's hand-over alone**, is an Arrow UDF over the same column that returns zeros
without running anything: what Spark's JVM costs to write each row's array into Arrow, send it to
a Python worker and take a column back. Every Python UDF pays it on the same cores as its model,
so ``rows / (hand-over time + torch alone's time)`` is the most any of them can reach on a
machine whose cores the model already fills; the last line sets transform against that bound.

Spark's ways are timed on a cached DataFrame, forced with the ``noop`` writer (every column
computed, nothing written), alternating, after a warm-up of each; torch alone is timed between
them. Each prints its median rows/s; then the ratios against the targets (transform >= 0.8x of
torch alone and >= 1.5x predict_batch_udf). Before timing, all three score the same 4,000 rows and
must agree: the same class for a classifier, the same floats (to 1e-5) for a regression.

The workloads of issue 20:

    .venv/bin/python benchmarks/bench_transform.py                       # array<float>, classifier
    .venv/bin/python benchmarks/bench_transform.py --features vector     # Spark ML vectors
    .venv/bin/python benchmarks/bench_transform.py --task regression     # an array output (8 floats)

Options: ``--rows 1000000 --runs 3 --batch 1024 --master local[2]``; ``--row-udf`` adds the old
baseline, one row at a time in a plain Python UDF (slow: ~70k rows/s).
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
HIDDEN = 256
CLASSES = 10
REG_OUTPUTS = 8
CHECK_ROWS = 4000


def make_model(task: str) -> Any:
    import torch

    torch.manual_seed(0)
    out = CLASSES if task == "classification" else REG_OUTPUTS
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, out),
    ).eval()


def predict_fn_maker(net: Any, task: str) -> Any:
    """Spark's recommended shape: a factory that builds the predict function once per worker."""

    def make_predict_fn() -> Any:
        import numpy as np
        import torch

        model = net.eval()

        def predict(x: np.ndarray) -> np.ndarray:
            with torch.inference_mode():
                out = model(torch.from_numpy(x))
            if task == "classification":
                return out.argmax(dim=1).to(torch.float64).numpy()
            return out.numpy()

        return predict

    return make_predict_fn


def torch_alone(net: Any, x: Any, batch: int, task: str) -> Any:
    """The model over an in-memory tensor, ``batch`` rows per call: what the hardware allows."""
    import torch

    outs = []
    with torch.inference_mode():
        for start in range(0, len(x), batch):
            out = net(x[start : start + batch])
            outs.append(out.argmax(dim=1).to(torch.float64) if task == "classification" else out)
    return torch.cat(outs)


def row_at_a_time_udf(model: Any) -> Any:
    """The old baseline: a plain Python UDF that scores one row per call."""
    import torch
    from pyspark.sql.functions import udf

    # No type hints: pyspark reads a plain udf's hints to look for an Arrow-optimized kind.
    def score_one(features):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            return float(
                model(torch.tensor(features, dtype=torch.float32).unsqueeze(0)).argmax(dim=1).item()
            )

    return udf(score_one, "double")


def handover_udf(width: int | None) -> Any:
    """An iterator UDF that takes the features in and gives zeros back: Spark's cost alone.

    ``width`` None: one double per row (a classifier's column); else ``width`` floats per row,
    the shape a regression's prediction column has, so that the way back costs what it costs
    the scorers.
    """
    from collections.abc import Iterator

    import numpy as np
    import pyarrow as pa
    from pyspark.sql import functions as F

    out_type = "double" if width is None else "array<float>"

    def zeros(batches: Any) -> Any:
        for batch in batches:
            n = len(batch)
            if width is None:
                yield pa.array(np.zeros(n))
            else:
                offsets = pa.array(np.arange(n + 1, dtype=np.int32) * width)
                yield pa.ListArray.from_arrays(offsets, pa.array(np.zeros(n * width, np.float32)))

    if hasattr(F, "arrow_udf"):
        zeros.__annotations__ = {"batches": Iterator[pa.Array], "return": Iterator[pa.Array]}
        return F.arrow_udf(zeros, out_type)
    import pandas as pd

    def zeros_pandas(batches: Any) -> Any:
        for out in zeros(pa.array(s) for s in batches):
            yield out.to_pandas()

    zeros_pandas.__annotations__ = {"batches": Iterator[pd.Series], "return": Iterator[pd.Series]}
    return F.pandas_udf(zeros_pandas, out_type)


def _timed(action: Any) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _as_arrow(df: Any) -> Any:
    """The DataFrame's rows as one Arrow table (``toArrow`` on pyspark 4, its private twin on 3.5)."""
    return (
        df.toArrow()
        if hasattr(df, "toArrow")
        else __import__("pyarrow").Table.from_batches(df._collect_as_arrow())
    )


def _features_tensor(table: Any, column: str) -> Any:
    import torch

    values = table.column(column).combine_chunks().flatten().to_numpy()
    return torch.from_numpy(values.reshape(table.num_rows, FEATURES).copy())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rows", type=int, default=1_000_000, help="rows to score (default 1000000)"
    )
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each way (default 3)")
    parser.add_argument(
        "--batch", type=int, default=1024, help="rows per model call, all three ways (default 1024)"
    )
    parser.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    parser.add_argument(
        "--partitions", type=int, default=None, help="partitions (default: one per task slot)"
    )
    parser.add_argument(
        "--features", choices=("array", "vector"), default="array", help="features column type"
    )
    parser.add_argument(
        "--task", choices=("classification", "regression"), default="classification"
    )
    parser.add_argument(
        "--row-udf", action="store_true", help="also time one row at a time in a plain Python UDF"
    )
    args = parser.parse_args()

    import numpy as np
    import torch
    from pyspark.ml.functions import array_to_vector, predict_batch_udf, vector_to_array
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    import sparkdl

    spark = (
        SparkSession.builder.master(args.master)
        .appName("sparkdl-bench-transform")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.python.worker.reuse", "true")
        .config("spark.driver.memory", "4g")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    slots = spark.sparkContext.defaultParallelism
    partitions = args.partitions or slots

    def features_df(rows: int) -> Any:
        # Generated in the JVM and cached, so that no timing includes making the data.
        arr = F.array(*[F.rand(seed=i).cast("float") for i in range(FEATURES)])
        col = array_to_vector(arr) if args.features == "vector" else arr
        df = spark.range(0, rows, 1, partitions).select("id", col.alias("features")).cache()
        df.count()
        return df

    net = make_model(args.task)
    model = sparkdl.TorchModel(
        model=net, featuresCol="features", task=args.task, inferenceBatchSize=args.batch
    )
    classification = args.task == "classification"
    out_type = T.DoubleType() if classification else T.ArrayType(T.FloatType())
    pbu = predict_batch_udf(
        predict_fn_maker(net, args.task),
        return_type=out_type,
        batch_size=args.batch,
        input_tensor_shapes=[[FEATURES]],
    )
    pbu_input = (
        vector_to_array(F.col("features"), "float32")
        if args.features == "vector"
        else F.col("features")
    )
    data = features_df(args.rows)
    warm = features_df(4 * partitions * 100)
    as_array = (
        vector_to_array(F.col("features"), "float32")
        if args.features == "vector"
        else F.col("features")
    )
    table = _as_arrow(data.select("id", as_array.alias("features")).orderBy("id"))
    x = _features_tensor(table, "features")
    del table

    def transform(df: Any) -> None:
        model.transform(df).write.format("noop").mode("overwrite").save()

    def batch_udf(df: Any) -> None:
        df.withColumn("prediction", pbu(pbu_input)).write.format("noop").mode("overwrite").save()

    zeros = handover_udf(None if classification else REG_OUTPUTS)

    def handover(df: Any) -> None:
        df.withColumn("prediction", zeros(pbu_input)).write.format("noop").mode("overwrite").save()

    ways: dict[str, Any] = {
        "transform": transform,
        "predict_batch_udf": batch_udf,
        "Spark's hand-over alone": handover,
    }
    if args.row_udf:
        if not classification:
            raise SystemExit("--row-udf scores a classifier only")
        row_udf = row_at_a_time_udf(net)

        def row_by_row(df: Any) -> None:
            df.withColumn("prediction", row_udf("features")).write.format("noop").mode(
                "overwrite"
            ).save()

        ways["row-at-a-time UDF"] = row_by_row

    # The same rows scored all three ways must agree before anything is timed.
    sample = data.filter(F.col("id") < CHECK_ROWS)
    ours = model.transform(sample).select("id", "prediction").toPandas().sort_values("id")
    theirs = sample.select("id", pbu(pbu_input).alias("p")).toPandas().sort_values("id")
    torch.set_num_threads(slots)
    ceiling = torch_alone(net, x[:CHECK_ROWS], args.batch, args.task).numpy()
    ours_v, theirs_v = np.stack(ours["prediction"].to_numpy()), np.stack(theirs["p"].to_numpy())
    if classification:
        same = np.array_equal(ours_v, ceiling) and np.array_equal(theirs_v, ceiling)
    else:
        same = np.allclose(ours_v, ceiling, rtol=1e-5, atol=1e-6) and np.allclose(
            theirs_v, ceiling, rtol=1e-5, atol=1e-6
        )
    if not same:
        raise SystemExit("the three ways disagree on the check rows")
    print(f"all three agree on the first {CHECK_ROWS} rows", flush=True)

    print("warming up ...", flush=True)
    for way in ways.values():
        way(warm)
    times: dict[str, list[float]] = {"torch alone": [], **{name: [] for name in ways}}
    for i in range(args.runs):
        for name, way in ways.items():
            times[name].append(_timed(lambda way=way: way(data)))
            if name == "transform":
                times["torch alone"].append(
                    _timed(lambda: torch_alone(net, x, args.batch, args.task))
                )
        print(f"run {i}: " + ", ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items()), flush=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    print()
    out = f"argmax of {CLASSES}" if classification else f"{REG_OUTPUTS} floats"
    print(
        f"{args.rows} rows x {FEATURES} features ({args.features}), MLP {FEATURES}-{HIDDEN}-{HIDDEN} -> {out}, "
        f"batch {args.batch}, master {args.master}, {partitions} partitions, torch alone on {slots} threads"
    )
    for name, m in med.items():
        print(f"{name:<24}{args.rows / m:12,.0f} rows/s  (median {m:.2f} s)")
    print(
        f"transform / torch alone       {med['torch alone'] / med['transform']:6.2f}x  (target >= 0.8x)"
    )
    print(
        f"transform / predict_batch_udf {med['predict_batch_udf'] / med['transform']:6.2f}x  (target >= 1.5x)"
    )
    bound = med["torch alone"] + med["Spark's hand-over alone"]
    print(
        f"transform / (hand-over + torch alone) {bound / med['transform']:6.2f}x  (1.0: nothing left but Spark's cost and the model's)"
    )
    if args.row_udf:
        print(f"transform / row-at-a-time UDF {med['row-at-a-time UDF'] / med['transform']:6.1f}x")
    spark.stop()


if __name__ == "__main__":
    main()
