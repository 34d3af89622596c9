"""sparkdl.run on local-cluster: ranks on separate executor JVMs, and GPU assignment on CPUs.

GPU scheduling is tested the way Spark's own tests do it: a discovery script that reports fake
GPU addresses. Each fake worker owns addresses of its own (0,1 and 2,3), and what each executor
was allocated is read from Spark's side (its resources file), so a rank that saw another task's
or another executor's GPU, or the same GPU as a neighbour, fails the test.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import cloudpickle
import psutil
import pytest
from conftest import needs_session

import sparkdl

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.spark, pytest.mark.cluster]

CFG = sparkdl.RunConfig(start_timeout_s=90, slot_wait_s=60, connect_timeout_s=30)


def _gpu_conf(script: str, per_task: int) -> dict[str, str]:
    """Two GPUs per worker and per executor (2 cores each), ``per_task`` per task."""
    return {
        "spark.worker.resource.gpu.amount": "2",
        "spark.worker.resource.gpu.discoveryScript": script,
        "spark.executor.resource.gpu.amount": "2",
        "spark.task.resource.gpu.amount": str(per_task),
        "spark.executor.memory": "512m",
    }


@pytest.fixture(scope="module")
def gpu_script(fake_gpus):  # type: ignore[no-untyped-def]
    return fake_gpus(2)


@pytest.fixture
@needs_session("local-cluster[2,2,1024] with two fake GPUs per executor, one per task")
def gpu_cluster(spark_session, gpu_script):  # type: ignore[no-untyped-def]
    return spark_session("local-cluster[2,2,1024]", _gpu_conf(gpu_script, 1))


@pytest.fixture
@needs_session("local-cluster[2,2,1024] with two fake GPUs per executor, two per task")
def two_gpus_per_task(spark_session, gpu_script):  # type: ignore[no-untyped-def]
    return spark_session("local-cluster[2,2,1024]", _gpu_conf(gpu_script, 2))


def who_am_i() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    ctx = sparkdl.context()
    t = torch.tensor([ctx.rank + 1.0])
    dist.all_reduce(t)
    facts = {
        "rank": ctx.rank,
        "sum": t.item(),
        "executor_pid": next(
            p.pid
            for p in psutil.Process(int(os.environ["SPARKDL_TASK_PID"])).parents()
            if p.name().startswith("java")
        ),
        "zygote_pid": os.getppid(),
        "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "gpu_ids": list(ctx.gpu_ids),
        "local_rank": ctx.local_rank,
        "device": str(ctx.device),
    }
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, facts)
    return {"ranks": everyone}


# The session fixture comes before no_leaks, so Spark's own listeners exist before the snapshot.
def test_ranks_run_on_separate_executors(local_cluster, no_leaks) -> None:  # type: ignore[no-untyped-def]
    out = sparkdl.run(who_am_i, num_workers=2, config=CFG)
    ranks = out["ranks"]
    assert [r["sum"] for r in ranks] == [3.0, 3.0]
    # Each rank runs under a different executor JVM, forked by that executor's own zygote.
    assert ranks[0]["executor_pid"] != ranks[1]["executor_pid"]
    assert ranks[0]["zygote_pid"] != ranks[1]["zygote_pid"]
    assert all(r["cuda_visible"] == "" and r["device"] == "cpu" for r in ranks)


def test_each_rank_sees_exactly_the_gpu_spark_assigned(
    gpu_cluster, executor_gpus, no_leaks, capfd
) -> None:  # type: ignore[no-untyped-def]
    out = sparkdl.run(who_am_i, num_workers=4, config=CFG)  # use_gpu: auto from the confs
    ranks = out["ranks"]
    allocated = executor_gpus()  # Spark's side: executor JVM pid -> its GPUs
    assert len(allocated) == 2 and not set.intersection(*allocated.values()), allocated
    for r in ranks:
        # One GPU, one the rank's own executor was given, shown to the rank as its only device.
        assert r["cuda_visible"] in allocated[r["executor_pid"]], (r, allocated)
        assert r["gpu_ids"] == [r["cuda_visible"]]
        assert r["local_rank"] == 0
        # torch here is a CPU build: the rank warns and runs on the CPU.
        assert r["device"] == "cpu"
    # Two tasks per executor, each with a GPU of its own: no two ranks share one.
    assert len({r["cuda_visible"] for r in ranks}) == 4
    _, err = capfd.readouterr()
    assert "torch.cuda.is_available() is False" in err


def test_a_task_with_two_gpus_gives_its_rank_both(
    two_gpus_per_task, executor_gpus, no_leaks
) -> None:  # type: ignore[no-untyped-def]
    out = sparkdl.run(who_am_i, num_workers=2, config=CFG)
    allocated = executor_gpus()
    ranks = out["ranks"]
    assert len({r["executor_pid"] for r in ranks}) == 2
    for r in ranks:
        # The whole executor's pair, in Spark's order, as cuda:0 and cuda:1 of one rank.
        assert set(r["gpu_ids"]) == allocated[r["executor_pid"]], (r, allocated)
        assert r["cuda_visible"] == ",".join(r["gpu_ids"])
        assert r["local_rank"] == 0


def test_too_many_gpu_workers_fail_fast_naming_gpu_confs(gpu_cluster, no_leaks) -> None:  # type: ignore[no-untyped-def]
    cfg = sparkdl.RunConfig(slot_wait_s=2)
    with pytest.raises(
        sparkdl.InsufficientSlotsError, match=r"spark\.task\.resource\.gpu\.amount=1"
    ):
        sparkdl.run(who_am_i, num_workers=5, config=cfg)


def torchrun_facts() -> dict[str, Any]:
    """What code written for torchrun reads, as Spark's TorchDistributor runs it (init included)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    env = os.environ
    facts = {key: env.get(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                           "CUDA_VISIBLE_DEVICES", "SPARKDL_TASK_PID")}
    facts["pid"] = os.getpid()
    facts["device"] = str(sparkdl.context().device)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, facts)
    dist.destroy_process_group()
    return {"ranks": everyone}


