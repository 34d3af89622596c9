"""A Spark Connect client program (tests/e2e/test_connect.py runs it against a real Connect server).

``python connect_client.py URL SCENARIO WORKDIR``: the session is ``SparkSession.builder.remote(URL)``,
which has no SparkContext. Each scenario prints one ``RESULT <json>`` line. This file runs as a
script, so its functions travel to the ranks by value.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from typing import Any

import sparkdl

BATCH, SAVE_EVERY = 16, 4


def dataset(spark: Any, url: str) -> sparkdl.Dataset:
    import random

    rng = random.Random(5)
    rows = []
    for i in range(320):
        x = [rng.uniform(-1, 1) for _ in range(8)]
        rows.append((i, x, sum(x[:4]) - 0.5 * x[5] + rng.gauss(0, 0.05)))
    return sparkdl.write_dataset(spark.createDataFrame(rows, "id long, x array<float>, y double"), url, num_files=4)


def train(ds: sparkdl.Dataset, kill_rank: int | None, kill_step: int = 7) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = sparkdl.context()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = sparkdl.TrainState(model, opt, ds.loader(BATCH, seed=3, drop_last=True))
    for batch in state.batches(epochs=2, save_every=SAVE_EVERY):
        if ctx.attempt == 0 and ctx.rank == kill_rank and state.global_step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(1), batch["y"].float())
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"trained to step {state.global_step} on attempt {ctx.attempt}", flush=True)
    digest = hashlib.sha256()
    for key, value in sorted(model.module.state_dict().items()):
        digest.update(key.encode() + value.numpy().tobytes())
    return {"weights": digest.hexdigest(), "attempt": ctx.attempt, "restored_from": state.restored_from,
            "steps": state.global_step}


def scenario_train(spark: Any, work: str) -> dict[str, Any]:
    ds = dataset(spark, f"{work}/data")
    again = sparkdl.Dataset(f"{work}/data")  # reopened from its manifest
    faulted = sparkdl.launch(train, ds, 1, num_workers=2, checkpoint_dir=f"{work}/ckpt-faulted")
    clean = sparkdl.run(train, ds, None, num_workers=2, checkpoint_dir=f"{work}/ckpt-clean")
    # The plan cache (path=None): the same DataFrame twice is one entry, another one is not.
    small = spark.createDataFrame([(i, [float(i)], float(i % 2)) for i in range(50)], "id long, x array<float>, y double")
    cached = [sparkdl.write_dataset(small).url, sparkdl.write_dataset(small).url,
              sparkdl.write_dataset(small.filter("id < 40")).url]
    return {"faulted": faulted.value, "attempts": faulted.attempts, "clean": clean,
            "rows": [ds.num_rows, again.num_rows], "cached": cached}


def boom(log: str) -> None:
    ctx = sparkdl.context()
    with open(log, "a") as f:
        f.write(f"{ctx.attempt} {ctx.rank}\n")
    raise ValueError("the same error every time")


def scenario_stop(spark: Any, work: str) -> dict[str, Any]:
    """The driver stops the job (the same error twice): through a tag, Spark's job is cancelled."""
    log = f"{work}/calls.log"
    started = time.monotonic()
    try:
        sparkdl.run(boom, log, num_workers=2)
        error = None
    except sparkdl.RunFailedError as exc:
        error = str(exc)
    elapsed = time.monotonic() - started
    time.sleep(8)  # what a job left running would still do
    with open(log) as f:
        calls = f.read().split("\n")
    return {"error": error, "calls": [c for c in calls if c], "elapsed": elapsed}


def scenario_slots(spark: Any, work: str) -> dict[str, Any]:
    started = time.monotonic()
    try:
        sparkdl.run(print, "never", num_workers=3)
        return {"error": None}
    except sparkdl.InsufficientSlotsError as exc:
        return {"error": str(exc), "required": exc.required, "available": exc.available,
                "elapsed": time.monotonic() - started}


def scaled(x: float, scale: float = 1.0) -> float:
    import torch.distributed as dist

    return float(x * scale * dist.get_world_size())


def hvd_main(x: float) -> float:
    import horovod.torch as hvd

    hvd.init()
    return float(x * hvd.size())


def scenario_dropins(spark: Any, work: str) -> dict[str, Any]:
    from sparkdl import HorovodRunner, TorchDistributor

    out: dict[str, Any] = {}
    out["td"] = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(scaled, 2.0, scale=3.0)
    for name, call in (
        ("gpu", lambda: TorchDistributor(num_processes=2, local_mode=False)),
        ("script", lambda: TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run("t.py", epochs=3)),
    ):
        try:
            call()
            out[name] = None
        except Exception as exc:
            out[name] = [type(exc).__name__, isinstance(exc, RuntimeError), isinstance(exc, ValueError), str(exc)]
    out["hvd"] = HorovodRunner(np=2).run(hvd_main, x=5.0)
    import torch

    df = spark.createDataFrame([([0.0, 1.0], 1.0)], "x array<float>, y double")
    try:
        sparkdl.TorchEstimator(model=torch.nn.Linear(2, 1), featuresCol="x", labelCol="y", numWorkers=1).fit(df)
        out["estimator"] = None
    except sparkdl.ConfigError as exc:
        out["estimator"] = str(exc)
    # Petastorm's converter, as its documentation uses it, which itself cannot run over Connect.
    from sparkdl.compat.petastorm import SparkDatasetConverter, make_spark_converter

    spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, f"file://{work}/converter")
    converter = make_spark_converter(spark.range(100).selectExpr("id", "cast(id as double) / 2 as x"))
    with converter.make_torch_dataloader(batch_size=16, num_epochs=1, cur_shard=1, shard_count=2) as loader:
        batches = list(loader)
    out["converter"] = [len(converter), len(batches), sorted(int(i) for b in batches for i in b["id"]),
                        str(batches[0]["x"].dtype)]
    converter.delete()
    # The image tutorial's converter, TransformSpec and HorovodRunner, from a Connect client.
    import numpy as np
    from photos import photos

    from sparkdl.compat.petastorm import TransformSpec

    df = spark.createDataFrame([(i, i % 2, bytearray(p)) for i, p in enumerate(photos(8, seed=2))],
                               "id long, label int, content binary")
    converter = make_spark_converter(df)
    spec = TransformSpec(decode_photos, edit_fields=[("features", np.float32, (3, 8, 8), False)],
                         selected_fields=["features", "label", "id"])
    out["tutorial"] = [len(converter), HorovodRunner(np=2).run(read_shard, converter=converter, spec=spec)]
    converter.delete()
    return out


