"""The ``sparkdl`` command line, run as a real subprocess (``python -m sparkdl``), where it
starts a JVM: ``sparkdl doctor`` on the driver alone with the real Java, and ``sparkdl run`` of a
torchrun script on Spark.

``sparkdl doctor`` against a real standalone cluster (executors, GPUs, slots) is in
tests/cluster/test_standalone.py; the parser, the usage errors and the doctor without a real
Java are in tests/unit/cli/test_cli_usage.py.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from conftest import path_without
from resources.cli_command import sparkdl


def test_doctor_on_the_driver_passes_here() -> None:
    out = sparkdl("doctor", "--no-spark")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
    for name in ("java", "python", "pyspark", "torch", "pyarrow", "numpy", "horovod", "petastorm", "gpus"):
        assert name in rows, out.stdout
    assert rows["java"].rstrip().endswith("ok") and rows["torch"].rstrip().endswith("ok")
    assert "0 error(s)" in out.stdout


SCRIPT = '''\
"""A torchrun-style script: argv in, torch.distributed, a file out; rank 1 fails once."""
import argparse
import json
import os
import re
import sys

import torch
import torch.distributed as dist

import helper  # a module next to the script, found as under torchrun

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--lr", type=float, required=True)
p.add_argument("--fail-once", required=True)
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if rank == 1 and not os.path.exists(args.fail_once):
    open(args.fail_once, "w").close()
    print("rank 1 fails on purpose", flush=True)
    sys.exit(3)
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
print(f"rank {rank} of {world}: sum {total.item()}", flush=True)
if rank == 0:
    with open(args.out, "w") as f:
        json.dump({"sum": total.item(), "world": world, "lr": args.lr, "argv": sys.argv[1:],
                   "helper": helper.VALUE, "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}}, f)
'''


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_run_a_torchrun_script_on_two_spark_workers_with_a_rerun(tmp_path: Path, no_leaks: None) -> None:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "train.py").write_text(SCRIPT)
    (scripts / "helper.py").write_text("VALUE = 42\n")
    work = tmp_path / "work"
    work.mkdir()
    out = sparkdl(
        "run", "-n", "2", "--max-attempts", "2", "--timeout", "120", "--conf", "spark.ui.enabled=false",
        str(scripts / "train.py"), "--out", "result.json", "--lr", "0.1", "--fail-once", "failed-once",
        cwd=work, timeout=280,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    # Relative paths in the script's arguments resolved against the command's directory.
    result = json.loads((work / "result.json").read_text())
    assert (work / "failed-once").exists()
    assert result["sum"] == 3.0 and result["world"] == 2 and result["lr"] == 0.1 and result["helper"] == 42
    assert result["argv"] == ["--out", "result.json", "--lr", "0.1", "--fail-once", "failed-once"]
    assert result["env"] == {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    # The ranks' output reached the console, tagged; the second attempt is marked.
    assert "[rank 1] rank 1 fails on purpose" in out.stdout
    assert "[rank 1, attempt 1] rank 1 of 2: sum 3.0" in out.stdout


HOROVOD_SCRIPT = '''\
"""Written for horovodrun: hvd.init(), a shard by hvd.rank(), an allreduce."""
import horovod.torch as hvd
import torch

hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
print(f"horovod rank {hvd.rank()} of {hvd.size()}: sum {total.item()}", flush=True)
'''


@pytest.mark.spark
@pytest.mark.timeout(240)
def test_run_a_horovodrun_script_as_one_horovod_job(tmp_path: Path, no_leaks: None) -> None:
    pytest.importorskip("horovod.torch")
    (tmp_path / "hvd_train.py").write_text(HOROVOD_SCRIPT)
    out = sparkdl("run", "-n", "2", "--backend", "horovod", "--timeout", "120", "--conf", "spark.ui.enabled=false",
                  "hvd_train.py", cwd=tmp_path, timeout=220)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    # One job of two ranks, not two jobs of one (which --backend torch refuses: test_cli_usage.py).
    assert "[rank 0] horovod rank 0 of 2: sum 3.0" in out.stdout, out.stdout[-3000:]
    assert "[rank 1] horovod rank 1 of 2: sum 3.0" in out.stdout


# ---- Horovod's MPI controller (RunConfig(horovod_controller='mpi')): optional, so info at most ----


def _row(stdout: str, name: str) -> str:
    """The table row of check ``name`` (names are one or two words)."""
    return next((line for line in stdout.splitlines() if line.startswith(name + " ")), "")


@pytest.mark.spark
@pytest.mark.timeout(240)
def test_doctor_reports_the_mpi_controller_on_the_driver_and_the_executors() -> None:
    from sparkdl._internal.backends.horovod.horovod_mpi import check_mpi
    from sparkdl._internal.common.errors import BackendUnavailableError

    try:
        expected = check_mpi()  # "Horovod 0.28.1, Open MPI 4.1.4" here
    except BackendUnavailableError as exc:
        pytest.skip(f"Horovod's MPI controller cannot run here: {exc}")
    assert "Open MPI 4." in expected
    out = sparkdl("doctor", "--master", "local[2]", "--conf", "spark.ui.enabled=false", "--timeout", "120", timeout=220)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    row = _row(out.stdout, "mpi controller")
    assert re.split(r"\s{2,}", row.strip())[1:] == [expected, f"{expected} on 1/1", "ok"], out.stdout  # local: 1 executor
    assert "mpi controller:" not in out.stdout  # no problem said
    # The row sits next to Horovod's own.
    lines = out.stdout.splitlines()
    assert lines.index(row) == lines.index(_row(out.stdout, "horovod")) + 1


def test_doctor_says_why_the_mpi_controller_cannot_run_without_failing(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": path_without(tmp_path, "mpirun", "orted")}
    out = sparkdl("doctor", "--no-spark", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    row = _row(out.stdout, "mpi controller")
    assert row.rstrip().endswith("info"), out.stdout
    if not _row(out.stdout, "horovod").rstrip().endswith("ok"):
        # Without a usable Horovod its own row says so; the MPI row adds no second problem.
        assert "needs horovod" in row and "mpi controller:" not in out.stdout, out.stdout
        return
    assert "unavailable" in row
    assert ("[info] mpi controller: optional: needed only for RunConfig(horovod_controller='mpi'); "
            "on this machine: no mpirun or orted on the PATH") in out.stdout
    assert "apt-get install openmpi-bin libopenmpi-dev" in out.stdout and "sparkdl conf build-horovod --path" in out.stdout
