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


@pytest.fixture
def cluster(spark_session):  # type: ignore[no-untyped-def]
    return spark_session("local-cluster[2,1,1024]", {"spark.executor.memory": "512m"})


@pytest.fixture(scope="module")
def gpu_script(fake_gpus):  # type: ignore[no-untyped-def]
    return fake_gpus(2)


@pytest.fixture
def gpu_cluster(spark_session, gpu_script):  # type: ignore[no-untyped-def]
    return spark_session("local-cluster[2,2,1024]", _gpu_conf(gpu_script, 1))


@pytest.fixture
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
def test_ranks_run_on_separate_executors(cluster, no_leaks) -> None:  # type: ignore[no-untyped-def]
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
