"""Distributed training job: ETL of a real dataset into Parquet with Spark, then DDP training on N
gang-scheduled Spark workers with sparkdl, then evaluation of the returned model on held-out rows.

The data is scikit-learn's digits (1,797 8x8 images of 10 classes), which ships with the package.

    python jobs/train.py                                 # embedded local Spark, 2 workers
    spark-submit --master spark://host:7077 jobs/train.py --num-workers 4
    python jobs/train.py --help
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train an MLP on the digits dataset with sparkdl (ETL to Parquet, DDP on N Spark workers).",
    )
    p.add_argument("--master", default=None, help="Spark master when not run by spark-submit (default local[N])")
    p.add_argument("--num-workers", type=int, default=2, help="ranks, one Spark task slot each (default 2)")
    p.add_argument("--epochs", type=int, default=8, help="passes over the training rows (default 8)")
    p.add_argument("--batch-size", type=int, default=32, help="rows per batch and rank (default 32)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split, the model and the shuffle")
    p.add_argument("--out", default=None, help="run directory for the dataset and the model (default: a temp dir)")
    p.add_argument("--min-accuracy", type=float, default=0.9, help="fail (exit 1) below this held-out accuracy")
    return p.parse_args(argv)


def make_model() -> Any:
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
    )


def train(ds: Any, epochs: int, batch_size: int, lr: float, seed: int) -> dict[str, Any]:
    """Runs on every rank: DDP over this rank's shard of the Parquet dataset."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sparkdl

    ctx = sparkdl.context()
    torch.manual_seed(seed)
    model = DDP(make_model().to(ctx.device))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loader = ds.loader(batch_size, seed=seed, columns=["features", "label"], drop_last=True)
    losses = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        total = torch.zeros(2)
        for batch in loader:
            x = batch["features"].to(ctx.device)
            y = batch["label"].long().to(ctx.device)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item() * len(y), len(y)])
        dist.all_reduce(total)
        mean = (total[0] / total[1]).item()
        losses.append(mean)
        if ctx.rank == 0:
            print(f"epoch {epoch}: loss {mean:.4f} over {int(total[1])} rows, {len(loader)} steps per rank")
    return {"state_dict": model.module.state_dict(), "losses": losses}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import numpy as np
    import torch
    from pyspark import SparkConf
    from pyspark.sql import SparkSession
    from sklearn.datasets import load_digits

    import sparkdl

    builder = SparkSession.builder.appName("sparkdl-train-digits")
    if not SparkConf().contains("spark.master"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = (
            builder.master(args.master or f"local[{args.num_workers}]")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.driver.host", os.environ["SPARK_LOCAL_IP"])
            .config("spark.driver.bindAddress", os.environ["SPARK_LOCAL_IP"])
        )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    out = Path(args.out or tempfile.mkdtemp(prefix="sparkdl-train-"))

    digits = load_digits()
    rows = [
        (i, [float(v) / 16.0 for v in x], int(y))
        for i, (x, y) in enumerate(zip(digits.data, digits.target, strict=True))
    ]
    df = spark.createDataFrame(rows, "id long, features array<float>, label int")
    train_df, test_df = df.randomSplit([0.8, 0.2], seed=args.seed)
    started = time.perf_counter()
    ds = sparkdl.write_dataset(train_df, str(out / "digits-train"), overwrite=True)
    print(f"ETL: {ds.num_rows} training rows written to {ds.url} in {time.perf_counter() - started:.1f} s")

    started = time.perf_counter()
    result = sparkdl.run(
        train, ds, args.epochs, args.batch_size, args.lr, args.seed, num_workers=args.num_workers
    )
    print(f"training: {args.epochs} epochs on {args.num_workers} workers in {time.perf_counter() - started:.1f} s")

    model = make_model()
    model.load_state_dict(result["state_dict"])
    test = test_df.toPandas()
    x = torch.tensor(np.stack(test["features"].to_numpy()), dtype=torch.float32)
    with torch.no_grad():
        predicted = model(x).argmax(dim=1).numpy()
    accuracy = float((predicted == test["label"].to_numpy()).mean())
    torch.save(result["state_dict"], out / "model.pt")
    summary = {"accuracy": accuracy, "test_rows": len(test), "losses": result["losses"], "model": str(out / "model.pt")}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"held-out accuracy {accuracy:.4f} on {len(test)} rows; model saved to {out / 'model.pt'}")
    spark.stop()
    if accuracy < args.min_accuracy:
        print(f"accuracy {accuracy:.4f} is below --min-accuracy {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
