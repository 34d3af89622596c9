"""``tools/gpu-check --cpu``, run as CI runs it, in a world where pyspark cannot be imported.

The GPU machines it is written for have torch, pyarrow and numpy but no pyspark and no Java. A
directory on ``PYTHONPATH`` holding a ``pyspark`` package that raises ImportError stands in for
that here: the driver and every rank it starts see it before the installed pyspark.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.wire.rankspec import (
    GangSpec,
    RankSpec,
    RunSpec,
    gang_env,
    rank_env,
    read_gang,
    read_rank,
)

ROOT = REPO
CUDA_ONLY = {
    "a rank with 2 GPUs (spark.task.resource.gpu.amount=2)",
    "process group, CUDA tensors (nccl)",
    "loader pins memory for cpu",
    "TorchModel scoring function on cuda",
    "nvJPEG decode against the CPU decoder",
    "nvJPEG images per second against the CPU decoder",
    "ResNet-18 at 224 px fed by nvJPEG, data wait",
    "ResNet-50 at 224 px fed by nvJPEG, data wait",
    "DALI decode on the GPU against the CPU decoder",
}


@pytest.mark.both_stacks("tools/gpu-check reads Parquet and scores through sparkdl.data and sparkdl.ml (pyarrow, pandas)")
@pytest.mark.usefixtures("no_leaks")
def test_gpu_check_on_the_cpu_passes_every_check_but_the_cuda_ones_without_pyspark(tmp_path: Path) -> None:
    blocker = tmp_path / "no-pyspark" / "pyspark"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text('raise ImportError("pyspark is not installed on this machine (test)")\n')
    env = {**os.environ, "PYTHONPATH": str(blocker.parent), "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    proc = subprocess.run([str(ROOT / "tools" / "gpu-check"), "--cpu"], env=env, capture_output=True, text=True,
                          timeout=240)
    out = proc.stdout + proc.stderr
    results = {m.group(2): m.group(1) for m in re.finditer(r"^(PASS|FAIL|SKIP)  ([^:]+):", proc.stdout, re.M)}
    assert proc.returncode == 0, out
    assert not [n for n, s in results.items() if s == "FAIL"], out
    assert {n for n, s in results.items() if s == "SKIP"} == CUDA_ONLY, out
    for name in (
        "no pyspark on the path",
        "ranks get CUDA_VISIBLE_DEVICES from their addresses",
        "rank environment",
        "process group, CPU tensors (gloo)",
        "DDP training step on cpu",
        "TrainState checkpoint and resume on cpu",
        "loader to_device=True feeds cpu",
        "data wait (to_device)",
        "TorchModel scoring function (cpu)",
    ):
        assert results.get(name) == "PASS", f"{name}: {results.get(name)}\n{out}"
    assert "pyspark not importable here" in proc.stdout, out
    assert re.search(r"to_device: \d+ steps in [\d.]+ s, +[\d.]+ steps/s \([\d.]+x in memory\), data wait [\d.]+%", proc.stdout), out
    # Nothing left behind: the check's data, the ranks' directories and their checkpoints (the
    # user's private sparkdl directory stays, empty; torch keeps a cache directory of its own).
    left = []
    for p in tmp_path.rglob("*"):
        rel = p.relative_to(tmp_path).parts
        if rel[0] == "no-pyspark" or rel[0].startswith("torchinductor"):
            continue
        if p.is_file() or len(rel) > 2:  # sparkdl-<uid>/runs may stay, empty
            left.append("/".join(rel))
    assert not left, out


def test_a_rank_with_two_gpus_sees_both_and_is_local_rank_0_of_1() -> None:
    # spark.task.resource.gpu.amount=2: one rank per task drives both GPUs (torchrun with
    # --nproc_per_node=1 on each task), even when other ranks share its host.
    run = RunSpec("r1", 3, "torch", True, "file:///ckpt", RunConfig())
    spec = RankSpec.of(run, rank=2, host="h", gpu_ids=["2", "3"], task_pid=1)
    gang = GangSpec.form(spec, attempt=0, hosts=["h", "g", "h"], master_port=1)
    env = {**rank_env(spec), **gang_env(spec, gang)}
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["RANK"], env["WORLD_SIZE"]) == ("0", "1", "2", "3")
    assert read_rank(env).gpu_ids == ("2", "3") and read_gang(env) == gang
