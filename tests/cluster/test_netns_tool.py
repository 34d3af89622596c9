"""tools/netns_cluster.py: a Spark standalone cluster whose hosts are network and mount namespaces.

One cluster (a master and two workers, each a host of its own on a private /24 behind a bridge)
serves the whole module; it is the one the namespaced-host tests share (the ``netns_clusters``
fixture), with both workers alive at the module's start. A driver program in the root namespace, bound on the bridge, runs a
two-task barrier job: the tasks must run on the two hosts' addresses, see only their own host's
/tmp and every host's writes to the shared dir. Then a host is partitioned and healed, another is
killed, and stop() must leave no namespace, link, mount, process or directory behind.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import netns_cluster
import psutil
import pytest
from conftest import REPO

ROOT = REPO

pytestmark = [pytest.mark.spark, pytest.mark.cluster]

DRIVER = r"""
import json, os, socket, sys
from pyspark import BarrierTaskContext
from pyspark.sql import SparkSession

conf, shared, token, driver_host = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
builder = SparkSession.builder.appName("netns-smoke")
for key, value in conf.items():
    builder = builder.config(key, value)
spark = builder.getOrCreate()


def probe(_):
    ctx = BarrierTaskContext.get()
    i = ctx.partitionId()
    for where in ("/tmp", shared):
        with open(os.path.join(where, f"{token}-task{i}"), "w") as f:
            f.write(str(i))
    ctx.barrier()  # both tasks have written before either looks
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((driver_host, 9))  # no packet: the source address the kernel picks for the driver
    yield json.dumps({
        "task": i, "addr": s.getsockname()[0], "local_ip": os.environ.get("SPARK_LOCAL_IP"),
        "tmp": sorted(n for n in os.listdir("/tmp") if n.startswith(token)),
        "shared": sorted(n for n in os.listdir(shared) if n.startswith(token)),
    })


