"""A driver program on the namespaced cluster's bridge (tests/cluster/test_netns_hosts.py runs it).

``python netns_driver.py SCENARIO PARAMS_JSON``: the Spark confs come from PARAMS_JSON's
``conf`` (the cluster's driver confs), storage every host shares is ``shared``, host 2's address
is ``host2``. Each scenario prints one ``RESULT <json>`` line at its end (``faults``: also a
``RESULT-<name> <json>`` line after each run, which starts when the test writes its name on
stdin); rank output is echoed by sparkdl as ``[rank r] ...`` lines, which the test reads live to
time its faults.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
import time
from typing import Any

import sparkdl

EPOCHS, BATCH, SAVE_EVERY = 3, 16, 4
ROWS = 320  # of the dataset below, 8 features each


def session(conf: dict[str, str]) -> Any:
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("sparkdl-netns")
    for key, value in conf.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def dataset(spark: Any, url: str) -> sparkdl.Dataset:
    import random

    if os.path.exists(os.path.join(url, "_sparkdl_manifest.json")):
        return sparkdl.Dataset(url)
    rng = random.Random(5)
    rows = []
    for i in range(ROWS):
        x = [rng.uniform(-1, 1) for _ in range(8)]
        rows.append((i, x, sum(x[:4]) - 0.5 * x[5] + rng.gauss(0, 0.05)))
    df = spark.createDataFrame(rows, "id long, x array<float>, y double")
    return sparkdl.write_dataset(df, url, num_files=4)


def train(ds: sparkdl.Dataset, fault: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = sparkdl.context()
    if fault.get("mark"):
        open(f"{fault['mark']}-{ctx.rank}", "w").close()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = sparkdl.TrainState(model, opt, ds.loader(BATCH, seed=3, drop_last=True))
    for batch in state.batches(epochs=fault.get("epochs", EPOCHS), save_every=SAVE_EVERY):
        step = state.global_step
        if ctx.rank == 0:
            print(f"STEP {step} attempt {ctx.attempt}", flush=True)
        if fault.get("how") == "sigkill" and ctx.attempt == 0 and step == fault["step"] \
                and os.environ["SPARKDL_HOST"] == fault["host"]:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(fault.get("sleep", 0.0))
        loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(1), batch["y"].float())
        opt.zero_grad()
        loss.backward()
        opt.step()
    digest = hashlib.sha256()
    for key, value in sorted(model.module.state_dict().items()):
        digest.update(key.encode() + value.numpy().tobytes())
    return {"weights": digest.hexdigest(), "attempt": ctx.attempt, "restored_from": state.restored_from,
            "steps": state.global_step}


def where(ds: sparkdl.Dataset) -> list[dict[str, Any]]:
    """Each rank: its host, MASTER_ADDR, the ids its loader fed, and every TCP listener of a
    non-JVM process on its host while the process group is up."""
    import psutil
    import torch.distributed as dist

    ctx = sparkdl.context()
    ids = [int(i) for batch in ds.loader(BATCH, shuffle=False) for i in batch["id"]]
    dist.barrier()
    listeners = []
    for conn in psutil.net_connections("tcp"):
        if conn.status != psutil.CONN_LISTEN or conn.pid is None:
            continue
        try:
            proc = psutil.Process(conn.pid)
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "java" not in proc.name():
            listeners.append([conn.laddr.ip, conn.laddr.port, proc.name(), cmd[:200]])
    dist.barrier()
    info = {"rank": ctx.rank, "host": os.environ["SPARKDL_HOST"], "master_addr": os.environ["MASTER_ADDR"],
            "ids": ids, "listeners": listeners}
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, info)
    return gathered


def origins() -> list[dict[str, Any]]:
    """Every rank's host and where its Python, torch and sparkdl come from."""
    import torch
    import torch.distributed as dist

    info = {"rank": sparkdl.context().rank, "host": os.environ["SPARKDL_HOST"], "python": sys.executable,
            "torch": torch.__file__, "sparkdl": sparkdl.__file__}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, info)
    return gathered


def config_error(call: Any) -> str | None:
    try:
        call()
    except sparkdl.ConfigError as exc:
        return str(exc)
    return None


def estimator(spark: Any, ds_url: str, shared: str) -> dict[str, Any]:
    import torch
    from pyspark.ml import Pipeline, PipelineModel

    from sparkdl import TorchEstimator

    df = spark.read.parquet(ds_url).select("id", "x", "y")
    est = TorchEstimator(model=lambda: torch.nn.Linear(8, 1), loss="mse", featuresCol="x", labelCol="y",
                         batchSize=32, epochs=2, numWorkers=2, seed=0,
                         runConfig=sparkdl.RunConfig(start_timeout_s=90, collective_timeout_s=30))
    fitted = Pipeline(stages=[est]).fit(df)
    first = fitted.transform(df).orderBy("id").select("prediction").collect()
    fitted.write().overwrite().save(f"{shared}/pipeline")
    again = PipelineModel.load(f"{shared}/pipeline").transform(df).orderBy("id").select("prediction").collect()
    return {"rows": len(first), "same": [r[0] for r in first] == [r[0] for r in again]}


