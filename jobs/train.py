"""Training job: DDP on N gang-scheduled Spark workers from a sparkdl dataset, then a held-out
evaluation with distributed inference, and the model saved as a Spark ML ``sparkdl.TorchModel``.

The data is scikit-learn's digits (1,797 8x8 images of 10 classes), which ships with the package.
When DATA holds no dataset yet, this job runs the ETL job (jobs/etl.py) into it first, so that
``python jobs/train.py`` alone goes from nothing to a trained, evaluated and saved model.

    python jobs/train.py                                 # embedded local Spark, 2 workers
    spark-submit --master spark://host:7077 jobs/train.py --data hdfs:///digits --model hdfs:///models/digits
    python jobs/train.py --help
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import _common

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

EPILOG = """\
inputs:
  DATA/train   a sparkdl dataset with columns features (array<float>[64]) and label (jobs/etl.py)
  DATA/test    a Parquet table of held-out rows, same columns
outputs:
  MODEL                 the trained model as a Spark ML model (sparkdl.TorchModel.load(MODEL))
  MODEL/summary.json    accuracy, per-epoch loss, timings (local paths only)
  MODEL/metrics.jsonl   every metric the ranks logged (local paths only)

exit status: 0, or 1 when the held-out accuracy is below --min-accuracy.
"""


def parse_args(argv: Sequence[str] | None = None) -> Any:
    p = _common.job_parser("train", "Trains an MLP on the digits dataset with sparkdl (DDP on N Spark workers).", EPILOG)
    p.add_argument("--data", default=None,
                   help=f"dataset directory written by jobs/etl.py (run first when missing) {_common.private_help('data')}")
    p.add_argument("--model", default=None,
                   help=f"where to save the trained model (directory or URL) {_common.private_help('model')}")
    p.add_argument("--epochs", type=int, default=8, help="passes over the training rows (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="rows per batch and rank (default: %(default)s)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the shuffle (default: %(default)s)")
    p.add_argument("--max-attempts", type=int, default=None, help="runs of the gang allowed (default: Spark's stage retries)")
    p.add_argument("--min-accuracy", type=float, default=0.9, help="exit 1 below this held-out accuracy (default: %(default)s)")
    args = _common.parse_job_args(p, "train", argv)
    _common.fill_private_defaults(args, "data", "model")
    return args


def make_model() -> Any:
    import torch

    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def train(ds: Any, epochs: int, batch_size: int, lr: float, seed: int) -> dict[str, Any]:
    """Runs on every rank: DDP over this rank's shard, resumable, logging its loss every step."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sparkdl

    ctx = sparkdl.context()
    torch.manual_seed(seed)
    model = DDP(make_model().to(ctx.device))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loader = ds.loader(batch_size, seed=seed, columns=["features", "label"], drop_last=True)
    # TrainState checkpoints at the end of every epoch: after a rerun of the gang (a lost
    # executor, a failed rank) training resumes there instead of starting over.
    state = sparkdl.TrainState(model, opt, loader)
    for batch in state.batches(epochs):
        x = batch["features"].to(ctx.device)
        y = batch["label"].long().to(ctx.device)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.log_metrics(
            {"loss": loss.item(), "epoch": loader.epoch, "epoch_step": loader.step, "steps_per_epoch": len(loader)},
            step=state.global_step + 1,
        )
    return {"state_dict": model.module.state_dict(), "steps_per_epoch": len(loader)}


def has_dataset(data: str) -> bool:
    import sparkdl

    try:
        sparkdl.Dataset(f"{data}/train")
    except sparkdl.SparkDLError:
        return False
    return True


def evaluate(spark: SparkSession, model: Any, test_path: str) -> tuple[float, int]:
    """Accuracy on the test table, scored by the executors (the model's batched Arrow UDF)."""
    from pyspark.sql import functions as F

    scored = model.transform(spark.read.parquet(test_path))
    row = scored.agg(F.avg((F.col("prediction") == F.col("label")).cast("double")).alias("acc"), F.count("*").alias("n")).first()
    return float(row["acc"]), int(row["n"])


def write_text(url: str, text: str) -> None:
    """A small file next to the model, on a local path (a URL's model directory is left alone)."""
    from pathlib import Path

    if "://" not in url or url.startswith("file://"):
        path = Path(url.removeprefix("file://"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import sparkdl

    data = _common.absolute(args.data).rstrip("/")
    model_dir = _common.absolute(args.model).rstrip("/")
    spark = _common.session(args, "sparkdl-train-digits")
    try:
        if not has_dataset(data):
            import etl

            print(f"no dataset at {data}/train: running the ETL job (jobs/etl.py) first")
            etl.run_etl(spark, data, test_fraction=0.2, seed=args.seed, num_files=None, overwrite=True)
        ds = sparkdl.Dataset(f"{data}/train")

        started = time.perf_counter()
        result = sparkdl.launch(
            train, ds, args.epochs, args.batch_size, args.lr, args.seed,
            num_workers=args.num_workers, max_attempts=args.max_attempts, spark=spark,
        )
        train_s = time.perf_counter() - started
        metrics = result.metrics
        per_epoch = metrics.groupby("epoch")["loss"].mean()
        for epoch, loss in per_epoch.items():
            print(f"epoch {int(epoch)}: mean loss {loss:.4f} over {args.num_workers} ranks")
        print(f"training: {args.epochs} epochs on {args.num_workers} workers in {train_s:.1f} s "
              f"({result.attempts} attempt(s)); metrics in {result.metrics_path}")

        module = make_model()
        module.load_state_dict(result.value["state_dict"])
        model = sparkdl.TorchModel(model=module, featuresCol="features", task="classification")
        model.write().overwrite().save(model_dir)
        accuracy, rows = evaluate(spark, model, f"{data}/test")
    finally:
        spark.stop()

    summary = {
        "accuracy": accuracy,
        "test_rows": rows,
        "epochs": args.epochs,
        "num_workers": args.num_workers,
        "attempts": result.attempts,
        "epoch_loss": [float(v) for v in per_epoch.to_numpy()],
        "train_seconds": round(train_s, 2),
        "model": model_dir,
    }
    write_text(f"{model_dir}/summary.json", json.dumps(summary, indent=2))
    if result.metrics_path:
        from pathlib import Path

        write_text(f"{model_dir}/metrics.jsonl", Path(result.metrics_path).read_text())
    print(f"held-out accuracy {accuracy:.4f} on {rows} rows; model saved to {model_dir}")
    if accuracy < args.min_accuracy:
        print(f"accuracy {accuracy:.4f} is below --min-accuracy {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
