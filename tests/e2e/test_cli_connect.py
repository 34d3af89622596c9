"""The ``sparkdl`` command line as a Spark Connect client: ``--remote sc://...`` (or ``SPARK_REMOTE``).

The server is pip pyspark 4's own ``SparkConnectServer`` on 127.0.0.1 (tools/connect_server.py),
``local[2]``; the command runs as a real subprocess (``python -m sparkdl``), so its session is
``SparkSession.builder.remote(url)``: no SparkContext and no JVM in the command's process. The
classic stack (pyspark 3.5) skips here; the usage errors that need no server are in
tests/unit/cli/test_cli_usage.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from conftest import CONNECT_SERVER_TOKEN
from connect_server import ConnectServer

pytestmark = [pytest.mark.spark]

CLI = [sys.executable, "-m", "sparkdl"]



def sparkdl(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """The command, in an environment without SPARK_REMOTE unless ``env`` gives one."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if k != "SPARK_REMOTE"}
    return subprocess.run([*CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def rows(stdout: str) -> dict[str, str]:
    """The doctor's table rows by check name (names are one or two words)."""
    found = {}
    for line in stdout.splitlines():
        for name in ("spark session", "task slots", "driver channel", "run directory", "cache directory",
                     "connect client", "executors", "python", "torch", "java", "sparkdl"):
            if line.startswith(name + " "):
                found.setdefault(name, line)
    return found


SCRIPT = '''\
"""A torchrun-style script; rank 1 fails once; rank 0 writes where it ran."""
import json
import os
import sys

import torch
import torch.distributed as dist

out, fail_once = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if rank == 1 and not os.path.exists(fail_once):
    open(fail_once, "w").close()
    print("rank 1 fails on purpose", flush=True)
    sys.exit(3)
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
print(f"rank {rank} of {world}: sum {total.item()}", flush=True)
if rank == 0:
    with open(out, "w") as f:
        json.dump({"sum": total.item(), "world": world, "server": os.environ.get("SPARKDL_TEST_CONNECT_SERVER")}, f)
'''


@pytest.mark.timeout(300)
def test_run_trains_on_the_connect_servers_executors_and_reruns_the_gang(connect_server: ConnectServer, tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    out = sparkdl("run", "-n", "2", "--remote", connect_server.url, "--max-attempts", "2", "--timeout", "120",
                  "train.py", "result.json", "failed-once", cwd=tmp_path)
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-5000:]}\n--- server\n{connect_server.tail()}"
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["sum"] == 3.0 and result["world"] == 2
    # Rank 0 ran under the Connect server (its executor), not under the command.
    assert result["server"] == CONNECT_SERVER_TOKEN
    # Rank 1 failed once; the whole gang reran; the ranks' output reached the client, tagged.
    assert (tmp_path / "failed-once").exists()
    assert "[rank 1] rank 1 fails on purpose" in out.stdout
    assert "[rank 1, attempt 1] rank 1 of 2: sum 3.0" in out.stdout


@pytest.mark.timeout(200)
def test_run_over_connect_exits_1_with_the_failure_report(connect_server: ConnectServer, tmp_path: Path) -> None:
    (tmp_path / "fail.py").write_text("import sys\nprint('failing now', flush=True)\nsys.exit(7)\n")
    out = sparkdl("run", "-n", "2", "--remote", connect_server.url, "--max-attempts", "1", "fail.py", cwd=tmp_path, timeout=180)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "sparkdl.run failed after 1 attempt(s)" in out.stderr, out.stderr[-3000:]
    assert "Root cause: attempt 0, rank" in out.stderr and "exited with code 7" in out.stderr, out.stderr[-3000:]
    assert "[rank 0] failing now" in out.stdout and "[rank 1] failing now" in out.stdout


@pytest.mark.timeout(200)
def test_doctor_reports_the_executors_of_a_connect_server(connect_server: ConnectServer, tmp_path: Path) -> None:
    import torch

    out = sparkdl("doctor", "--remote", connect_server.url, "-n", "2", "--timeout", "150",
                  "--conf", "spark.executor.memory=3g", cwd=tmp_path, timeout=180)
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr[-3000:]}\n--- server\n{connect_server.tail()}"
    r = rows(out.stdout)
    assert "a Spark Connect client" in r["spark session"] and f"server {connect_server.url}, master local[2]" in r["spark session"]
    assert r["connect client"].rstrip().endswith("ok")
    assert r["java"].rstrip().endswith("info") and "a Spark Connect client runs no JVM" in out.stdout
    # What the probe job found on the executors (the server's local[2]: one executor, 4 tasks).
    assert "1 reached on 1 host(s): 127.0.0.1" in r["executors"], r["executors"]
    python = ".".join(map(str, sys.version_info[:3]))
    assert f"{python} on 1/1" in r["python"] and f"{torch.__version__} on 1/1" in r["torch"], out.stdout
    assert "reached from 4/4 probe tasks" in r["driver channel"] and r["driver channel"].rstrip().endswith("ok")
    assert "shared by this client and 4/4 probe tasks" in r["run directory"]
    # What a Connect client cannot see, said so.
    assert "2 total (master local[2]); need 2" in r["task slots"]
    assert "busy slots: not visible over Spark Connect" in out.stdout
    # A conf only the server can set: named once, not silently dropped.
    assert "keeps its own value of: spark.executor.memory=3g" in out.stderr, out.stderr


