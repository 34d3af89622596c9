"""sparkdl from a Spark Connect client that the executors cannot reach, and from one whose server dies.

The client runs in a network namespace of its own (tools/isolated_client.py): its sparkdl channel
listens on that namespace's loopback, which no executor reaches, and its one way out is a
forwarder to the Connect server. The tasks find no driver (spark.sparkdl.channel "auto", the
default over Connect) and report through the relay hub in task 0: the ranks' output, the
rerun after a SIGKILL and the failure report still reach the client, through Spark's result rows
(sparkdl._internal.driver.relay). Then the Connect server is SIGKILLed under a running client: the run
ends with an error and no rank outlives it. Modern stack only; the namespace needs root.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import isolated_client
import psutil
import pytest
from conftest import REPO, wait_ended, wait_for_pids
from connect_server import ConnectServer

ROOT = REPO
CLIENT = ROOT / "tests" / "resources" / "connect_client.py"

pytestmark = [pytest.mark.spark]



def _result(out: str) -> dict[str, Any]:
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, out[-3000:]
    result: dict[str, Any] = json.loads(lines[-1].split(" ", 1)[1])
    return result


def test_a_client_the_executors_cannot_reach_still_gets_logs_reruns_and_the_report(
    connect_server: ConnectServer, tmp_path: Path
) -> None:
    if reason := isolated_client.available():
        pytest.skip(reason)
    with isolated_client.IsolatedClient(connect_server.port) as box:
        out = subprocess.run([*box.enter(), sys.executable, str(CLIENT), box.url, "relay", str(tmp_path)],
                             capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-5000:]}\n--- server\n{connect_server.tail()}"
    r = _result(out.stdout)
    # The tasks did not reach the client's channel: the record came back through Spark.
    assert "could not reach this driver" in out.stderr and "spark.sparkdl.channel=auto" in out.stderr
    # Rank 1 SIGKILLed at step 7: a new attempt resumed from the step-4 checkpoint, bitwise equal.
    faulted, clean = r["faulted"], r["clean"]
    assert r["attempts"] == 2 and faulted["attempt"] == 1 and faulted["restored_from"] == 1, r
    assert faulted["weights"] == clean["weights"] and clean["attempt"] == 0
    # The ranks' output, tagged with rank and attempt, at the end of each attempt.
    assert "[rank 1] trained to step 20 on attempt 0" in out.stdout
    assert "[rank 0, attempt 1] trained to step 20 on attempt 1" in out.stdout
    # The failure report of a run that kept failing: root cause, its output, the peer's stack.
    report = r["error"]
    assert report and "failed after 2 attempt(s)" in report, report
    assert "Root cause: attempt 0, rank 1" in report and "RuntimeError: broken on rank 1" in report
    assert "| working on attempt 0" in report and "time.sleep(120)" in report


def test_a_connect_server_that_dies_ends_the_run_and_its_ranks(connect_server: ConnectServer, tmp_path: Path) -> None:
    # It kills the shared server (last of the Connect tests, by file order): a later request starts a new one.
    proc = subprocess.Popen([sys.executable, str(CLIENT), connect_server.url, "serverdies", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        ranks = wait_for_pids(proc, [tmp_path / f"pid-{r}" for r in range(2)])
        assert connect_server.proc is not None
        jvm = connect_server.proc.pid
        assert psutil.Process(jvm).name() == "java"
        os.kill(jvm, signal.SIGKILL)  # the server's JVM only: its Python workers are left to notice
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    r = _result(out)
    # The run ends with the server, saying so, within about _SERVER_DOWN_S (pyspark's own client
    # would retry its call for minutes), and the client process exits.
    assert r["error"] and "RunFailedError" in r["error"] and "Spark Connect server at" in r["error"], out[-3000:]
    assert time.monotonic() - killed < 60
    wait_ended(ranks, 60, "their Connect server died")
