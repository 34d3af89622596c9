"""A search of distributed trials: ``sparkdl.tune`` against itself one trial at a time, against
itself without pruning, and against Ray Tune + Ray Train on the same problem.

The problem (``tune_problem.py``): 8 trials (learning rates on a log grid) of 2 ranks each, a
linear regression trained with SGD whose loss depends on the learning rate in a known way, an
allreduce every step, a wait per step standing in for an accelerator's step, one report per epoch.
On ``local-cluster[2,2,1024]`` (two executors of two task slots: two gangs of two at once;
``--master local[4]`` for one JVM). Printed, each measured in this run:

1. wall time of the search at ``max_concurrent`` 1 and 2, and their ratio (target >= 1.7x);
2. with Optuna's median pruner against none (both at 2 at once): the epochs run, the fraction
   saved, the best value found by each, and the wall times;
3. per-trial overhead at 1 and 2 at once: (wall x concurrency - time spent training) / trials,
   the time a trial costs beyond its training (launch, process start, the study, teardown);
4. with ``--ray-python`` (an environment of its own: ``python3 -m venv .venv-ray;
   .venv-ray/bin/pip install 'ray[tune,train]' torch``): the same search with Ray Tune running
   Ray Train's ``TorchTrainer`` (2 workers) trials, 2 at once, without a scheduler and with
   ASHA: wall time, per-trial overhead and best value, side by side (goal: sparkdl's per-trial
   overhead below Ray's).

    .venv/bin/python benchmarks/bench_tune.py [--trials 8] [--epochs 6] [--steps 8] [--step-s 0.05] \
        [--ray-python .venv-ray/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cloudpickle  # noqa: E402
import tune_problem  # noqa: E402

cloudpickle.register_pickle_by_value(tune_problem)  # the ranks need not find this folder


def sparkdl_trial(epochs: int, steps: int, step_s: float, out_dir: str) -> float:
    import sparkdl

    ctx = sparkdl.context()
    assert ctx.trial is not None
    out = tune_problem.train(float(ctx.trial.params["lr"]), epochs, steps, step_s, 0,
                             lambda value, epoch: ctx.report(value, step=epoch))
    if ctx.rank == 0:
        Path(out_dir, f"trial-{ctx.trial.number}.json").write_text(json.dumps(out))
    if ctx.should_prune():
        raise sparkdl.TrialPruned()
    return out["loss"]


def run_sparkdl(spark: Any, args: argparse.Namespace, concurrent: int, prune: bool) -> dict[str, Any]:
    import optuna

    import sparkdl

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1) if prune else optuna.pruners.NopPruner()
    study = optuna.create_study(pruner=pruner)
    for lr in tune_problem.learning_rates(args.trials):
        study.enqueue_trial({"lr": lr})
    with tempfile.TemporaryDirectory() as out_dir, tempfile.TemporaryDirectory() as tune_dir:
        began = time.perf_counter()
        sparkdl.tune(sparkdl_trial, args.epochs, args.steps, args.step_s, out_dir, study=study,
                     search_space=lambda t: {"lr": t.suggest_float("lr", 1e-3, 1.0, log=True)},
                     n_trials=args.trials, workers_per_trial=2, max_concurrent=concurrent, spark=spark,
                     tune_dir=tune_dir, config=sparkdl.RunConfig(echo_logs=False))
        wall = time.perf_counter() - began
        outs = [json.loads(p.read_text()) for p in Path(out_dir).glob("trial-*.json")]
    states = [t.state.name for t in study.trials]
    return {"wall": wall, "train_s": sum(o["train_s"] for o in outs), "epochs": sum(o["epochs"] for o in outs),
            "best": study.best_value, "pruned": states.count("PRUNED"), "complete": states.count("COMPLETE"),
            "concurrent": concurrent}


def run_ray(python: str, args: argparse.Namespace, scheduler: str) -> dict[str, Any]:
    cmd = [python, str(HERE / "tune_ray_peer.py"), "--trials", str(args.trials), "--epochs", str(args.epochs),
           "--steps", str(args.steps), "--step-s", str(args.step_s), "--concurrent", "2", "--scheduler", scheduler]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the Ray peer failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def overhead(r: dict[str, Any], trials: int) -> float:
    return (r["wall"] * r["concurrent"] - r["train_s"]) / trials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8, help="steps per epoch")
    parser.add_argument("--step-s", type=float, default=0.05, help="the wait of each step (an accelerator's step)")
    parser.add_argument("--ray-python", default=None)
    parser.add_argument("--master", default="local-cluster[2,2,1024]",
                        help="a cluster that holds two gangs of two: two executors of two cores (default), or local[4]")
    args = parser.parse_args()
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(args.master).config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").config("spark.scheduler.mode", "FAIR").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    print(f"{args.trials} trials of 2 ranks, {args.epochs} epochs of {args.steps} steps of >= {args.step_s} s, "
          f"{args.master}, {os.cpu_count()} cores", flush=True)
    run_sparkdl(spark, argparse.Namespace(**{**vars(args), "trials": 2}), 2, False)  # warm: JVM, zygotes
    one = run_sparkdl(spark, args, 1, False)
    print(f"sparkdl, 1 at once:          {one['wall']:6.1f} s", flush=True)
    two = run_sparkdl(spark, args, 2, False)
    print(f"sparkdl, 2 at once:          {two['wall']:6.1f} s   speed-up {one['wall'] / two['wall']:.2f}x "
          "(target >= 1.7x)", flush=True)
    pruned = run_sparkdl(spark, args, 2, True)
    print(f"sparkdl, 2 at once, pruned:  {pruned['wall']:6.1f} s   {pruned['pruned']} of {args.trials} trials "
          f"pruned; epochs run {pruned['epochs']} of {two['epochs']} ({1 - pruned['epochs'] / two['epochs']:.0%} "
          f"saved); best {pruned['best']:.5g} vs {two['best']:.5g} without pruning", flush=True)
    print(f"per-trial overhead: {overhead(one, args.trials):.2f} s at 1 at once, {overhead(two, args.trials):.2f} s "
          "at 2 at once", flush=True)
    spark.stop()
    if args.ray_python:
        fifo = run_ray(args.ray_python, args, "fifo")
        asha = run_ray(args.ray_python, args, "asha")
        print(f"Ray Tune + Train, 2 at once:        {fifo['wall']:6.1f} s   per-trial overhead "
              f"{overhead(fifo, args.trials):.2f} s; best {fifo['best']:.5g}", flush=True)
        print(f"Ray Tune + Train, 2 at once, ASHA:  {asha['wall']:6.1f} s   epochs run {asha['epochs']} of "
              f"{fifo['epochs']}; best {asha['best']:.5g}", flush=True)
        print(f"ratio sparkdl / Ray, search wall (no pruning)  {two['wall'] / fifo['wall']:.2f}")
        print(f"ratio sparkdl / Ray, search wall (pruning)     {pruned['wall'] / asha['wall']:.2f}")
        print(f"ratio sparkdl / Ray, per-trial overhead        {overhead(two, args.trials) / overhead(fifo, args.trials):.2f}"
              "  (goal < 1)")


if __name__ == "__main__":
    main()
