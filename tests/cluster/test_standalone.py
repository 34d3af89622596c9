"""The jobs and ``sparkdl doctor`` against a real Spark standalone cluster on loopback.

A master and two workers (1 core, 1 GB each) are started with spark-class by
tools/standalone_cluster.py, every socket on 127.0.0.1. The jobs are submitted the way a user
submits them, ``spark-submit --master spark://127.0.0.1:PORT jobs/<job>.py`` in client mode,
each its own driver process, with executors on both workers. At the end every process the
cluster started is stopped, and the test asserts that none is left and no port still listens.

The workers also offer fake GPUs (tests/resources/fake-gpus.sh), the way a GPU cluster's workers
offer real ones with conf/gpu-discovery.sh; applications that ask for none are not affected.

Where namespaced hosts can be made (root), tests/cluster/test_netns_hosts.py makes every assertion
of this module on two hosts instead, and this module is skipped unless ``--every-stack`` is given.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import standalone_cluster as sc_mod
from conftest import REPO
from resources.digits_jobs import check_scored, check_trained

ROOT = REPO
FAKE_GPUS = ROOT / "tests" / "resources" / "fake-gpus.sh"
JOB_TIMEOUT_S = 300

pytestmark = [pytest.mark.spark, pytest.mark.cluster]




@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[Any]:
    import netns_cluster

    # Where namespaced hosts can be made, tests/cluster/test_netns_hosts.py runs the same jobs and the
    # same doctor checks, with every assertion made here, on a standalone cluster of two hosts: this
    # loopback one is for the machines that cannot (not root), for --every-stack, and for the stack
    # that leaves the namespaced hosts to the other (their one_stack marker).
    from conftest import NETNS_STACK, current_stack, running_stacks

    hosts_here = set(running_stacks()) != {"modern", "classic"} or current_stack() == NETNS_STACK
    if netns_cluster.NetnsCluster.available() is None and hosts_here and not request.config.getoption("--every-stack"):
        pytest.skip("the namespaced hosts run these (tests/cluster/test_netns_hosts.py: test_the_jobs_by_spark_submit, "
                    "test_doctor_names_both_hosts_the_shared_directories_the_gpus_and_missing_slots)")
    c = sc_mod.StandaloneCluster(
        2, cores=1, memory="1g", python=sys.executable, start_timeout_s=60,
        worker_opts=["-Dspark.worker.resource.gpu.amount=2", f"-Dspark.worker.resource.gpu.discoveryScript={FAKE_GPUS}"],
    )
    c.start()
    try:
        yield c
    finally:
        pids = c.pids()
        alive = c.stop()
        c.cleanup()
        # Every daemon, executor and Python worker of the cluster is gone, and nothing listens.
        assert alive == [], f"left running: {alive}"
        assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert [p for p in c.ports if sc_mod.port_open(p)] == []


def submit(cluster: Any, job: str, *args: str, spark_confs: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``spark-submit`` of jobs/<job>.py to the cluster, in client mode, from the repository root."""
    confs = {
        "spark.executor.memory": "512m",
        "spark.driver.memory": "512m",
        "spark.cores.max": "2",
        "spark.ui.enabled": "false",
        "spark.pyspark.python": sys.executable,
        "spark.pyspark.driver.python": sys.executable,
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile={(ROOT / 'conf' / 'log4j2.properties').as_uri()}",
        **(spark_confs or {}),
    }
    cmd = [cluster.spark_submit, "--master", cluster.master_url, "--deploy-mode", "client",
           "--properties-file", str(ROOT / "conf" / "spark-defaults.conf")]
    for key, value in confs.items():
        cmd += ["--conf", f"{key}={value}"]
    cmd += [str(ROOT / "jobs" / f"{job}.py"), *args]
    result = subprocess.run(cmd, cwd=ROOT, env=cluster.env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert result.returncode == 0, f"{job} exited {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return result


def finished_apps(cluster: Any, name: str) -> list[dict[str, Any]]:
    status = cluster.status() or {}
    return [a for a in status.get("completedapps", []) if a.get("name") == name]


def wait_finished(cluster: Any, name: str, count: int) -> list[dict[str, Any]]:
    """The master lists the application as completed (its executors released) within 30 s."""
    deadline = time.monotonic() + 30
    while len(apps := finished_apps(cluster, name)) < count and time.monotonic() < deadline:
        time.sleep(0.25)
    return apps


def test_jobs_via_spark_submit(cluster: Any, tmp_path: Path) -> None:
    data, model, out = tmp_path / "digits", tmp_path / "model", tmp_path / "predictions"

    etl = submit(cluster, "etl", "--data", str(data))
    assert "1445 training rows" in etl.stdout
    assert (data / "train" / "_sparkdl_manifest.json").is_file()
    apps = wait_finished(cluster, "sparkdl-etl-digits", 1)
    assert apps and apps[0]["cores"] == 2, apps  # both workers' executors took part

    train = submit(cluster, "train", "--data", str(data), "--model", str(model), "--epochs", "5",
                   "--min-accuracy", "0.85")
    summary = check_trained(model, train.stdout + train.stderr)
    # The two ranks ran as tasks of executors on both workers.
    assert wait_finished(cluster, "sparkdl-train-digits", 1)[0]["cores"] == 2

    inference = submit(cluster, "inference", "--model", str(model), "--input", str(data / "test"),
                       "--output", str(out))
    assert "352 rows" in inference.stdout
    check_scored(out, summary)


def test_doctor_reports_both_executors_the_gpus_and_missing_slots(cluster: Any) -> None:
    # Each executor asks for one of its worker's (fake) GPUs and each task for one: Spark assigns
    # them, but torch here is a CPU build, and 3 ranks do not fit 2 slots. Both are errors.
    cmd = [sys.executable, "-m", "sparkdl", "doctor", "--master", cluster.master_url, "-n", "3", "--timeout", "120"]
    for key, value in {
        "spark.executor.memory": "512m", "spark.cores.max": "2", "spark.ui.enabled": "false",
        "spark.pyspark.python": sys.executable, "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1", "spark.executor.resource.gpu.amount": "1",
        "spark.task.resource.gpu.amount": "1",
    }.items():
        cmd += ["--conf", f"{key}={value}"]
    result = subprocess.run(cmd, cwd=ROOT, env=cluster.env(), capture_output=True, text=True, timeout=240)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr[-3000:]
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "2 reached" in rows["executors"]
    assert "on 2/2" in rows["torch"] and "on 2/2" in rows["sparkdl"]
    assert "2 total, 2 free; need 3" in rows["task"] and rows["task"].rstrip().endswith("ERROR")
    assert "torch sees no CUDA device on 2/2" in out
    assert "needs 3 free task slots" in out and "fix: lower num_workers" in out
