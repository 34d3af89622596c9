"""sparkdl.run on a real local[2] Spark session: launch, torch.distributed, logs, results, reruns, bounds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import cloudpickle
import psutil
import pytest

import sparkdl
from sparkdl._internal.spark.spark_api import ClassicApi

# The rank functions below travel by value, as a notebook's functions do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.spark

FAST = sparkdl.RunConfig(start_timeout_s=60, slot_wait_s=2, connect_timeout_s=20, kill_grace_s=20)


def allreduce_rank_sum(scale: float, *, offset: float = 0.0) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    ctx = sparkdl.context()
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    return {
        "value": t.item() * scale + offset,
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "attempt": ctx.attempt,
        "device": str(ctx.device),
        "env": {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")},
        "backend": dist.get_backend(),
    }


def test_run_returns_rank_0_value_with_process_group_and_env(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    out = sparkdl.run(allreduce_rank_sum, 2.0, num_workers=2, offset=1.0, config=FAST)
    assert out["value"] == (1 + 2) * 2.0 + 1.0
    assert out["rank"] == 0 and out["world_size"] == 2 and out["attempt"] == 0
    assert out["device"] == "cpu" and out["backend"] == "gloo"
    env = out["env"]
    assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("0", "2", "0", "2")


def ddp_written_for_torchrun() -> list[float]:
    # Unchanged torchrun-style code: it creates the process group itself, from the environment.
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group(backend="gloo", init_method="env://")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.full((8, 4), float(rank + 1))
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    weights = [p.detach().clone() for p in model.parameters()]
    gathered = [torch.zeros_like(weights[0]) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, weights[0])
    assert all(torch.equal(gathered[0], g) for g in gathered), "DDP replicas diverged"
    dist.destroy_process_group()
    return weights[0].flatten().tolist()


def _read_my_shard(ds: sparkdl.Dataset, out: str) -> int:
    """A data-only rank: it reads its shard and writes what it saw; it never talks to the others."""
    import json

    import torch.distributed as dist

    ctx = sparkdl.context()
    ids = [int(i) for batch in ds.loader(5, shuffle=False) for i in batch["id"]]
    Path(out, f"rank-{ctx.rank}.json").write_text(json.dumps(
        {"ids": ids, "group": dist.is_available() and dist.is_initialized(), "backend": ctx.backend}))
    return ctx.rank


@pytest.mark.parametrize("where", ["spark", "driver"])
def test_backend_none_runs_data_only_ranks_without_a_process_group(spark, tmp_path, no_leaks, where) -> None:  # type: ignore[no-untyped-def]
    import json

    from sparkdl._internal.driver.local import run_on_driver

    ds = sparkdl.write_dataset(spark.range(40), str(tmp_path / "ds"), num_files=2)
    out = tmp_path / "out"
    out.mkdir()
    if where == "spark":
        value = sparkdl.run(_read_my_shard, ds, str(out), num_workers=2, backend="none", config=FAST)
    else:  # the local launcher (HorovodRunner(np=-2) and local_mode take this path)
        value = run_on_driver(_read_my_shard, (ds, str(out)), {}, num_processes=2, backend="none", config=FAST)
    assert value == 0
    seen = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [s["group"] for s in seen] == [False, False] and {s["backend"] for s in seen} == {"none"}
    assert sorted(seen[0]["ids"] + seen[1]["ids"]) == list(range(40)) and len(seen[0]["ids"]) == 20


def test_existing_ddp_code_runs_unchanged(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    weights = sparkdl.run(ddp_written_for_torchrun, num_workers=2, config=FAST)
    assert len(weights) == 4


def ranks_without_sparkdl_group() -> bool:
    import torch.distributed as dist

    was = dist.is_initialized()
    dist.init_process_group("gloo")
    dist.barrier()
    return was


def test_init_process_group_can_be_left_to_the_user(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    cfg = FAST.replace(init_process_group=False)
    assert sparkdl.run(ranks_without_sparkdl_group, num_workers=2, config=cfg) is False


def chatty(lines: int, long_chars: int) -> int:
    rank = sparkdl.context().rank
    for i in range(lines):
        print(f"line {i} of rank {rank}")
        if i % 97 == 0:
            print(f"err {i} of rank {rank}", file=sys.stderr)
    print("L" * long_chars + "END")
    sys.stdout.write("no newline at the end")
    return lines


def test_every_output_line_reaches_the_driver_tagged_and_whole(spark, capfd, no_leaks) -> None:  # type: ignore[no-untyped-def]
    n, long_chars = 1500, 3 * 1024 * 1024
    assert sparkdl.run(chatty, n, long_chars, num_workers=2, config=FAST) == n
    out, err = capfd.readouterr()
    for rank in (0, 1):
        tag = f"[rank {rank}] "
        got = [line[len(tag):] for line in out.splitlines() if line.startswith(tag)]
        expected = [f"line {i} of rank {rank}" for i in range(n)]
        assert [g for g in got if g.startswith("line ")] == expected  # all, in order
        assert "L" * long_chars + "END" in got  # a 3 MB line arrives uncut
        assert "no newline at the end" in got
        errs = [line for line in err.splitlines() if line.startswith(tag + "err ")]
        assert len(errs) == len(range(0, n, 97))


def big_state_dict() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1234)
    return {"w": torch.randn(27_000_000, generator=g), "b": torch.arange(10)}  # ~108 MB


def test_a_100mb_return_value_comes_back_intact(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    import torch

    out = sparkdl.run(big_state_dict, num_workers=2, config=FAST)
    expected = big_state_dict()
    assert out["w"].numel() * 4 >= 100 * 1024 * 1024
    assert torch.equal(out["w"], expected["w"]) and torch.equal(out["b"], expected["b"])


def fail_on_first_attempt(how: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    ctx = sparkdl.context()
    dist.barrier()
    if ctx.attempt == 0 and ctx.rank == 1:
        print("rank 1 about to fail", flush=True)
        if how == "raise":
            raise ValueError("injected failure on rank 1")
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "exit":
            os._exit(7)
        if how == "hang":
            time.sleep(3600)
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"attempt": ctx.attempt, "sum": t.item(), "pid": os.getpid()}


@pytest.mark.fault
@pytest.mark.parametrize("how", ["raise", "sigkill", "exit"])
def test_a_failed_rank_reruns_the_whole_gang(spark, no_leaks, capfd, how: str) -> None:  # type: ignore[no-untyped-def]
    out = sparkdl.run(fail_on_first_attempt, how, num_workers=2, max_attempts=3, config=FAST)
    assert out["attempt"] == 1 and out["sum"] == 2.0
    assert not psutil.pid_exists(out["pid"]) or psutil.Process(out["pid"]).status() == psutil.STATUS_ZOMBIE
    _, err = capfd.readouterr()
    if how == "raise":
        assert "ValueError: injected failure on rank 1" in err


@pytest.mark.fault
def test_a_rank_hanging_in_a_collective_is_bounded_and_the_gang_reruns(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    cfg = FAST.replace(collective_timeout_s=4.0)
    start = time.monotonic()
    out = sparkdl.run(fail_on_first_attempt, "hang", num_workers=2, max_attempts=2, config=cfg)
    assert out["attempt"] == 1
    assert time.monotonic() - start < 60


def sleep_forever() -> None:
    time.sleep(3600)


@pytest.mark.fault
def test_a_run_that_exceeds_timeout_s_is_stopped_and_says_which_setting(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    cfg = FAST.replace(timeout_s=3.0)
    start = time.monotonic()
    with pytest.raises(sparkdl.RunTimeoutError, match=r"timeout_s=3 s \(RunConfig.timeout_s\)"):
        sparkdl.run(sleep_forever, num_workers=2, config=cfg)
    assert time.monotonic() - start < 40


def always_fails() -> None:
    ctx = sparkdl.context()
    print(f"working on attempt {ctx.attempt}")
    raise RuntimeError(f"broken on rank {ctx.rank}")


@pytest.mark.fault
def test_when_attempts_are_used_up_one_report_names_every_attempt(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(sparkdl.RunFailedError) as info:
        sparkdl.run(always_fails, num_workers=2, max_attempts=2, config=FAST)
    err = info.value
    assert err.attempts == 2
    report = str(err)
    assert "failed after 2 attempt(s)" in report
    assert "Attempt 0:" in report and "Attempt 1:" in report
    assert "Root cause: attempt 0, rank" in report and "RuntimeError: broken on rank" in report
    assert "| working on attempt 0" in report
    assert "max_attempts" in report
    assert "127.0.0.1" in report


@pytest.mark.fault
def test_too_many_workers_fails_in_seconds_naming_numbers_and_confs(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    cfg = FAST.replace(slot_wait_s=1.0)
    start = time.monotonic()
    with pytest.raises(sparkdl.InsufficientSlotsError) as info:
        sparkdl.run(sleep_forever, num_workers=3, config=cfg)
    assert time.monotonic() - start < 10
    msg = str(info.value)
    assert "num_workers=3" in msg and "has 2" in msg and "spark.task.cpus" in msg
    assert info.value.required == 3 and info.value.available == 2


@pytest.mark.fault
def test_slots_busy_with_another_job_are_waited_for_within_slot_wait_s(spark, tmp_path, no_leaks) -> None:  # type: ignore[no-untyped-def]
    sc = spark.sparkContext
    flag = tmp_path / "release"

    def hold_the_slot(_: int) -> None:  # a task of another job, until the flag appears (60 s at most)
        import time

        deadline = time.monotonic() + 60
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.1)

    def other_job() -> None:
        sc.setJobGroup("another-job", "holds one of the two slots", interruptOnCancel=True)
        sc.parallelize([0], 1).foreach(hold_the_slot)

    blocker = threading.Thread(target=other_job, daemon=True)
    blocker.start()
    try:
        deadline = time.monotonic() + 30
        while (ClassicApi(spark).busy_slots() or 0) < 1:  # sparkdl's own count of the slots that running tasks hold
            assert time.monotonic() < deadline, "the other job never started its task"
            time.sleep(0.1)
        # With the slot still taken when slot_wait_s runs out: a clear error, no task started.
        start = time.monotonic()
        with pytest.raises(sparkdl.InsufficientSlotsError) as info:
            sparkdl.run(allreduce_rank_sum, 1.0, num_workers=2, config=FAST.replace(slot_wait_s=1.5))
        assert time.monotonic() - start < 10
        msg = str(info.value)
        assert "has 2" in msg and "of which 1 are free" in msg and "slot_wait_s" in msg
        assert info.value.available == 1
        # When the other job ends within slot_wait_s, the run waits for the slot and goes ahead.
        releaser = threading.Timer(2.0, flag.touch)
        releaser.start()
        start = time.monotonic()
        out = sparkdl.run(allreduce_rank_sum, 1.0, num_workers=2, config=FAST.replace(slot_wait_s=30))
        assert out["value"] == 3.0 and out["attempt"] == 0
        assert time.monotonic() - start >= 1.5
        releaser.join()
    finally:
        flag.touch()
        sc.cancelJobGroup("another-job")
        blocker.join(timeout=30)
    assert not blocker.is_alive()


def test_gpu_without_gpu_confs_is_refused_before_launch(spark) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(sparkdl.ConfigError, match=r"spark\.task\.resource\.gpu\.amount"):
        sparkdl.run(sleep_forever, num_workers=1, use_gpu=True, config=FAST)


def test_a_conflicting_session_is_refused(spark) -> None:  # type: ignore[no-untyped-def]
    other = spark.newSession()
    with pytest.raises(sparkdl.ConfigError, match="not the active session"):
        sparkdl.run(sleep_forever, num_workers=1, spark=other, config=FAST)


def listening_sockets() -> list[tuple[str, int]]:
    import torch.distributed as dist

    dist.barrier()
    found = [
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]
    dist.barrier()
    return found


def test_every_listener_of_a_run_is_on_loopback(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    me = psutil.Process()
    driver_listeners: set[tuple[str, int]] = set()
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for c in me.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    driver_listeners.add((c.laddr.ip, c.laddr.port))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        rank0 = sparkdl.run(listening_sockets, num_workers=2, config=FAST)
    finally:
        stop.set()
        sampler.join()
    assert rank0, "rank 0 hosts the TCPStore, so it must listen somewhere"
    assert driver_listeners, "the driver's channel must have been seen listening"
    for ip, _ in [*rank0, *driver_listeners]:
        assert ip == "127.0.0.1", f"listener on {ip}, not loopback"


def logs_metrics(steps: int) -> str:
    import time

    ctx = sparkdl.context()
    for step in range(steps):
        ctx.log_metrics({"loss": 1.0 / (step + 1), "epoch": 0, "steps_per_epoch": steps}, step=step)
        time.sleep(0.02)
    return "done"


def test_metrics_reach_the_driver_with_progress_and_a_file(spark, tmp_path, capfd, no_leaks) -> None:  # type: ignore[no-untyped-def]
    import json

    cfg = FAST.replace(progress_interval_s=0.05)
    # The run directory, chosen on the running session (spark.conf.set) as on Spark Connect.
    spark.conf.set("spark.sparkdl.runDir", str(tmp_path / "runs"))
    try:
        result = sparkdl.launch(logs_metrics, 20, num_workers=2, config=cfg)
    finally:
        spark.conf.unset("spark.sparkdl.runDir")
    assert result.value == "done" and result.attempts == 1
    assert result.run_dir == str(tmp_path / "runs" / result.run_id)
    assert Path(result.metrics_path).parent == tmp_path / "runs" / result.run_id
    frame = result.metrics
    assert sorted(frame.groupby("rank").size().to_dict().items()) == [(0, 20), (1, 20)]
    rank0 = frame[frame["rank"] == 0].sort_values("step")
    assert rank0["loss"].tolist() == [1.0 / (s + 1) for s in range(20)]
    assert set(frame["attempt"]) == {0}
    assert result.metrics_path is not None
    lines = Path(result.metrics_path).read_text().splitlines()
    assert len(lines) == 40 and json.loads(lines[0])["rank"] in (0, 1)
    err = capfd.readouterr().err
    assert "sparkdl progress: attempt 0 | epoch 0 | step " in err and "loss " in err
    with pytest.raises(sparkdl.ConfigError, match="metric 'bad'"):
        sparkdl.RunContext(0, 1, 0, 1, 0, "x", "h", "torch", (), False).log_metrics({"bad": [1, 2]})


def steps_unevenly(ds: sparkdl.Dataset) -> None:
    import torch

    ctx = sparkdl.context()
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # No collective: each rank steps at its own pace, rank 1 ten times slower (a slow disk, say).
    state = sparkdl.TrainState(model, opt, ds.loader(4, seed=1))
    for _ in state.batches(epochs=1):
        time.sleep(0.02 if ctx.rank == 0 else 0.2)
        if ctx.rank == 0 and state.global_step == 120:
            raise RuntimeError("rank 0 stops at step 120")


def test_the_progress_line_and_the_report_name_the_straggler(spark, tmp_path, capfd, no_leaks) -> None:  # type: ignore[no-untyped-def]
    ds = sparkdl.write_dataset(spark.range(2000).selectExpr("cast(id as float) as x"), tmp_path / "ds", num_files=2)
    cfg = FAST.replace(progress_interval_s=0.2, max_attempts=1)
    with pytest.raises(sparkdl.RunFailedError) as info:
        sparkdl.run(steps_unevenly, ds, num_workers=2, config=cfg)
    # Rank 0 reached step ~100 by its last report, rank 1 step ~10: more than 1.5x behind.
    assert "Stragglers of attempt 0 (steps behind the median" in str(info.value), str(info.value)
    assert "RunConfig.straggler_factor=1.5): rank 1 at step " in str(info.value)
    err = capfd.readouterr().err
    assert "(min/median/max; slowest rank 1) | stragglers: ranks 1" in err, err[-2000:]


def small_model_with_metrics() -> dict[str, Any]:
    import torch

    ctx = sparkdl.context()
    for step in range(3):
        ctx.log_metrics({"loss": 3.0 - step}, step=step)
    torch.manual_seed(0)
    return torch.nn.Linear(2, 1).state_dict()


def test_metrics_and_the_model_go_to_mlflow_when_enabled(spark, tmp_path, monkeypatch, no_leaks) -> None:  # type: ignore[no-untyped-def]
    mlflow = pytest.importorskip("mlflow")
    import torch

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    # MLflow puts artifacts under ./mlruns of the working directory: keep them in tmp_path.
    monkeypatch.chdir(tmp_path)
    result = sparkdl.launch(small_model_with_metrics, num_workers=2, config=FAST.replace(mlflow=True))
    client = mlflow.tracking.MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name("Default").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_name == f"sparkdl-{result.run_id}"
    run_id = runs[0].info.run_id
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert history == [(0, 3.0), (1, 2.0), (2, 1.0)]  # rank 0's metrics, by step
    assert runs[0].data.params["sparkdl.num_workers"] == "2"
    local = client.download_artifacts(run_id, "model/model.pt", str(tmp_path))
    saved = torch.load(local, weights_only=True)
    assert all(torch.equal(saved[k], result.value[k]) for k in result.value)


def describe_rank_process(tag: str) -> dict[str, Any]:
    import numpy as np
    import torch

    me = psutil.Process()
    parent = me.parent()
    return {
        "tag": tag,
        "pid": me.pid,
        "name": me.name(),
        "cmdline": me.cmdline(),
        "parent_pid": parent.pid if parent else None,
        "parent_name": parent.name() if parent else None,
        "pgid": os.getpgid(0),
        "numpy_draw": float(np.random.rand()),
        "cuda_initialized": torch.cuda.is_initialized(),
        "cwd": os.getcwd(),
        "stdin_is_devnull": os.path.samefile("/proc/self/fd/0", os.devnull),
    }


def gather_rank_descriptions(tag: str) -> list[dict[str, Any]]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, describe_rank_process(tag))
    return out


def test_ranks_are_forked_from_a_warm_zygote_that_later_runs_reuse(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    first = sparkdl.run(gather_rank_descriptions, "a", num_workers=2, config=FAST)
    second = sparkdl.run(gather_rank_descriptions, "b", num_workers=2, config=FAST)
    for rank, desc in enumerate(first + second):
        # Each rank leads its own process group (so the task can kill all it started) under a
        # zygote, with its own name, stdin on /dev/null, and CUDA untouched until the rank uses it.
        assert desc["name"] == f"sparkdl-rank{rank % 2}", desc
        assert desc["parent_name"] == "sparkdl-zygote", desc
        assert desc["pgid"] == desc["pid"] and desc["stdin_is_devnull"] and not desc["cuda_initialized"]
    # The executor has one zygote, and it outlives a run: the second run forks from it too.
    assert len({d["parent_pid"] for d in first + second}) == 1
    # A forked rank draws fresh random seeds, as a fresh interpreter would: no two ranks and no
    # two runs share numpy's global stream.
    draws = [d["numpy_draw"] for d in first + second]
    assert len(set(draws)) == len(draws)


def _python_worker_pids(spark: Any) -> set[int]:
    """Runs 2 tasks that read all their input, so that Spark keeps their Python workers."""
    import pyarrow as pa

    def pid(batches: Any) -> Any:
        for _ in batches:
            pass
        yield pa.RecordBatch.from_pydict({"pid": [os.getpid()]})

    return {row.pid for row in spark.range(2).repartition(2).mapInArrow(pid, "pid long").collect()}


def _retire_python_workers(spark: Any) -> None:
    """Runs 2 tasks that return before reading their input, as TorchDistributor's do: Spark then
    ends their Python workers instead of reusing them."""
    import pyarrow as pa

    def unread(batches: Any) -> Any:
        yield pa.RecordBatch.from_pydict({"pid": [os.getpid()]})

    spark.range(2).repartition(2).mapInArrow(unread, "pid long").collect()


def test_the_zygote_outlives_the_python_workers_that_spark_retires(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    first = sparkdl.run(gather_rank_descriptions, "a", num_workers=2, config=FAST)
    workers = _python_worker_pids(spark)
    _retire_python_workers(spark)
    assert not workers & _python_worker_pids(spark), "Spark was expected to start new Python workers"
    second = sparkdl.run(gather_rank_descriptions, "b", num_workers=2, config=FAST)
    # New Python workers, the same warm zygote: the run after a TorchDistributor job or an idle
    # minute does not import torch again.
    assert {d["parent_name"] for d in second} == {"sparkdl-zygote"}
    assert {d["parent_pid"] for d in second} == {d["parent_pid"] for d in first}


ZYGOTE_LIFETIME_SCRIPT = """
import os, sys
import sparkdl
from pyspark.sql import SparkSession

spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
         .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1").getOrCreate())
print("zygote", sparkdl.run(os.getppid, num_workers=2, config=sparkdl.RunConfig(echo_logs=False)), flush=True)
spark.stop()
print("stopped", flush=True)
sys.stdin.read()  # the driver stays up until the test has looked
"""


def test_the_zygote_ends_when_its_executor_stops(tmp_path: Path) -> None:
    script = tmp_path / "lifetime.py"
    script.write_text(ZYGOTE_LIFETIME_SCRIPT)
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env=env, text=True,
    )
    try:
        assert proc.stdout is not None
        lines = iter(proc.stdout.readline, "")
        zygote_pid = next(int(line.split()[1]) for line in lines if line.startswith("zygote "))
        zygote = psutil.Process(zygote_pid)
        assert zygote.name() == "sparkdl-zygote"
        assert next(lines).strip() == "stopped"
        # The driver process lives on; the SparkContext stopped, and with it the executor's
        # PySpark daemon, which is what the zygote watches.
        deadline = time.monotonic() + 20
        while zygote.is_running() and zygote.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the zygote outlived its executor"
            time.sleep(0.1)
        assert proc.poll() is None
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_lost_zygote_is_replaced_and_prewarm_false_starts_fresh_interpreters(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    before = sparkdl.run(gather_rank_descriptions, "warm", num_workers=2, config=FAST)
    zygotes = [psutil.Process(pid) for pid in {d["parent_pid"] for d in before}]
    for z in zygotes:
        z.kill()
    psutil.wait_procs(zygotes, timeout=10)
    after = sparkdl.run(gather_rank_descriptions, "again", num_workers=2, config=FAST)
    assert all(d["parent_name"] == "sparkdl-zygote" for d in after)
    assert not {d["parent_pid"] for d in after} & {d["parent_pid"] for d in before}

    cold = sparkdl.run(gather_rank_descriptions, "cold", num_workers=2, config=FAST.replace(prewarm=False))
    for desc in cold:
        assert desc["cmdline"][-3:-1] == ["-m", "sparkdl._internal.rank"], desc
        assert desc["parent_name"] != "sparkdl-zygote"
