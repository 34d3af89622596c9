"""TorchModel.transform on local-cluster with fractional GPUs, tested on CPUs as Spark does.

Each fake worker owns one GPU address of its own (a discovery script that hands out 0, then 1),
and ``spark.task.resource.gpu.amount=0.25`` lets four tasks share it. Each task must score on the
address Spark gave it (here: report that it falls back to the CPU, naming that address, since
this torch has no CUDA), and each Python worker must unpickle the model once, however many tasks
it serves.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest
import torch
from conftest import needs_session

from sparkdl import TorchModel

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.spark, pytest.mark.cluster]


class WhereNet(torch.nn.Module):
    """Records each load (per pid) and, per forward, the pid, partition and Spark's GPU address."""

    def __init__(self, log_dir: str) -> None:
        super().__init__()
        self.log_dir = log_dir
        torch.manual_seed(5)
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pyspark import TaskContext

        tc = TaskContext.get()
        address = tc.resources()["gpu"].addresses[0]
        with open(os.path.join(self.log_dir, f"forward-{os.getpid()}"), "a") as f:
            f.write(f"{tc.partitionId()} {address} {x.device}\n")
        return self.linear(x)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        with open(os.path.join(self.log_dir, f"load-{os.getpid()}"), "a") as f:
            f.write("load\n")


def _executor_stderr(app_id: str) -> dict[str, str]:
    """Each executor's stderr in local-cluster's work dir (SPARK_HOME/work/<app>/<executor>/stderr)."""
    import pyspark

    homes = {Path(os.environ.get("SPARK_HOME", "")), Path(pyspark.__file__).parent}
    files = [p for home in homes for p in (home / "work" / app_id).glob("*/stderr")]
    return {p.parent.name: p.read_text(errors="replace") for p in files}


@pytest.fixture
@needs_session("local-cluster[2,4,1024] with one fake GPU per executor, a quarter per task")
def quarter_gpus(spark_session, fake_gpus):  # type: ignore[no-untyped-def]
    return spark_session("local-cluster[2,4,1024]", {
        "spark.worker.resource.gpu.amount": "1",
        "spark.worker.resource.gpu.discoveryScript": fake_gpus(1),
        "spark.executor.resource.gpu.amount": "1",
        "spark.task.resource.gpu.amount": "0.25",
        "spark.executor.memory": "512m",
    })


@pytest.mark.one_stack("modern", "fractional GPU slots take the same scoring path as whole ones, which "
                        "tests/integration/test_ml.py walks on both stacks; the resource profile is Spark's")
def test_fractional_gpus_each_task_its_address_one_load_per_worker(quarter_gpus, tmp_path) -> None:  # type: ignore[no-untyped-def]
    spark = quarter_gpus
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    rng = np.random.default_rng(2)
    x = rng.normal(size=(1600, 4)).astype(np.float32)
    df = spark.createDataFrame(
        [(i, x[i].tolist()) for i in range(len(x))], "id long, features array<float>"
    ).repartition(16)
    net = WhereNet(str(log_dir))
    model = TorchModel(model=net, task="classification", inferenceBatchSize=64)
    with torch.no_grad():
        want = net.linear(torch.from_numpy(x)).argmax(dim=1).double().tolist()

    for _ in range(2):  # two jobs: the second reuses the workers (and their models) of the first
        got = {
            r["id"]: r["prediction"]
            for r in model.transform(df).select("id", "prediction").collect()
        }
        assert [got[i] for i in range(len(x))] == want

    forwards = {
        int(p.name.split("-")[1]): [line.split() for line in p.read_text().splitlines()]
        for p in log_dir.glob("forward-*")
    }
    by_address: dict[str, set[int]] = {}
    for pid, lines in forwards.items():
        for _, address, device in lines:
            by_address.setdefault(address, set()).add(pid)
            assert device == "cpu"
    # Two executors, each with its own GPU, shared by the tasks running on it.
    assert sorted(by_address) == ["0", "1"], by_address
    assert not by_address["0"] & by_address["1"], "one Python worker served tasks of both executors"

    loads = {int(p.name.split("-")[1]): p.read_text().split() for p in log_dir.glob("load-*")}
    assert set(loads) == set(forwards), "a worker scored without loading, or loaded without scoring"
    assert all(len(v) == 1 for v in loads.values()), f"a worker unpickled the model twice: {loads}"
    assert 2 * df.rdd.getNumPartitions() > len(loads), (
        "every task loaded the model: no per-worker cache"
    )

    # Every worker said, once, which GPU it was given and that it scores on the CPU instead. A
    # worker's stderr reaches the executor's log file through two copying threads (the executor's
    # and its Worker's), so the lines may land a moment after the job: wait for them, bounded.
    want_said = {(address, pid) for address, pids in by_address.items() for pid in pids}
    deadline = time.monotonic() + 30
    while True:
        told = re.findall(
            r"sparkdl: Spark gave this task GPU (\d+), .* \(pid (\d+)\)",
            "\n".join(_executor_stderr(spark.sparkContext.applicationId).values()),
        )
        said = {(address, int(pid)) for address, pid in told}
        if said >= want_said or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert said == want_said
    assert len(told) == len(said), "a worker repeated the CPU fallback message"
