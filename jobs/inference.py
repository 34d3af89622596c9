"""Batch inference job: scores a table with a saved ``sparkdl.TorchModel`` and writes Parquet.

The executors score the rows: the model travels once as a Spark broadcast and runs on whole Arrow
batches (``--batch-size`` rows per call), on the task's GPU when Spark assigns one. Every input
column is kept and a prediction column is added.

    python jobs/inference.py                                    # the defaults: DATA/test with MODEL
    spark-submit --master spark://host:7077 jobs/inference.py --model hdfs:///models/digits \\
        --input hdfs:///digits/test --output hdfs:///predictions/digits
    python jobs/inference.py --table events --features-col pixels --output /tmp/scored
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import _common

EPILOG = """\
input:   --input PATH (a Parquet table), else --table NAME (a table of the session's catalog),
         else DATA/test (the ETL job's test rows)
output:  --output DIR, Parquet: the input columns plus PREDICTION_COL

When the input has a label column (--label-col, default label), the job also prints the accuracy.
Loading MODEL runs code from its files: a local MODEL that another user owns or that others may
write to is refused; --conf spark.sparkdl.ml.trustSavedModels=true loads it anyway.
"""


def parse_args(argv: Sequence[str] | None = None) -> Any:
    p = _common.job_parser("inference", "Scores a table with a saved sparkdl.TorchModel; writes Parquet.", EPILOG)
    p.add_argument("--model", default=None, help=f"the saved model (jobs/train.py's --model) {_common.private_help('model')}")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--input", default=None, help="Parquet table to score")
    source.add_argument("--table", default=None, help="catalog table to score")
    p.add_argument("--data", default=None,
                   help=f"with neither --input nor --table, score DATA/test {_common.private_help('data')}")
    p.add_argument("--output", default=None,
                   help=f"where to write the scored rows (Parquet) {_common.private_help('output')}")
    p.add_argument("--features-col", default="features", help="the features column (default: %(default)s)")
    p.add_argument("--prediction-col", default="prediction", help="the column to add (default: %(default)s)")
    p.add_argument("--label-col", default="label", help="print the accuracy when this column exists (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=1024, help="rows per model call (default: %(default)s)")
    p.add_argument("--mode", choices=("overwrite", "errorifexists"), default="overwrite",
                   help="when OUTPUT exists (default: %(default)s)")
    args = _common.parse_job_args(p, "inference", argv)
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1; got {args.batch_size}")
    # DATA only matters without --input and --table: its default is not resolved otherwise.
    _common.fill_private_defaults(args, "model", "output", *(() if args.input or args.table else ("data",)))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from pyspark.sql import functions as F

    import sparkdl

    spark = _common.session(args, "sparkdl-inference")
    try:
        model = sparkdl.TorchModel.load(_common.absolute(args.model))
        model.setFeaturesCol(args.features_col).setPredictionCol(args.prediction_col)
        model.setInferenceBatchSize(args.batch_size)
        if args.table:
            df, source = spark.table(args.table), f"table {args.table}"
        else:
            path = _common.absolute(args.input or f"{args.data.rstrip('/')}/test")
            df, source = spark.read.parquet(path), path
        output = _common.absolute(args.output)
        started = time.perf_counter()
        model.transform(df).write.mode(args.mode).parquet(output)
        scored = spark.read.parquet(output)
        rows = scored.count()
        print(f"inference: {rows} rows of {source} scored -> {output} in {time.perf_counter() - started:.1f} s")
        if args.label_col in scored.columns:
            acc = scored.agg(F.avg((F.col(args.prediction_col) == F.col(args.label_col)).cast("double"))).first()[0]
            print(f"accuracy {acc:.4f} against column {args.label_col!r}")
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