@pytest.mark.timeout(200)
def test_doctor_over_spark_remote_finds_too_few_slots_and_a_channel_host_it_cannot_use(
        connect_server: ConnectServer, tmp_path: Path) -> None:
    out = sparkdl("doctor", "-n", "3", "--timeout", "150", "--conf", "spark.sparkdl.channelHost=192.0.2.1",
                  cwd=tmp_path, env={**os.environ, "SPARK_REMOTE": connect_server.url}, timeout=180)
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    r = rows(out.stdout)
    assert f"server {connect_server.url}" in r["spark session"]  # SPARK_REMOTE, as pyspark reads it
    assert r["task slots"].rstrip().endswith("ERROR") and "master local[2] has 2" in out.stdout
    assert r["driver channel"].rstrip().endswith("ERROR") and "cannot listen on 192.0.2.1" in out.stdout
    assert "fix: set spark.sparkdl.channelHost" in out.stdout


REACH = textwrap.dedent('''\
    import json, sys, tempfile
    from pyspark.sql import SparkSession
    from sparkdl._internal.spark.reach import Marker, probe_executors

    spark = SparkSession.builder.remote(sys.argv[1]).getOrCreate()
    seen = Marker.plant("file://" + tempfile.mkdtemp())
    unseen = Marker("file://" + tempfile.mkdtemp() + "/elsewhere", "0" * 48)
    try:
        print("RESULT " + json.dumps([probe_executors(spark, seen), probe_executors(spark, unseen)]))
    finally:
        seen.remove()
        spark.stop()
''')


@pytest.mark.timeout(200)
def test_reach_probes_the_executors_over_connect(connect_server: ConnectServer, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", REACH, connect_server.url], capture_output=True, text=True, timeout=180,
                         cwd=tmp_path)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-2000:] + out.stderr[-3000:]
    seen, unseen = json.loads(lines[0].split(" ", 1)[1])
    assert seen == []
    assert len(unseen) == 1 and unseen[0][0] == "127.0.0.1" and "has no file .sparkdl-reach-" in unseen[0][1], unseen


def test_no_command_left_a_process_under_the_server(connect_server: ConnectServer) -> None:
    """The doctor's probe and the runs end with their commands: no rank is left under the server."""
    assert connect_server.proc is not None
    deadline = time.monotonic() + 30
    while left := [p for p in psutil.Process(connect_server.proc.pid).children(recursive=True)
                   if p.status() != psutil.STATUS_ZOMBIE
                   and ("sparkdl._internal.rank" in " ".join(p.cmdline()) or p.name().startswith("sparkdl-rank"))]:
        assert time.monotonic() < deadline, [p.cmdline() for p in left]
        time.sleep(0.2)
