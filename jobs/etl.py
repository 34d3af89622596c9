"""ETL job: scikit-learn's digits (real data that ships with the package) into a sparkdl dataset.

Spark scales the 8x8 pixels to [0, 1], splits the rows into training and test sets with a seed,
writes the training rows with ``sparkdl.write_dataset`` (Parquet plus the manifest the loader
plans from) and the test rows as a plain Parquet table for evaluation and batch inference.

    python jobs/etl.py                                       # embedded local Spark
    spark-submit --master spark://host:7077 jobs/etl.py --data hdfs:///sparkdl/digits
    python jobs/etl.py --help
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import _common

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

EPILOG = """\
outputs:
  DATA/train   the training rows as a sparkdl dataset (columns id, features, label)
  DATA/test    the held-out rows as a Parquet table (same columns)

examples:
  python jobs/etl.py --data /tmp/digits
  spark-submit --master spark://127.0.0.1:7077 jobs/etl.py --data /shared/digits
"""


def parse_args(argv: Sequence[str] | None = None) -> Any:
    p = _common.job_parser("etl", "Writes scikit-learn's digits as a sparkdl dataset (training rows) and a Parquet table (test rows).", EPILOG)
    p.add_argument("--data", required=False, default=None,
                   help=f"output directory or URL, shared by driver and executors {_common.private_help('data')}")
    p.add_argument("--test-fraction", type=float, default=0.2, help="rows held out for testing (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split (default: %(default)s)")
    p.add_argument("--num-files", type=int, default=None, help="Parquet files of the dataset (default: Spark's parallelism)")
    p.add_argument("--overwrite", action=argparse.BooleanOptionalAction, default=False, help="replace what DATA holds (default: %(default)s)")
    args = _common.parse_job_args(p, "etl", argv)
    if not 0.0 < args.test_fraction < 1.0:
        p.error(f"--test-fraction must be in (0, 1); got {args.test_fraction}")
    _common.fill_private_defaults(args, "data")
    return args


def digits_frame(spark: SparkSession) -> DataFrame:
    """The 1,797 digits as ``id long, features array<float>, label int``, pixels scaled by Spark."""
    import pandas as pd
    from pyspark.sql import functions as F
    from sklearn.datasets import load_digits

    digits = load_digits()
    raw = pd.DataFrame(
        {
            "id": range(len(digits.target)),
            "pixels": [row.astype("int32").tolist() for row in digits.data],
            "label": digits.target.astype("int32"),
        }
    )
    df = spark.createDataFrame(raw, "id long, pixels array<int>, label int")
    # Pixels are 0..16 in this dataset; the network trains best on [0, 1].
    features = F.transform("pixels", lambda v: (v / F.lit(16.0)).cast("float"))
    return df.select("id", features.alias("features"), "label")


def run_etl(spark: SparkSession, data: str, *, test_fraction: float, seed: int, num_files: int | None, overwrite: bool) -> dict[str, Any]:
    """Writes DATA/train (a sparkdl dataset) and DATA/test (Parquet); returns what it wrote."""
    import sparkdl

    data = _common.absolute(data).rstrip("/")
    train_df, test_df = digits_frame(spark).randomSplit([1.0 - test_fraction, test_fraction], seed=seed)
    started = time.perf_counter()
    ds = sparkdl.write_dataset(train_df, f"{data}/train", overwrite=overwrite, num_files=num_files)
    test_df.write.mode("overwrite" if overwrite else "errorifexists").parquet(f"{data}/test")
    test_rows = spark.read.parquet(f"{data}/test").count()
    seconds = time.perf_counter() - started
    print(f"ETL: {ds.num_rows} training rows -> {ds.url} ({len(ds.files)} files), "
          f"{test_rows} test rows -> {data}/test, in {seconds:.1f} s")
    return {"train": ds.url, "train_rows": ds.num_rows, "test": f"{data}/test", "test_rows": test_rows}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    spark = _common.session(args, "sparkdl-etl-digits")
    try:
        run_etl(spark, args.data, test_fraction=args.test_fraction, seed=args.seed,
                num_files=args.num_files, overwrite=args.overwrite)
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