def decode_photos(pdf: Any) -> Any:
    """The tutorial's TransformSpec function: each photo of the batch decoded and resized by PIL."""
    import io

    import numpy as np
    from PIL import Image

    def one(data: bytes) -> Any:
        image = Image.open(io.BytesIO(data)).convert("RGB").resize((8, 8))
        return np.ascontiguousarray((np.asarray(image, np.float32) / 255.0).transpose(2, 0, 1))

    pdf["features"] = pdf["content"].map(one)
    return pdf[["features", "label", "id"]]


def read_shard(converter: Any, spec: Any) -> Any:
    import horovod.torch as hvd

    hvd.init()
    ids, shapes = [], set()
    with converter.make_torch_dataloader(transform_spec=spec, batch_size=2, num_epochs=1, cur_shard=hvd.rank(),
                                         shard_count=hvd.size()) as loader:
        for batch in loader:
            ids.extend(int(i) for i in batch["id"])
            shapes.add(f"{tuple(batch['features'].shape[1:])} {batch['features'].dtype}")
    return hvd.allgather_object([sorted(ids), sorted(shapes)])


def sleeper(pids: str) -> None:
    with open(f"{pids}-{sparkdl.context().rank}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def scenario_orphan(spark: Any, work: str) -> dict[str, Any]:
    """Runs until the test kills this client: the ranks must end without it."""
    sparkdl.run(sleeper, f"{work}/pid", num_workers=2)
    return {}


def always_fails() -> None:
    ctx = sparkdl.context()
    print(f"working on attempt {ctx.attempt}", flush=True)
    if ctx.rank == 1:
        raise RuntimeError(f"broken on rank {ctx.rank}")
    time.sleep(120)  # where rank 0 is when its peer fails


def scenario_relay(spark: Any, work: str) -> dict[str, Any]:
    """Run from a client the executors cannot reach: everything comes back through Spark."""
    ds = dataset(spark, f"{work}/data")
    faulted = sparkdl.launch(train, ds, 1, num_workers=2, checkpoint_dir=f"{work}/ckpt-faulted")
    clean = sparkdl.run(train, ds, None, num_workers=2, checkpoint_dir=f"{work}/ckpt-clean")
    try:
        sparkdl.run(always_fails, num_workers=2, max_attempts=2,
                    config=sparkdl.RunConfig(stop_on_repeated_error=False))
        error = None
    except sparkdl.RunFailedError as exc:
        error = str(exc)
    return {"faulted": faulted.value, "attempts": faulted.attempts, "clean": clean, "error": error}


def scenario_serverdies(spark: Any, work: str) -> dict[str, Any]:
    """Runs until the test kills the Connect server: the run must end, with an error."""
    started = time.monotonic()
    try:
        sparkdl.run(sleeper, f"{work}/pid", num_workers=2)
        return {"error": None}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:3000], "elapsed": time.monotonic() - started}


def scenario_tune(spark: Any, work: str) -> dict[str, Any]:
    """A search from the client: two one-rank trials, the worse pruned through the client's channel."""
    import cloudpickle
    import optuna
    import tune_objective

    cloudpickle.register_pickle_by_value(tune_objective)
    log = f"{work}/log"
    os.makedirs(log)
    study = optuna.create_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=1))
    for lr in (0.01, 1.0):
        study.enqueue_trial({"lr": lr})
    sparkdl.tune(tune_objective.objective, log, {}, study=study, n_trials=2, workers_per_trial=1,
                 search_space=lambda t: {"lr": t.suggest_float("lr", 1e-4, 1.0, log=True)}, tune_dir=f"{work}/search")
    return {"states": [t.state.name for t in study.trials], "values": [t.value for t in study.trials],
            "pruned": sorted(os.listdir(log))}


def main() -> None:
    from pyspark.sql import SparkSession

    url, scenario, work = sys.argv[1:4]
    spark = SparkSession.builder.remote(url).getOrCreate()
    assert not hasattr(spark, "sparkContext") or type(spark).__module__.startswith("pyspark.sql.connect")
    result = globals()[f"scenario_{scenario}"](spark, work)
    print("RESULT " + json.dumps(result), flush=True)
    if scenario != "serverdies":
        spark.stop()


if __name__ == "__main__":
    main()
