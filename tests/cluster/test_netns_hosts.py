"""sparkdl on a cluster of real hosts: a Spark standalone master and two workers, each in a network
namespace of its own on a private bridge, each worker with a private /tmp (tools/netns_cluster.py),
and storage all hosts share at another path. The driver programs run in the root namespace on
the bridge's address, as a user's driver on an edge node does.

What is shown here and nowhere else: ranks on two hosts with two addresses; a checkpoint
directory the user named and a cache directory that are not shared, refused before training; with
the default run directory, a run that never saves runs, and one that saves stops at its first save; a SIGKILLed rank on host 2
resumed bitwise equal from shared storage; a partition of host 2 and the loss of host 2, each
ended within its bounds; the jobs by spark-submit; ``sparkdl doctor`` naming both hosts, their
(fake) GPUs and the slots a run lacks.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import JVM_ARCHIVE, NETNS_STACK, REPO
from resources.digits_jobs import check_scored, check_trained

ROOT = REPO
DRIVER = ROOT / "tests" / "resources" / "netns_driver.py"
RUN_TIMEOUT_S = 420
PARTITION_TIMEOUT_S = 8  # collective_timeout_s of the run that host 2's partition hits

pytestmark = [
    pytest.mark.spark, pytest.mark.cluster,
    # Hosts of a cluster, whole: the launch, rerun and bound paths they take run on both stacks in
    # tests/cluster (local-cluster, standalone) and tests/integration; Spark 3.5 is what most
    # multi-host clusters run today.
    pytest.mark.one_stack(NETNS_STACK, "namespaced hosts of a standalone cluster, whole programs whose stack-dependent "
                          "paths tests/cluster and tests/integration walk on both stacks"),
]




@pytest.fixture(scope="module")
def cluster(netns_clusters: Any) -> Any:
    return netns_clusters.get()


def _conf(cluster: Any, **extra: str) -> dict[str, str]:
    return {**cluster.driver_conf(), "spark.executor.memory": "512m", "spark.driver.memory": "512m",
            "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile={(ROOT / 'conf' / 'log4j2.properties').as_uri()}",
            **extra}


def _python_on(cluster: Any, index: int) -> list[str]:
    """The command lines of Python processes on worker ``index``."""
    found = []
    for pid in cluster.pids(index):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "python" in Path(cmd.split(" ", 1)[0]).name:
            found.append(cmd)
    return found


def _nothing_left(cluster: Any, timeout_s: float = 60.0) -> None:
    """Once the application is over, no Python process is left on either host."""
    deadline = time.monotonic() + timeout_s
    while any(_python_on(cluster, i) for i in range(len(cluster.hosts))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [_python_on(cluster, i) for i in range(len(cluster.hosts)) if _python_on(cluster, i)]


class Driver:
    """The driver script as a process in the root namespace; its output is read as it comes."""

    def __init__(self, cluster: Any, scenario: str, **params: Any) -> None:
        params = {"shared": str(cluster.shared), "host2": cluster.hosts[1].address, "conf": _conf(cluster), **params}
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(
            [sys.executable, str(DRIVER), scenario, json.dumps(params)], cwd=ROOT, env=cluster.driver_env(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, text: str, timeout_s: float, after: int = 0) -> float:
        """When a line containing ``text`` came, of those from the ``after``-th on."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for at, line in self.lines[after:]:
                if text in line:
                    return at
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"{text!r} never came\n" + self.output()[-6000:])

    def start_run(self, name: str) -> int:
        """Starts the ``faults`` scenario's run ``name``; returns the index of its first line to come."""
        assert self.proc.stdin is not None
        after = len(self.lines)
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return after

    def run_result(self, name: str, after: int) -> dict[str, Any]:
        """The result of the ``faults`` scenario's run ``name``, once it has ended."""
        self.wait_for(f"RESULT-{name} ", RUN_TIMEOUT_S, after)
        line = next(line for _, line in self.lines[after:] if line.startswith(f"RESULT-{name} "))
        result: dict[str, Any] = json.loads(line.split(" ", 1)[1])
        return result

    def result(self) -> dict[str, Any]:
        """The scenario's result, once the driver has ended (its stdin closed: no more runs)."""
        try:
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                self.proc.stdin.close()
            self.proc.wait(RUN_TIMEOUT_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(10)
        found = [line for _, line in self.lines if line.startswith("RESULT ")]
        assert self.proc.returncode == 0 and found, self.output()[-8000:]
        result: dict[str, Any] = json.loads(found[-1].split(" ", 1)[1])
        return result

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)


