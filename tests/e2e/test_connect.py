"""sparkdl from a Spark Connect client, against a real Connect server on 127.0.0.1.

The server is pip pyspark 4's own (``SparkConnectServer`` by spark-submit, tools/connect_server.py),
``local[2]``; each scenario is a client program of its own (tests/resources/connect_client.py)
whose session is ``SparkSession.builder.remote("sc://127.0.0.1:PORT")``: no SparkContext, no
py4j, only gRPC. Connect is tested on the modern stack (pyspark 4); the classic stack skips here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, wait_ended, wait_for_pids
from connect_server import ConnectServer, connect_available

ROOT = REPO
CLIENT = ROOT / "tests" / "resources" / "connect_client.py"

pytestmark = [pytest.mark.spark]



def client(connect_server: ConnectServer, scenario: str, work: Path, timeout: float = 240) -> dict[str, Any]:
    out = subprocess.run([sys.executable, str(CLIENT), connect_server.url, scenario, str(work)], capture_output=True,
                         text=True, timeout=timeout, cwd=work)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, f"{out.stdout[-3000:]}\n{out.stderr[-5000:]}\n--- server\n{connect_server.tail()}"
    result: dict[str, Any] = json.loads(lines[-1].split(" ", 1)[1])
    result["stdout"] = out.stdout
    return result


def test_ddp_over_connect_resumes_a_sigkilled_rank_bitwise_equal(connect_server: ConnectServer, tmp_path: Path) -> None:
    r = client(connect_server, "train", tmp_path)
    assert r["rows"] == [320, 320]  # written by write_dataset over Connect, and reopened
    first, again, other = r["cached"]
    assert first == again != other  # write_dataset(df) without a path: its plan cache over Connect
    # Its array column's lengths were read back from the cache's hidden staging directory by file,
    # without Spark's warning that it ignores such a directory.
    assert "All paths were ignored" not in connect_server.log.read_text(errors="replace")
    faulted, clean = r["faulted"], r["clean"]
    # Rank 1 was SIGKILLed at step 7 of attempt 0: Spark reran the gang, which resumed from the
    # checkpoint of step 4 (the run's first).
    assert r["attempts"] == 2 and faulted["attempt"] == 1 and faulted["restored_from"] == 1, r
    assert clean["attempt"] == 0 and clean["restored_from"] is None
    assert faulted["steps"] == clean["steps"] == 2 * 320 // (2 * 16)
    assert faulted["weights"] == clean["weights"]
    # The ranks' output reached the client live over the channel, tagged.
    assert "[rank 0, attempt 1] trained to step 20 on attempt 1" in r["stdout"]
    assert "[rank 1] trained to step 20 on attempt 0" in r["stdout"]


def test_a_stopped_run_cancels_its_spark_job_by_tag(connect_server: ConnectServer, tmp_path: Path) -> None:
    r = client(connect_server, "stop", tmp_path)
    assert r["error"] and "stopped early" in r["error"] and "the same error every time" in r["error"], r["error"]
    # Two attempts of two ranks ran, and nothing after the driver stopped: Spark's own reruns of
    # the stage (spark.stage.maxConsecutiveAttempts=4) were interrupted with the job's tag.
    assert sorted(r["calls"]) == ["0 0", "0 1", "1 0", "1 1"], r["calls"]


def test_too_few_slots_fail_fast_over_connect(connect_server: ConnectServer, tmp_path: Path) -> None:
    r = client(connect_server, "slots", tmp_path)
    assert r["required"] == 3 and r["available"] == 2
    assert "master local[2]" in r["error"] and "Spark Connect" in r["error"], r["error"]
    assert r["elapsed"] < 5  # slot_wait_s is 10 s: over Connect, no busy slot is waited for


def test_the_drop_ins_run_over_connect_like_sparks(connect_server: ConnectServer, tmp_path: Path) -> None:
    r = client(connect_server, "dropins", tmp_path)
    assert r["td"] == 2.0 * 3.0 * 2  # run(fn, *args, **kwargs) reached the function on 2 ranks
    assert r["gpu"][1] and "spark.task.resource.gpu.amount" in r["gpu"][3], r["gpu"]  # a RuntimeError
    assert r["script"][2] and "epochs" in r["script"][3], r["script"]  # a ValueError
    assert r["hvd"] == 10.0
    # Petastorm's make_spark_converter, from sparkdl.compat.petastorm: shard 1 of 2 of 100 rows.
    size, steps, ids, dtype = r["converter"]
    assert size == 100 and steps == 4 and len(ids) == 50 and len(set(ids)) == 50 and dtype == "torch.float32", r["converter"]
    # The image tutorial's: a TransformSpec decoding photos, read by HorovodRunner's 2 ranks, a shard each.
    size, shards = r["tutorial"]
    assert size == 8 and [shape for _, shape in shards] == [["(3, 8, 8) torch.float32"]] * 2, r["tutorial"]
    assert sorted(shards[0][0] + shards[1][0]) == list(range(8)) and len(shards[0][0]) == 4, r["tutorial"]
    # Spark ML's own checks run over Connect too (tests/e2e/test_connect_ml.py trains and scores).
    assert "does not match labelCol='y'" in r["estimator"], r["estimator"]


SLOW_EXECUTORS = """
import sys, time
from pyspark.sql import SparkSession
import sparkdl