def main() -> None:
    scenario, params = sys.argv[1], json.loads(sys.argv[2])
    if scenario not in ("main", "packed", "faults"):
        sys.exit(f"unknown scenario {scenario!r}: main, packed or faults")
    shared, conf = params["shared"], params["conf"]
    cfg = sparkdl.RunConfig(start_timeout_s=params.get("start_timeout_s", 90),
                            collective_timeout_s=params.get("collective_timeout_s", 30),
                            slot_wait_s=params.get("slot_wait_s", 30))
    out: dict[str, Any] = {}
    spark = session(conf)
    ds = dataset(spark, f"{shared}/data")
    if scenario == "main":
        df = spark.read.parquet(ds.url)
        out["cache_default"] = config_error(lambda: sparkdl.write_dataset(df))
        # A checkpoint directory on the driver's own disk (each host has a private /tmp).
        mark = f"{shared}/started-named"
        local_ckpt = f"/tmp/sparkdl-netns-{os.getpid()}"
        out["ckpt_named"] = config_error(lambda: sparkdl.run(train, ds, {"mark": mark}, num_workers=2, config=cfg,
                                                             checkpoint_dir=local_ckpt))
        shutil.rmtree(local_ckpt, ignore_errors=True)  # the refused directory, made to hold the marker
        out["ckpt_named_started"] = sorted(p for p in os.listdir(shared) if p.startswith("started-named"))
        # The default run directory, on the driver's temp dir: a run that never saves runs...
        out["where"] = sparkdl.run(where, ds, num_workers=2, config=cfg)
        # ... and one that saves fails at its first save, without a rerun.
        mark = f"{shared}/started-default"
        try:
            sparkdl.run(train, ds, {"mark": mark}, num_workers=2, config=cfg)
            out["ckpt_default"] = None
        except sparkdl.RunFailedError as exc:
            out["ckpt_default"] = {"message": str(exc), "root_cause": exc.root_cause, "attempts": exc.attempts}
        out["ckpt_default_started"] = sorted(p for p in os.listdir(shared) if p.startswith("started-default"))
        out["reference"] = sparkdl.run(train, ds, {}, num_workers=2, config=cfg, checkpoint_dir=f"{shared}/ref")
        fault = {"how": "sigkill", "host": params["host2"], "step": 7}
        out["sigkill"] = sparkdl.run(train, ds, fault, num_workers=2, config=cfg, checkpoint_dir=f"{shared}/kill")
        # The same application's user points the run and cache directories at the shared storage.
        spark.conf.set("spark.sparkdl.runDir", f"{shared}/runs")
        spark.conf.set("spark.sparkdl.cacheDir", f"{shared}/cache")
        out["cached"] = sparkdl.write_dataset(spark.read.parquet(ds.url)).url
        out["estimator"] = estimator(spark, ds.url, shared)
    elif scenario == "packed":  # executors with nothing installed, the job's packed venv shipped to them
        out["origins"] = sparkdl.run(origins, num_workers=2, config=cfg)
        fault = {"how": "sigkill", "host": params["host2"], "step": 7}
        out["sigkill"] = sparkdl.run(train, ds, fault, num_workers=2, config=cfg, checkpoint_dir=f"{shared}/kill")
        out["sigkill"]["expected_steps"] = EPOCHS * (ROWS // 2 // BATCH)  # 2 ranks, drop_last
    else:  # "faults": runs that the test partitions or kills host 2 under, one application for all
        # Each run starts when the test writes its name on stdin (an empty line or EOF: no more), so
        # that the test acts on the run it asked for; its result comes back as "RESULT-<name> {...}".
        for line in sys.stdin:
            if not (name := line.strip()):
                break
            run = params["runs"][name]
            run_cfg = sparkdl.RunConfig(start_timeout_s=run.get("start_timeout_s", 90),
                                        collective_timeout_s=run.get("collective_timeout_s", 30), slot_wait_s=30)
            print(f"RUN {name}", flush=True)
            started = time.monotonic()
            fault = {"sleep": run.get("sleep", 0.2), "epochs": run.get("epochs", EPOCHS)}
            got: dict[str, Any] = {}
            try:
                got["value"] = sparkdl.run(train, ds, fault, num_workers=2, config=run_cfg,
                                           checkpoint_dir=f"{shared}/{name}")
            except sparkdl.SparkDLError as exc:
                got["error"], got["message"] = type(exc).__name__, str(exc)
            got["elapsed_s"] = time.monotonic() - started
            print(f"RESULT-{name} " + json.dumps(got), flush=True)
            out[name] = got
    spark.stop()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
