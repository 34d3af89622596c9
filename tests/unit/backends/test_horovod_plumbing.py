"""Horovod's Gloo mode driven by sparkdl's plumbing, with real rank processes and no Spark.

Two ranks start with plain ``subprocess``, get their ``HOROVOD_*`` environment from
``horovod_env`` and meet through ``start_rendezvous_server`` on 127.0.0.1. Each runs an
allreduce, ``hvd.broadcast_parameters`` and one ``hvd.DistributedOptimizer`` step, and prints
what it got; the test checks the numbers and that nothing is left running or listening.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

pytest.importorskip("horovod.torch", reason="Horovod is not installed: tools/build-horovod.sh")

from sparkdl._internal.backends.horovod.horovod_gloo import (
    check_horovod,
    horovod_env,
    start_rendezvous_server,
)

LOOPBACK = "127.0.0.1"
HOSTS = [LOOPBACK, LOOPBACK]
# Imports of torch and Horovod dominate; generous for a loaded 2-core machine.
RANK_TIMEOUT_S = 120.0
GLOO_TIMEOUT_S = 30.0

# Rank r: weights start at a rank-dependent value, are broadcast from rank 0 ([1, 2]), then one
# SGD step (lr 0.5) on loss = sum(w . x_r) with x_0 = [1, 2], x_1 = [3, 4] averages the
# gradients to [2, 3]: w = [1 - 1, 2 - 1.5] = [0, 0.5] on both ranks.
_RANK_SCRIPT = r"""
import json, os, socket, sys

if os.environ.get("TEST_SERVER_FD"):
    # The rendezvous server lives in rank 0, on the socket its parent bound for it.
    from sparkdl._internal.backends.horovod.horovod_gloo import start_rendezvous_server
    listener = socket.socket(fileno=int(os.environ["TEST_SERVER_FD"]))
    _, stop = start_rendezvous_server(
        "127.0.0.1", ["127.0.0.1", "127.0.0.1"], listener=listener,
        isolated_devices=os.environ["TEST_ISOLATED"] == "1",
    )
else:
    stop = None

import torch
import horovod.torch as hvd

hvd.init()
rank = hvd.rank()
summed = hvd.allreduce(torch.tensor([float(rank + 1)]), op=hvd.Sum, name="sum")
model = torch.nn.Linear(2, 1, bias=False)
with torch.no_grad():
    model.weight.copy_(torch.tensor([[1.0, 2.0]]) if rank == 0 else torch.tensor([[5.0, 5.0]]))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.5), named_parameters=model.named_parameters()
)
x = torch.tensor([[1.0, 2.0]]) if rank == 0 else torch.tensor([[3.0, 4.0]])
opt.zero_grad()
model(x).sum().backward()
opt.step()
print("RESULT " + json.dumps({
    "rank": rank, "size": hvd.size(), "local_rank": hvd.local_rank(),
    "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
    "cross_size": hvd.cross_size(), "sum": summed.tolist(),
    "weight": model.weight.detach().flatten().tolist(),
}), flush=True)
hvd.shutdown()
if stop is not None:
    stop()
"""


def _start_rank(
    script: Path, rank: int, port: int, *, isolated: bool, server_fd: int | None
) -> subprocess.Popen[str]:
    env = dict(os.environ)
    # Nothing of an outer Horovod job may leak into these ranks.
    for key in [k for k in env if k.startswith("HOROVOD_")]:
        del env[key]
    env.update(
        horovod_env(
            rank, HOSTS, LOOPBACK, port, "lo", timeout_s=GLOO_TIMEOUT_S, isolated_devices=isolated
        )
    )
    env["TEST_ISOLATED"] = "1" if isolated else "0"
    if server_fd is not None:
        env["TEST_SERVER_FD"] = str(server_fd)
    return subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        pass_fds=(server_fd,) if server_fd is not None else (),
        start_new_session=True,
    )


def _listening(port: int) -> list[str]:
    """The local addresses that listen on ``port`` in this test's process tree."""
    me = psutil.Process()
    found = []
    for proc in [me, *me.children(recursive=True)]:
        try:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
                    found.append(conn.laddr.ip)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.fixture
def ranks() -> Iterator[list[subprocess.Popen[str]]]:
    """The rank processes a test starts; whatever still runs at the end is killed."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(10)


def test_check_horovod_reports_the_version() -> None:
    assert check_horovod() == "0.28.1"


@pytest.mark.parametrize(
    ("placement", "isolated"),
    [("driver", False), ("rank0", False), ("rank0", True)],
    ids=["server-in-parent", "server-in-rank0", "server-in-rank0-isolated-devices"],
)
def test_two_ranks_allreduce_broadcast_and_step(
    tmp_path: Path, ranks: list[subprocess.Popen[str]], placement: str, isolated: bool
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    stop = None
    listener = None
    if placement == "driver":
        port, stop = start_rendezvous_server(LOOPBACK, HOSTS, isolated_devices=isolated)
        assert _listening(port) == [LOOPBACK]
    else:
        # As the launcher does for rank 0's task: bind first, so the port is known at once.
        listener = socket.create_server((LOOPBACK, 0))
        port = listener.getsockname()[1]
    try:
        server_fd = listener.fileno() if listener is not None else None
        ranks.append(_start_rank(script, 0, port, isolated=isolated, server_fd=server_fd))
        ranks.append(_start_rank(script, 1, port, isolated=isolated, server_fd=None))
        if listener is not None:
            # Rank 0 owns the socket now; this process's copy must not keep the port open.
            listener.close()
        outputs = []
        for proc in ranks:
            try:
                out, _ = proc.communicate(timeout=RANK_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                out, _ = proc.communicate(timeout=10)
                pytest.fail(f"rank {proc.args!r} took over {RANK_TIMEOUT_S}s:\n{out}")
            assert proc.returncode == 0, out
            outputs.append(out)
    finally:
        if stop is not None:
            stop()
        if listener is not None:
            listener.close()

    results = []
    for out in outputs:
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert len(lines) == 1, out
        results.append(json.loads(lines[0][len("RESULT ") :]))
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["size"] == 2
        assert r["sum"] == [3.0]
        assert r["weight"] == pytest.approx([0.0, 0.5])
    if isolated:
        assert [(r["local_rank"], r["local_size"]) for r in results] == [(0, 1), (0, 1)]
        assert [(r["cross_rank"], r["cross_size"]) for r in results] == [(0, 2), (1, 2)]
    else:
        assert [(r["local_rank"], r["local_size"]) for r in results] == [(0, 2), (1, 2)]
        assert [(r["cross_rank"], r["cross_size"]) for r in results] == [(0, 1), (0, 1)]

    # Gone: both ranks, and the server's port.
    assert all(proc.poll() is not None and not psutil.pid_exists(proc.pid) for proc in ranks)
    assert _listening(port) == []
    with pytest.raises(ConnectionRefusedError), socket.create_connection((LOOPBACK, port), 2):
        pass


def test_stop_is_idempotent_and_closes_the_port() -> None:
    port, stop = start_rendezvous_server(LOOPBACK, HOSTS)
    with socket.create_connection((LOOPBACK, port), 2):
        pass
    stop()
    stop()
    assert _listening(port) == []