def test_torch_distributor_runs_a_process_per_gpu_of_each_task_as_sparks_does(
    two_gpus_per_task, executor_gpus, no_leaks
) -> None:  # type: ignore[no-untyped-def]
    from pyspark.ml.torch.distributor import TorchDistributor as SparkTD

    kwargs = {"num_processes": 4, "local_mode": False, "use_gpu": True}
    distributor = sparkdl.TorchDistributor(**kwargs, config=CFG)
    # Four GPUs in all, two a task: two tasks of two processes (torchrun's --nproc_per_node=2).
    assert distributor.input_params == SparkTD(**kwargs).input_params
    assert distributor.num_tasks == 2
    ranks = distributor.run(torchrun_facts)["ranks"]
    allocated = executor_gpus()
    assert [r["RANK"] for r in ranks] == ["0", "1", "2", "3"] and {r["WORLD_SIZE"] for r in ranks} == {"4"}
    assert len({r["pid"] for r in ranks}) == 4  # a process of its own for each rank
    for task in (ranks[:2], ranks[2:]):
        # The two ranks of a task: one Spark task (and worker), its two GPUs seen by both, in
        # Spark's order, each rank its own LOCAL_RANK (its device; cpu here, a CPU build of torch).
        assert task[0]["SPARKDL_TASK_PID"] == task[1]["SPARKDL_TASK_PID"]
        assert [(r["LOCAL_RANK"], r["LOCAL_WORLD_SIZE"]) for r in task] == [("0", "2"), ("1", "2")]
        assert task[0]["CUDA_VISIBLE_DEVICES"] == task[1]["CUDA_VISIBLE_DEVICES"]
        assert set(task[0]["CUDA_VISIBLE_DEVICES"].split(",")) in allocated.values(), (task, allocated)
    assert ranks[0]["SPARKDL_TASK_PID"] != ranks[2]["SPARKDL_TASK_PID"]
    assert ranks[0]["CUDA_VISIBLE_DEVICES"] != ranks[2]["CUDA_VISIBLE_DEVICES"]


def last_rank_fails_first(tmp: str) -> list[int]:
    import time

    import torch
    import torch.distributed as dist

    ctx = sparkdl.context()
    if ctx.attempt == 0 and ctx.rank == ctx.world_size - 1:
        raise RuntimeError("the last rank fails in attempt 0")
    if ctx.attempt == 0 and ctx.rank == ctx.world_size - 2:
        # Its sibling in the same task is busy outside any collective: no peer's failure reaches
        # it. Only the task ending its ranks ends it (else the run's timeout_s would stop the run).
        time.sleep(600)
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    with open(f"{tmp}/attempt{ctx.attempt}-rank{ctx.rank}", "w") as f:
        f.write(str(os.getpid()))
    return [ctx.attempt, int(t.item())]


def test_a_failed_rank_ends_its_tasks_other_ranks_and_the_gang_reruns(local_cluster, no_leaks, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = CFG.replace(processes_per_task=2, timeout_s=120, max_attempts=2)
    result = sparkdl.launch(last_rank_fails_first, str(tmp_path), num_workers=4, config=cfg)
    assert result.value == [1, 6]
    assert result.attempts == 2 and result.world_sizes == [4, 4]
    # Attempt 0's surviving ranks never passed the all-reduce; attempt 1's four all did.
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"attempt1-rank{r}" for r in range(4)]