@pytest.mark.skipif(not JVM_ARCHIVE, reason="SPARKDL_TEST_JVM_ARCHIVE=0")
def test_the_hosts_jvms_map_the_suites_class_archive(cluster: Any) -> None:
    """The master and the workers (and so the executors they start, with the same class path) map
    the archive of Spark's classes that the suite's local sessions map: each JVM of this module
    would otherwise load its classes from the jars, some 4 s of CPU more each."""
    found = re.search(r"-XX:SharedArchiveFile=(\S+)", os.environ.get("JAVA_TOOL_OPTIONS", ""))
    assert found, os.environ.get("JAVA_TOOL_OPTIONS")
    for host in [cluster.master, *cluster.hosts]:
        maps = Path(f"/proc/{host.proc.pid}/maps").read_text()
        assert found.group(1) in maps, f"{host.role}: {' '.join(psutil.Process(host.proc.pid).cmdline())[:400]}"


@pytest.fixture(scope="module")
def main(cluster: Any) -> dict[str, Any]:
    result = Driver(cluster, "main").result()
    _nothing_left(cluster)
    return result


def test_each_rank_runs_and_listens_on_its_own_hosts_address(cluster: Any, main: dict[str, Any]) -> None:
    ranks = main["where"]
    addresses = {h.address for h in cluster.hosts}
    assert {r["host"] for r in ranks} == addresses  # one rank on each host
    assert {r["master_addr"] for r in ranks} == {ranks[0]["host"]}
    for rank in ranks:
        assert rank["listeners"], rank  # the rank process, at least, was listening (gloo)
        for ip, port, name, cmd in rank["listeners"]:
            # Nothing of sparkdl's on a wildcard or on another host's address.
            assert ip in (rank["host"], "127.0.0.1"), (ip, port, name, cmd)
    # Each rank read its own shard from the shared storage: every row once.
    assert sorted(i for r in ranks for i in r["ids"]) == list(range(320))


def test_a_sigkilled_rank_on_host_2_resumes_bitwise_equal_from_shared_checkpoints(main: dict[str, Any]) -> None:
    reference, killed = main["reference"], main["sigkill"]
    assert reference["attempt"] == 0 and reference["restored_from"] is None
    assert killed["attempt"] >= 1 and killed["restored_from"] is not None
    assert killed["steps"] == reference["steps"]
    assert killed["weights"] == reference["weights"]


def test_a_checkpoint_directory_the_user_named_that_a_host_lacks_is_refused_before_training(
    cluster: Any, main: dict[str, Any]
) -> None:
    message = main["ckpt_named"]
    assert message is not None, "a run with its checkpoints on the driver's own disk was accepted"
    assert "stopped before training" in message and "not shared" in message, message
    assert "checkpoint_dir" in message and "spark.sparkdl.runDir" in message, message
    assert any(h.address in message for h in cluster.hosts), message  # the host that does not see it
    assert main["ckpt_named_started"] == []  # no rank ever started training


def test_with_the_default_run_directory_a_run_that_never_saves_runs_and_one_that_saves_fails_at_its_first_save(
    cluster: Any, main: dict[str, Any]
) -> None:
    # A run without checkpoint_dir, on a cluster without spark.sparkdl.runDir, as TorchDistributor's
    # users run: it trained (test_each_rank_runs_and_listens_on_its_own_hosts_address)...
    assert len(main["where"]) == 2
    # ... and the one that saves was stopped at its first save, naming what to set, with no rerun.
    failed = main["ckpt_default"]
    assert failed is not None, "a run saved a checkpoint that only one host's disk has"
    assert failed["attempts"] == 1, failed
    cause = failed["root_cause"]
    assert "ConfigError" in cause and "this checkpoint was not saved" in cause and "not shared" in cause, cause
    assert "checkpoint_dir" in cause and "spark.sparkdl.runDir" in cause, cause
    assert any(h.address in cause for h in cluster.hosts), cause
    assert "a rerun would raise again" in failed["message"], failed["message"]
    assert main["ckpt_default_started"] == ["started-default-0", "started-default-1"]  # both ranks trained


