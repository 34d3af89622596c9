"""The Ray side of ``bench_tune.py``, run in an environment of its own (``--ray-python``): Ray Tune
searching the same learning rates with Ray Train's ``TorchTrainer`` (2 workers, gloo) as each
trial, ``--concurrent`` at once, without a scheduler (``fifo``) or with ASHA (``asha``, reduction
factor 2, grace period 2 epochs). Prints one JSON line: wall time, time spent training, epochs
run, best loss."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# Ray Train's first API runs TorchTrainer as a Tune trainable (Train v2 runs Tune around a function).
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "0")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import tune_problem  # noqa: E402


def loop(config: dict) -> None:  # type: ignore[type-arg]
    import ray.train

    def report(loss: float, epoch: int) -> bool:
        ray.train.report({"loss": loss, "epoch": epoch})
        return False  # ASHA stops a trial by ending its workers, not by an answer here

    out = tune_problem.train(config["lr"], config["epochs"], config["steps"], config["step_s"], 0, report)
    if ray.train.get_context().get_world_rank() == 0:
        Path(config["out_dir"], f"trial-{config['lr']:.6g}.json").write_text(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--concurrent", type=int, default=2)
    parser.add_argument("--scheduler", choices=("fifo", "asha"), default="fifo")
    args = parser.parse_args()
    import ray
    from ray import cloudpickle, tune
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    cloudpickle.register_pickle_by_value(tune_problem)
    ray.init(num_cpus=2 * args.concurrent + args.concurrent, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")
    with tempfile.TemporaryDirectory() as out_dir, tempfile.TemporaryDirectory() as storage:
        trainer = TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                                                  resources_per_worker={"CPU": 1}))
        scheduler = (ASHAScheduler(max_t=args.epochs, grace_period=2, reduction_factor=2, time_attr="epoch")
                     if args.scheduler == "asha" else FIFOScheduler())
        tuner = tune.Tuner(
            trainer,
            param_space={"train_loop_config": {
                "lr": tune.grid_search(tune_problem.learning_rates(args.trials)), "epochs": args.epochs,
                "steps": args.steps, "step_s": args.step_s, "out_dir": out_dir}},
            tune_config=tune.TuneConfig(metric="loss", mode="min", scheduler=scheduler,
                                        max_concurrent_trials=args.concurrent),
            run_config=RunConfig(storage_path=storage, verbose=0),
        )
        began = time.perf_counter()
        results = tuner.fit()
        wall = time.perf_counter() - began
        outs = [json.loads(p.read_text()) for p in Path(out_dir).glob("trial-*.json")]
        epochs = sum(len(r.metrics_dataframe) if r.metrics_dataframe is not None else 0 for r in results)
        best = results.get_best_result(metric="loss", mode="min", scope="last").metrics["loss"]
    ray.shutdown()
    # Trials ASHA stopped wrote no file: their training time is counted from their epochs.
    finished_train = sum(o["train_s"] for o in outs)
    per_epoch = finished_train / max(1, sum(o["epochs"] for o in outs))
    stopped_epochs = epochs - sum(o["epochs"] for o in outs)
    print(json.dumps({"wall": wall, "train_s": finished_train + per_epoch * stopped_epochs, "epochs": epochs,
                      "best": best, "concurrent": args.concurrent}))


if __name__ == "__main__":
    main()
