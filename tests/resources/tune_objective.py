"""The objective the sparkdl.tune tests search, shared by the tests and the driver script they
kill (``python tune_objective.py DIR STORAGE TUNE_DIR``): a gang of ranks that take ``STEPS``
steps, each an allreduce (a collective every step), report a loss that depends on the learning
rate in a known way (:func:`loss`), save a checkpoint after each step and resume from it. Each rank
leaves files in ``log_dir`` saying what it did: its pid and times, where it resumed, where it was
pruned; ``plan`` injects faults (a SIGKILL at a chosen trial, attempt, rank and step) and holds."""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import sparkdl

STEPS = 4


def loss(lr: float, step: int) -> float:
    """Least at lr = 0.01; falls with the steps."""
    return (math.log10(lr) + 2) ** 2 + 1.0 / (step + 1)


def objective(log_dir: str, plan: dict[str, Any]) -> float:
    import torch
    import torch.distributed as dist

    ctx = sparkdl.context()
    assert ctx.trial is not None
    n, lr = ctx.trial.number, float(ctx.trial.params["lr"])
    d = Path(log_dir)
    me = f"t{n}-a{ctx.attempt}-r{ctx.rank}"
    (d / f"{me}.start").write_text(f"{os.getpid()} {time.time()}")
    state = ctx.load_checkpoint() or {"step": 0}
    if state["step"]:
        with open(d / f"t{n}-r{ctx.rank}-resumed", "a") as f:  # one line a resume: the step
            f.write(f"{state['step']}\n")
    for step in range(state["step"], STEPS):
        t = torch.ones(1)
        dist.all_reduce(t)
        time.sleep(plan.get("sleep", 0.0))
        hold = plan.get("hold")
        if hold == [n, step]:
            with open(d / f"t{n}-r{ctx.rank}-holding", "a") as f:  # one line a time it held
                f.write(f"{os.getpid()}\n")
            while not (d / "go").exists():
                time.sleep(0.1)
        if ctx.report(loss(lr, step), step=step):
            (d / f"t{n}-r{ctx.rank}-pruned-at-{step}").touch()
            raise sparkdl.TrialPruned()
        ctx.save_checkpoint({"step": step + 1})
        dist.barrier()  # the checkpoint is whole before any rank goes on (and a kill below loses nothing)
        if plan.get("kill") == [n, ctx.attempt, ctx.rank, step]:
            os.kill(os.getpid(), signal.SIGKILL)
    (d / f"{me}.end").write_text(str(time.time()))
    return loss(lr, STEPS - 1)


if __name__ == "__main__":
    # The driver the test stops (SIGINT) or kills: tune on local[4], a journal-file study, trial 1
    # held at step 2; the trials are enqueued by the first driver only.
    import cloudpickle
    import optuna
    from pyspark.sql import SparkSession

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    log_dir, storage_path, tune_dir = sys.argv[1:4]
    spark = (SparkSession.builder.master("local[4]").config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "1").getOrCreate())
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(storage_path))
    study = optuna.create_study(study_name="killed", storage=storage, load_if_exists=True)
    if not study.trials:
        for lr in (0.01, 0.1, 0.001):
            study.enqueue_trial({"lr": lr})
    sparkdl.tune(objective, log_dir, {"hold": [1, 2]}, study=study, n_trials=3, workers_per_trial=2,
                 search_space=lambda t: {"lr": t.suggest_float("lr", 1e-4, 1.0, log=True)}, tune_dir=tune_dir,
                 config=sparkdl.RunConfig(start_timeout_s=90, collective_timeout_s=60))