def test_the_default_cache_directory_is_refused_and_a_shared_one_works(cluster: Any, main: dict[str, Any]) -> None:
    message = main["cache_default"]
    assert message is not None and "spark.sparkdl.cacheDir" in message
    assert all(h.address in message for h in cluster.hosts), message
    assert main["cached"].startswith(f"file://{cluster.shared}/cache/")


def test_a_torch_estimator_pipeline_fits_transforms_and_reloads_across_hosts(main: dict[str, Any]) -> None:
    assert main["estimator"] == {"rows": 320, "same": True}


def test_the_jobs_by_spark_submit(cluster: Any) -> None:
    """What a user's spark-submit does: the shipped defaults file, client mode, the driver on the
    edge node; the train job writes its dataset first (the ETL job), trains on both hosts, and the
    inference job scores the test rows. (tests/cluster/test_standalone.py runs these on loopback
    where namespaced hosts cannot be made.)"""
    shared = cluster.shared
    confs = _conf(cluster, **{"spark.sparkdl.runDir": f"{shared}/runs", "spark.sparkdl.cacheDir": f"{shared}/cache"})
    confs.pop("spark.master")

    def submit(job: str, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [cluster.spark_submit, "--master", cluster.master_url, "--deploy-mode", "client",
               "--properties-file", str(ROOT / "conf" / "spark-defaults.conf")]
        for key, value in confs.items():
            cmd += ["--conf", f"{key}={value}"]
        cmd += [str(ROOT / "jobs" / f"{job}.py"), *args]
        done = subprocess.run(cmd, cwd=ROOT, env=cluster.driver_env(), capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
        assert done.returncode == 0, f"{job}: {done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        return done

    def finished(name: str) -> list[dict[str, Any]]:
        """The master lists the application as completed (its executors released) within 30 s."""
        deadline = time.monotonic() + 30
        while True:
            apps = [a for a in (cluster.status() or {}).get("completedapps", []) if a.get("name") == name]
            if apps or time.monotonic() > deadline:
                return apps
            time.sleep(0.25)

    data, model, out = shared / "digits", shared / "model", shared / "predictions"
    train = submit("train", "--data", str(data), "--model", str(model), "--epochs", "5", "--min-accuracy", "0.85")
    # No dataset yet: the job ran the ETL job first, into storage both hosts read.
    assert "1445 training rows" in train.stdout and (data / "train" / "_sparkdl_manifest.json").is_file()
    summary = check_trained(model, train.stdout + train.stderr)
    # The application had an executor on each host.
    apps = finished("sparkdl-train-digits")
    assert apps and apps[0]["cores"] == 2, apps

    inference = submit("inference", "--model", str(model), "--input", str(data / "test"), "--output", str(out))
    assert "352 rows" in inference.stdout
    check_scored(out, summary)
    _nothing_left(cluster)


def test_doctor_names_both_hosts_the_shared_directories_the_gpus_and_missing_slots(cluster: Any) -> None:
    # Each executor asks for one of its worker's (fake) GPUs and each task for one: Spark assigns
    # them, but torch here is a CPU build, and 3 ranks do not fit 2 slots. Both are errors, and so
    # is the cache directory left on each host's own disk.
    cmd = [sys.executable, "-m", "sparkdl", "doctor", "--master", cluster.master_url, "-n", "3", "--timeout", "120"]
    confs = _conf(cluster, **{"spark.sparkdl.runDir": f"{cluster.shared}/runs",  # the cache dir stays the default
                              "spark.executor.resource.gpu.amount": "1", "spark.task.resource.gpu.amount": "1"})
    confs.pop("spark.master")
    for key, value in confs.items():
        cmd += ["--conf", f"{key}={value}"]
    done = subprocess.run(cmd, cwd=ROOT, env=cluster.driver_env(), capture_output=True, text=True, timeout=300)
    out = done.stdout
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert done.returncode == 1, out + done.stderr[-3000:]
    assert "2 reached" in rows["executors"] and all(h.address in rows["executors"] for h in cluster.hosts), rows
    assert "on 2/2" in rows["torch"] and "on 2/2" in rows["sparkdl"], rows
    assert "shared by" in rows["run"] and rows["run"].rstrip().endswith("ok"), rows["run"]
    assert "not seen on" in rows["cache"] and all(h.address in rows["cache"] for h in cluster.hosts), rows["cache"]
    assert "spark.sparkdl.cacheDir" in out
    assert "2 total, 2 free; need 3" in rows["task"] and rows["task"].rstrip().endswith("ERROR"), rows["task"]
    assert "torch sees no CUDA device on 2/2" in out
    assert "needs 3 free task slots" in out and "fix: lower num_workers" in out
    _nothing_left(cluster)


@pytest.fixture(scope="module")
def faults(cluster: Any) -> Iterator[Driver]:
    """One driver application for the runs this module's faults hit (a partition of host 2, then
    its loss): each run starts when its test asks for it. One application instead of one per run
    saves a driver JVM, its two executors and their Python zygotes."""
    driver = Driver(cluster, "faults", runs={
        "partition": {"collective_timeout_s": PARTITION_TIMEOUT_S, "sleep": 0.15, "epochs": 4},
        "hostloss": {"sleep": 0.15, "epochs": 4, "start_timeout_s": 30},
    })
    try:
        yield driver
    finally:
        if driver.proc.poll() is None:  # a test failed before ending the application: no more runs
            with contextlib.suppress(Exception):
                driver.result()


def _ranks_on(cluster: Any) -> list[str]:
    """The rank processes (``sparkdl-rank<r>``, as sparkdl names them) alive on any host."""
    found = []
    for index in range(len(cluster.hosts)):
        for pid in cluster.pids(index):
            with contextlib.suppress(OSError):
                if (name := Path(f"/proc/{pid}/comm").read_text().strip()).startswith("sparkdl-rank"):
                    found.append(f"{name} (pid {pid}) on host {index + 1}")
    return found


def test_a_partition_of_host_2_longer_than_the_collective_timeout_ends_within_bounds(cluster: Any, faults: Driver) -> None:
    down_s = 2 * PARTITION_TIMEOUT_S  # the link is down for twice the collective timeout
    after = faults.start_run("partition")
    began = faults.wait_for("STEP 10 attempt 0", timeout_s=240, after=after)
    cluster.link_down(1)
    try:
        time.sleep(down_s)
    finally:
        cluster.link_up(1)
    result = faults.run_result("partition", after)
    ended = time.monotonic() - began
    host2 = cluster.hosts[1].address
    if "error" in result:
        # The run gave up: the report names the rank and the host that fell silent.
        assert host2 in result["message"], result["message"]
    else:
        # The gang reran once the link was back and finished from its checkpoint.
        assert result["value"]["attempt"] >= 1 and result["value"]["restored_from"] is not None
    print(f"partition of {down_s} s, collective_timeout_s={PARTITION_TIMEOUT_S}: the run ended {ended:.0f} s after "
          f"it began ({'failed' if 'error' in result else 'resumed'})")
    # No rank is left on either host once the run has ended (the application goes on: the next
    # test's run is in it, and the module's last test checks that nothing is left once it ends).
    deadline = time.monotonic() + 30
    while (left := _ranks_on(cluster)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left


def test_losing_host_2_for_good_fails_within_start_timeout_naming_the_slots(cluster: Any, faults: Driver) -> None:
    # Last in this module: host 2 does not come back.
    after = faults.start_run("hostloss")
    faults.wait_for("STEP 5 attempt 0", timeout_s=240, after=after)
    killed = time.monotonic()
    cluster.kill_host(1)
    result = faults.run_result("hostloss", after)
    ended = time.monotonic() - killed
    assert result.get("error") in ("InsufficientSlotsError", "RunTimeoutError"), result
    assert "slot" in result["message"], result["message"]
    print(f"host loss: the run failed {ended:.0f} s after host 2 was killed: {result['error']}")
    assert ended < 30 + 60, result["message"]  # start_timeout_s, plus Spark noticing the lost executor
    # The application that ran both faults ends cleanly, and leaves no Python process behind.
    faults.result()
    _nothing_left(cluster)
