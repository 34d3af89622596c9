"""Tuning job: a learning-rate and momentum search for the digits MLP with ``sparkdl.tune``, its
trials gangs of N ranks (DDP), several at once, the worse ones pruned by Optuna's median pruner.

Each trial trains on DATA/train, measures the held-out error on DATA/test (every rank its shard,
summed with an allreduce) after every epoch and reports it; a checkpoint after every epoch lets a
failed trial rerun from there. The study is a journal file in STUDY, so running the job again
after its driver died finishes the same search (finished trials kept, running ones resumed).
When DATA holds no dataset yet, the ETL job (jobs/etl.py) runs first.

    python jobs/tune.py                                   # embedded local Spark, 8 trials of 2 ranks, 2 at once
    python jobs/tune.py --trials 16 --concurrent 4 --num-workers 2 --study /shared/tune-digits
    spark-submit --master spark://host:7077 --conf spark.scheduler.mode=FAIR jobs/tune.py --data hdfs:///digits
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _common

EPILOG = """\
inputs:
  DATA/train   a sparkdl dataset with columns features (array<float>[64]) and label (jobs/etl.py)
  DATA/test    a Parquet table of held-out rows, same columns
outputs:
  STUDY/study.journal   the Optuna study (JournalStorage): every trial, its parameters, reports and state
  STUDY/best.json       the best trial's number, parameters and held-out error
  STUDY/trial-<n>/      each trial's checkpoints (the search's tune_dir)

exit status: 0, or 1 when no trial completed.
"""


def parse_args(argv: Sequence[str] | None = None) -> Any:
    p = _common.job_parser("tune", "Searches the digits MLP's learning rate and momentum with sparkdl.tune.", EPILOG)
    p.add_argument("--data", default=None,
                   help=f"dataset directory written by jobs/etl.py (run first when missing) {_common.private_help('data')}")
    p.add_argument("--study", default=None,
                   help=f"the search's directory: its study journal and trials {_common.private_help('study')}")
    p.add_argument("--trials", type=int, default=8, help="trials in the search (default: %(default)s)")
    p.add_argument("--concurrent", type=int, default=2, help="trials at once, at most (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=6, help="epochs of each trial (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="rows per batch and rank (default: %(default)s)")
    p.add_argument("--no-pruning", action="store_true", help="run every trial to its end")
    args = _common.parse_job_args(p, "tune", argv)
    _common.fill_private_defaults(args, "data", "study")
    return args


def trial(data: str, epochs: int, batch_size: int) -> float:
    """Runs on every rank of a trial: DDP with the trial's parameters, resumable by epoch; reports
    the held-out error after every epoch and returns the last."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sparkdl

    ctx = sparkdl.context()
    assert ctx.trial is not None
    params = ctx.trial.params
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=params["lr"], momentum=params["momentum"])
    start = 0
    saved = ctx.load_checkpoint()
    if saved is not None:
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        start = saved["epoch"]
    train_ds, test_ds = sparkdl.Dataset(f"{data}/train"), sparkdl.Dataset(f"{data}/test")
    error = 1.0
    for epoch in range(start, epochs):
        model.train()
        for batch in train_ds.loader(batch_size, epoch=epoch, columns=["features", "label"], drop_last=True):
            loss = torch.nn.functional.cross_entropy(model(batch["features"]), batch["label"].long())
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        counts = torch.zeros(2)
        with torch.no_grad():
            for batch in test_ds.loader(256, shuffle=False, columns=["features", "label"]):
                counts[0] += (model(batch["features"]).argmax(1) != batch["label"].long()).sum()
                counts[1] += len(batch["label"])
        dist.all_reduce(counts)
        error = float(counts[0] / counts[1])
        ctx.save_checkpoint({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch + 1})
        if ctx.report(error, step=epoch):
            raise sparkdl.TrialPruned()
    return error


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import optuna

    import sparkdl

    data = _common.absolute(args.data).rstrip("/")
    study_dir = Path(_common.absolute(args.study))
    study_dir.mkdir(parents=True, exist_ok=True)
    # Enough slots for the trials that run at once (a cluster's own come from --master or spark-submit).
    spark = _common.session(args, "sparkdl-tune-digits", slots=args.num_workers * args.concurrent)
    try:
        import train as train_job

        if not train_job.has_dataset(data):
            import etl

            print(f"no dataset at {data}/train: running the ETL job (jobs/etl.py) first")
            etl.run_etl(spark, data, test_fraction=0.2, seed=0, num_files=None, overwrite=True)
        storage = optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(str(study_dir / "study.journal")))
        pruner = optuna.pruners.NopPruner() if args.no_pruning else optuna.pruners.MedianPruner(
            n_startup_trials=2, n_warmup_steps=1)
        study = optuna.create_study(study_name="digits", storage=storage, load_if_exists=True, pruner=pruner,
                                    sampler=optuna.samplers.TPESampler(seed=0))
        sparkdl.tune(
            trial, data, args.epochs, args.batch_size, study=study, n_trials=args.trials,
            workers_per_trial=args.num_workers, max_concurrent=args.concurrent, spark=spark, tune_dir=str(study_dir),
            search_space=lambda t: {"lr": t.suggest_float("lr", 1e-3, 0.5, log=True),
                                    "momentum": t.suggest_float("momentum", 0.0, 0.95)},
        )
    finally:
        spark.stop()
    states = [t.state.name for t in study.trials]
    print(f"{len(states)} trials: {states.count('COMPLETE')} completed, {states.count('PRUNED')} pruned, "
          f"{states.count('FAIL')} failed")
    if not states.count("COMPLETE"):
        return 1
    best = study.best_trial
    (study_dir / "best.json").write_text(json.dumps({"trial": best.number, "params": best.params,
                                                     "error": best.value}, indent=2))
    print(f"best: trial {best.number}, held-out error {best.value:.4f} with {best.params}; "
          f"study in {study_dir / 'study.journal'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
