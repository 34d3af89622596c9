"""sparkdl.run on local-cluster: ranks on separate executor JVMs, and GPU assignment on CPUs.

GPU scheduling is tested the way Spark's own tests do it: a discovery script that reports fake
GPU addresses, so that Spark assigns one "GPU" per task and sparkdl must pass exactly that one
to its rank through CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import cloudpickle
import psutil
import pytest

import sparkdl

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.spark, pytest.mark.cluster]

FAKE_GPUS = str(Path(__file__).parent / "resources" / "fake-gpus.sh")
CFG = sparkdl.RunConfig(start_timeout_s=90, slot_wait_s=60, connect_timeout_s=30)
GPU_CONF = {
    "spark.worker.resource.gpu.amount": "2",
    "spark.worker.resource.gpu.discoveryScript": FAKE_GPUS,
    "spark.executor.resource.gpu.amount": "1",
    "spark.executor.resource.gpu.discoveryScript": FAKE_GPUS,
    "spark.task.resource.gpu.amount": "1",
    "spark.executor.memory": "512m",
}


@pytest.fixture
def cluster(spark_session):  # type: ignore[no-untyped-def]
    return spark_session("local-cluster[2,1,1024]", {"spark.executor.memory": "512m"})


@pytest.fixture
def gpu_cluster(spark_session):  # type: ignore[no-untyped-def]
    return spark_session("local-cluster[2,1,1024]", GPU_CONF)


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
            p.pid for p in psutil.Process(int(os.environ["SPARKDL_TASK_PID"])).parents() if p.name().startswith("java")
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


def test_each_rank_sees_exactly_the_gpu_spark_assigned(gpu_cluster, no_leaks, capfd) -> None:  # type: ignore[no-untyped-def]
    out = sparkdl.run(who_am_i, num_workers=2, config=CFG)  # use_gpu: auto from the confs
    ranks = out["ranks"]
    for r in ranks:
        assert r["cuda_visible"] in ("0", "1")
        assert r["gpu_ids"] == [r["cuda_visible"]]
        assert r["local_rank"] == 0
        # torch here is a CPU build: the rank warns and runs on the CPU.
        assert r["device"] == "cpu"
    _, err = capfd.readouterr()
    assert "torch.cuda.is_available() is False" in err


def test_too_many_gpu_workers_fail_fast_naming_gpu_confs(gpu_cluster, no_leaks) -> None:  # type: ignore[no-untyped-def]
    cfg = sparkdl.RunConfig(slot_wait_s=2)
    with pytest.raises(sparkdl.InsufficientSlotsError, match=r"spark\.task\.resource\.gpu\.amount=1"):
        sparkdl.run(who_am_i, num_workers=3, config=cfg)