rows = spark.sparkContext.parallelize(range(2), 2).barrier().mapPartitions(probe).collect()
print("PROBE " + json.dumps(sorted((json.loads(r) for r in rows), key=lambda r: r["task"])))
spark.stop()
"""

CONNECT = (
    "import socket, sys\n"
    "s = socket.socket(); s.settimeout(float(sys.argv[3]))\n"
    "s.connect((sys.argv[1], int(sys.argv[2]))); print('connected')\n"
)


@pytest.fixture(scope="module")
def cluster(netns_clusters: Any) -> netns_cluster.NetnsCluster:
    c: netns_cluster.NetnsCluster = netns_clusters.get()
    return c


def start_in(cluster: netns_cluster.NetnsCluster, host: netns_cluster.Host) -> subprocess.Popen[bytes]:
    """``sleep 600`` started inside a host (nsenter execs it: same pid), once it is in there."""
    proc = subprocess.Popen([*cluster.enter(host), "sleep", "600"])
    deadline = time.monotonic() + 10
    while proc.pid not in cluster.pids(host) and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def connect_to_master(cluster: netns_cluster.NetnsCluster, host: netns_cluster.Host, timeout_s: float = 3.0) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", CONNECT, cluster.master.address, str(netns_cluster.MASTER_PORT), str(timeout_s)]
    return cluster.exec(host, argv, timeout=timeout_s + 30)


def test_both_workers_are_alive_on_the_master_at_their_own_addresses(cluster: netns_cluster.NetnsCluster) -> None:
    addresses = [h.address for h in cluster.hosts]
    assert len(set(addresses)) == 2 and cluster.driver_host not in addresses
    assert cluster.master.address not in addresses
    assert cluster.alive_workers() == set(addresses)
    for host in cluster.hosts:
        assert host.proc is not None
        # The worker JVM listens on its host's address, and lives in that host's namespace.
        listening = {(addr, port) for addr, port, pid, _ in cluster.listeners(host) if pid == host.proc.pid}
        assert (host.address, netns_cluster.WORKER_PORT) in listening, cluster.listeners(host)
        assert host.proc.pid in cluster.pids(host)
        # One interface on the subnet and loopback, no default route: nothing else is reachable.
        assert cluster.exec(host, ["ip", "route", "show", "default"]).stdout.strip() == ""
        addrs = cluster.exec(host, ["ip", "-o", "-4", "addr", "show"]).stdout
        assert re.findall(r"inet (\S+)", addrs) == ["127.0.0.1/8", f"{host.address}/24"]


def test_a_job_runs_on_both_hosts_with_a_private_tmp_and_shared_storage(
    cluster: netns_cluster.NetnsCluster, tmp_path: Path
) -> None:
    token = f"sdlprobe{time.time_ns()}"
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    conf = {
        **cluster.driver_conf(),
        "spark.executor.memory": "512m",
        "spark.driver.memory": "512m",
        # The barrier stage needs both executors: wait for them.
        "spark.scheduler.minRegisteredResourcesRatio": "1.0",
        "spark.scheduler.maxRegisteredResourcesWaitingTime": "60s",
    }
    out = subprocess.run(
        [sys.executable, str(script), json.dumps(conf), str(cluster.shared), token, cluster.driver_host],
        env=cluster.driver_env(), capture_output=True, text=True, timeout=150, cwd=tmp_path,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("PROBE ")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    rows = json.loads(lines[0].split(" ", 1)[1])
    mine = [f"{token}-task0", f"{token}-task1"]
    # The tasks ran on the two hosts, each seen at its own address.
    assert sorted(r["addr"] for r in rows) == sorted(h.address for h in cluster.hosts), rows
    assert all(r["local_ip"] == r["addr"] for r in rows), rows
    # Each saw its own marker in /tmp only, and both markers in the shared dir.
    assert [r["tmp"] for r in rows] == [[mine[0]], [mine[1]]], rows
    assert [r["shared"] for r in rows] == [mine, mine], rows
    # The root namespace does not see the hosts' /tmp; it sees the shared dir.
    assert not any(Path("/tmp", name).exists() for name in mine)
    assert all((cluster.shared / name).read_text() == str(i) for i, name in enumerate(mine))
    # Each host's /tmp still holds its marker, and only its own; the master's holds none.
    by_addr = {h.address: h for h in cluster.hosts}
    for r in rows:
        host = by_addr[r["addr"]]
        listed = cluster.exec(host, ["ls", "/tmp"]).stdout.split()
        assert [n for n in listed if n.startswith(token)] == [f"{token}-task{r['task']}"], listed
        # The executor's work dir is in the host's /tmp too.
        assert any(n.startswith("app-") for n in cluster.exec(host, ["ls", netns_cluster.WORK_DIR]).stdout.split())
    assert token not in cluster.exec(cluster.master, ["ls", "/tmp"]).stdout


def test_link_down_cuts_a_host_off_and_link_up_heals_it(cluster: netns_cluster.NetnsCluster) -> None:
    host = cluster.hosts[0]
    assert connect_to_master(cluster, host).stdout.strip() == "connected"
    cluster.link_down(host)
    try:
        cut = connect_to_master(cluster, host)
        assert cut.returncode != 0 and "connected" not in cut.stdout
        assert re.search(r"timed out|No route to host|unreachable", cut.stderr), cut.stderr[-2000:]
        # The other host still reaches the master.
        assert connect_to_master(cluster, cluster.hosts[1]).stdout.strip() == "connected"
    finally:
        cluster.link_up(host)
    deadline = time.monotonic() + 15
    while (healed := connect_to_master(cluster, host, 2.0)).returncode != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert healed.stdout.strip() == "connected", healed.stderr[-2000:]


ORPHAN = (
    "import sys, time, netns_cluster\n"
    "c = netns_cluster.NetnsCluster(1, python=sys.executable).start()\n"
    "print('UP', c.token, c.hosts[0].proc.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def test_a_cluster_whose_owner_was_killed_is_swept_and_a_live_one_is_not(cluster: netns_cluster.NetnsCluster) -> None:
    env = {**cluster.driver_env(), "PYTHONPATH": str(ROOT / "tools")}
    owner = subprocess.Popen([sys.executable, "-c", ORPHAN], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = owner.stdout.readline() if owner.stdout else ""
    finally:
        owner.kill()  # SIGKILL: no stop(), no atexit
        owner.wait(timeout=10)
    assert line.startswith("UP "), line
    _, token, daemon = line.split()
    assert psutil.pid_exists(int(daemon)) and Path(f"/var/tmp/sparkdl-netns-{token}").is_dir()

    swept = netns_cluster.sweep_stale()
    # tools/test runs the stacks side by side: a sweep of the other stack's run (each start() sweeps)
    # may have taken it first. What matters: it is gone, and no live cluster was touched.
    assert token in swept or not Path(f"/var/tmp/sparkdl-netns-{token}").exists(), swept
    assert cluster.token not in swept
    assert not psutil.pid_exists(int(daemon)) or psutil.Process(int(daemon)).status() == psutil.STATUS_ZOMBIE
    assert token not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert token not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not Path(f"/var/tmp/sparkdl-netns-{token}").exists()
    # The module's cluster, whose owner (this process) runs, was left alone.
    assert cluster.alive_workers() == {h.address for h in cluster.hosts} and cluster.dir.is_dir()


def test_kill_host_kills_every_process_of_the_host(cluster: netns_cluster.NetnsCluster) -> None:
    victim, survivor = cluster.hosts[1], cluster.hosts[0]
    extra = start_in(cluster, victim)
    assert extra.pid in cluster.pids(victim)
    assert cluster.kill_host(victim) == []
    assert cluster.pids(victim) == [] and extra.wait(timeout=10) != 0
    deadline = time.monotonic() + 30
    while cluster.alive_workers() != {survivor.address} and time.monotonic() < deadline:
        time.sleep(0.5)
    assert cluster.alive_workers() == {survivor.address}
    # restart_host brings it back, as the shared fixture does for the next module.
    cluster.restart_host(victim)
    assert cluster.alive_workers() == {h.address for h in cluster.hosts}
    assert victim.proc is not None and victim.proc.pid in cluster.pids(victim)


def test_stop_leaves_nothing_behind(cluster: netns_cluster.NetnsCluster) -> None:
    host = cluster.hosts[0]
    # A process the cluster did not start itself, inside a host: stop() ends it too.
    extra = start_in(cluster, host)
    pids = {pid for h in cluster.all_hosts for pid in cluster.pids(h)}
    assert extra.pid in pids and host.proc is not None and host.proc.pid in pids
    names = [h.name for h in cluster.all_hosts]
    dirs = [cluster.dir, cluster.shared]
    assert all(d.is_dir() for d in dirs)

    assert cluster.stop() == []
    assert extra.wait(timeout=10) != 0
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(name in netns for name in names), netns
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert cluster.token not in links, links
    addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    assert f" {cluster.driver_host}/" not in addrs
    # No mount of the cluster's in any namespace: not the netns files, not a host's tmpfs.
    mounts = []
    for info in Path("/proc").glob("[0-9]*/mountinfo"):
        try:
            mounts += [line for line in info.read_text().splitlines() if cluster.token in line]
        except OSError:
            continue
    assert mounts == []
    assert not any(d.exists() for d in dirs)
    assert cluster.stop() == []  # idempotent