spark = SparkSession.builder.remote("local-cluster[2,1,1024]").config("spark.ui.enabled", "false").getOrCreate()

def train(scale):
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1) * scale])
    dist.all_reduce(t)
    return t.item()

started = time.monotonic()
try:  # no executor has started yet: they wait for the gate
    sparkdl.run(train, 1.0, num_workers=2, config=sparkdl.RunConfig(slot_wait_s=1))
except RuntimeError as exc:
    print("REFUSED", type(exc).__name__, round(time.monotonic() - started, 1), str(exc).replace("\\n", " "))
open(sys.argv[1], "w").close()  # the executors start now, and take seconds to register
cfg = sparkdl.RunConfig(slot_wait_s=60)
value = sparkdl.TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, config=cfg).run(train, 2.0)
print("VALUE", value)
spark.stop()
"""


def test_a_run_right_after_the_session_waits_for_the_executors_over_connect(tmp_path: Path) -> None:
    # A Connect session's builder returns before the executors registered (as in Spark's own
    # TorchDistributor tests); Spark refuses a barrier stage submitted then (SPARK-24819).
    if reason := connect_available():
        pytest.skip(reason)
    java = Path(shutil.which("java") or pytest.skip("no java on PATH")).resolve()
    home = tmp_path / "jdk"
    (home / "bin").mkdir(parents=True)
    for entry in java.parent.parent.iterdir():
        if entry.name != "bin":
            (home / entry.name).symlink_to(entry)
    gate = tmp_path / "gate"
    # The worker launches the executor JVMs with $JAVA_HOME/bin/java: they start once the gate
    # file exists (at most 120 s), so that none is there for the first run, however fast.
    (home / "bin" / "java").write_text(
        f'#!/bin/sh\ncase " $* " in *CoarseGrainedExecutorBackend*)\n'
        f'  i=0; while [ ! -e {gate} ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done;;\nesac\n'
        f'exec {java} "$@"\n')
    (home / "bin" / "java").chmod(0o755)
    script = tmp_path / "slow_executors.py"
    script.write_text(SLOW_EXECUTORS)
    env = {**os.environ, "JAVA_HOME": str(home), "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    out = subprocess.run([sys.executable, str(script), str(gate)], capture_output=True, text=True, timeout=240,
                         env=env, cwd=tmp_path)
    found = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.stdout.splitlines()
             if line.startswith(("REFUSED ", "VALUE "))}
    assert out.returncode == 0 and "VALUE" in found and "REFUSED" in found, out.stdout[-3000:] + out.stderr[-5000:]
    # Refused after slot_wait_s (1 s), with the setting named, as a RuntimeError...
    kind, elapsed, message = found["REFUSED"].split(" ", 2)
    assert kind == "InsufficientSlotsError" and 1 <= float(elapsed) < 30, found
    assert "SPARK-24819" in message and "RunConfig.slot_wait_s" in message
    # ...and within a longer one, the drop-in, refused too at first, waited for the executors
    # and ran on both.
    assert "Spark refused the gang's barrier stage" in out.stderr
    assert float(found["VALUE"]) == (1 + 2) * 2.0


@pytest.mark.spoils_connect_server(
    "the server does not cancel a dead client's Spark job: its barrier tasks hold both slots until the run's timeout_s"
)
def test_a_client_that_dies_mid_run_leaves_no_rank_running(connect_server: ConnectServer, tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, str(CLIENT), connect_server.url, "orphan", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        ranks = wait_for_pids(proc, [tmp_path / f"pid-{r}" for r in range(2)])
    finally:
        proc.send_signal(signal.SIGKILL)  # no clean-up of its own: the server outlives it
        proc.wait(timeout=10)
    wait_ended(ranks, 60, "their client died")


def test_a_search_runs_from_a_connect_client_and_prunes_through_its_channel(connect_server: ConnectServer,
                                                                             tmp_path: Path) -> None:
    pytest.importorskip("optuna")
    r = client(connect_server, "tune", tmp_path)
    assert r["states"] == ["COMPLETE", "PRUNED"], r
    assert "t1-r0-pruned-at-1" in r["pruned"], r["pruned"]
    assert "sparkdl tune: trial 1 was pruned" not in r["stdout"]  # the progress line is on stderr
