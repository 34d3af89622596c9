"""Another tenant on the same host (issue 17): the zygote, a rank's process tree, its descriptors.

The attacks run for real: a throwaway Unix account (the ``other_user`` fixture; skipped with a
printed reason where the session cannot create one) binds the zygote's address before a run, or
connects to a live zygote and asks it to fork; a process of the same user without the
executor's key tries the same. Each test asserts the run's result, that the attacker received
nothing and started nothing, and that nothing was left running. The zygote's handshake and key
file, which need no Spark and no other user, are in tests/unit/task/test_zygote_tenant.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import cloudpickle
import psutil
import pytest
from conftest import owned
from resources import zygotes

import sparkdl
from sparkdl._internal.task.spawn import Zygote

cloudpickle.register_pickle_by_value(sys.modules[__name__])

FAST = sparkdl.RunConfig(start_timeout_s=60, slot_wait_s=2, connect_timeout_s=20, kill_grace_s=20, echo_logs=False)

# Listens on an abstract Unix socket and writes, for every connection, what arrived on it in
# the two seconds after (bytes and descriptors) to a JSON-lines log. Standard library only: it
# runs under the other user's /usr/bin/python3.
LISTENER = textwrap.dedent("""
    import array, json, socket, sys, time
    address, log = sys.argv[1], sys.argv[2]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind("\\0" + address)
    s.listen(16)
    print("listening", flush=True)
    while True:
        conn, _ = s.accept()
        conn.settimeout(2)
        got, fds = 0, 0
        try:
            while True:
                data, anc, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(64 * 4))
                if not data and not anc:
                    break
                got += len(data)
                for level, kind, payload in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds += len(payload) // 4
        except (OSError, socket.timeout):
            pass
        with open(log, "a") as f:
            f.write(json.dumps({"bytes": got, "fds": fds}) + "\\n")
        conn.close()
""")

# Connects to a zygote and asks it to fork, skipping the handshake, then with a made-up proof;
# prints what it got back. Standard library only.
IMPOSTOR = textwrap.dedent("""
    import json, os, socket, sys
    address = sys.argv[1]
    request = json.dumps({"workdir": "/nonexistent", "env": {}, "cwd": "/", "sys_path": [], "name": "x"}).encode()
    replies = []
    for opening in ([request], [json.dumps({"hello": os.urandom(32).hex()}).encode(), json.dumps({"proof": "00" * 32}).encode(), request]):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(10)
        try:
            s.connect("\\0" + address)
            got = []
            for packet in opening:
                s.send(packet)
                data = s.recv(4096)
                got.append(data.decode(errors="replace"))
                if not data:
                    break
        except OSError as exc:
            got = ["error " + type(exc).__name__]
        replies.append(got)
        s.close()
    print(json.dumps(replies), flush=True)
""")


def _zygotes() -> list[psutil.Process]:
    """This user's zygotes that this test process started (not another test worker's)."""
    return [p for p in psutil.process_iter(["name", "uids"]) if p.info["name"] == "sparkdl-zygote"
            and p.info["uids"].real == os.getuid() and owned(p)]


def _end(procs: list[psutil.Process]) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(procs, timeout=10)


def _executor_zygote_address(spark: Any) -> str:
    """The address sparkdl's tasks on this executor use, computed inside a real Python worker."""
    import pyarrow as pa

    def address(batches: Any) -> Any:
        for _ in batches:
            pass
        from sparkdl._internal.task.spawn import executor_key, zygote_address

        yield pa.RecordBatch.from_pydict({"a": [zygote_address(executor_key())]})

    found = {row.a for row in spark.range(2).repartition(2).mapInArrow(address, "a string").collect()}
    assert len(found) == 1, found
    return found.pop()


def _parent_name() -> str:
    parent = psutil.Process().parent()
    return parent.name() if parent else ""


def test_another_user_holding_the_zygote_address_gets_nothing_and_the_run_succeeds(
    spark, other_user, tmp_path: Path, no_leaks
) -> None:  # type: ignore[no-untyped-def]
    _end(_zygotes())  # the executor's zygote is gone, as after an OOM kill: its address is free
    address = _executor_zygote_address(spark)
    shared = other_user.shared_dir()
    (shared / "listener.py").write_text(LISTENER)
    log = shared / "log.jsonl"
    attacker = other_user.popen([other_user.python, str(shared / "listener.py"), address, str(log)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert attacker.stdout is not None
        assert attacker.stdout.readline() == b"listening\n", attacker.stderr.read() if attacker.stderr else ""
        parents = sparkdl.run(_parent_name, num_workers=2, config=FAST)
        # Every task found the address held by someone else, sent nothing, and started its rank
        # as a fresh interpreter instead: the run's result is right.
        assert parents != "sparkdl-zygote"
        time.sleep(2.5)  # the listener logs a connection 2 s after it opened
        seen = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        assert seen, "the tasks were expected to reach the attacker's address and turn away"
        assert all(entry == {"bytes": 0, "fds": 0} for entry in seen), seen
    finally:
        attacker.kill()
        attacker.wait(timeout=10)
    # Once the address is free again, the next run has its warm zygote back.
    assert sparkdl.run(_parent_name, num_workers=2, config=FAST) == "sparkdl-zygote"


# The fixture, shared with tests/unit/task/test_zygote_tenant.py.
zygote = zygotes.zygote


def test_neither_another_user_nor_a_keyless_process_of_this_user_can_have_the_zygote_fork(
    zygote: Any, other_user: Any, tmp_path: Path
) -> None:
    address, key, proc = zygote
    script = other_user.shared_dir() / "impostor.py"
    script.write_text(IMPOSTOR)
    script.chmod(0o644)
    as_other = other_user.run([other_user.python, str(script), address], timeout=60)
    as_self = subprocess.run([sys.executable, str(script), address], capture_output=True, timeout=60)
    for result in (as_other, as_self):
        assert result.returncode == 0, result.stderr
        for replies in json.loads(result.stdout):
            # The zygote answers a hello with its half of the handshake (a nonce and a proof that
            # tells nothing), and closes the connection at the first wrong step: no pid, no error.
            assert replies[-1] in ("", "error ConnectionResetError", "error BrokenPipeError"), replies
            assert not any('"pid"' in reply or '"error"' in reply for reply in replies), replies
    assert psutil.Process(proc.pid).children() == [], "the zygote forked for an impostor"
    # The genuine task, with the key, is served.
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect("\0" + address)
    z = Zygote(sock, key, timeout_s=10)
    assert z.alive()
    z.close()


def _start_a_daemon(pid_file: str, then: str) -> int:
    """Starts `sleep` in a session of its own through an intermediate that exits (a daemon, as
    double-forking tools start them), records its pid, then returns or dies as ``then`` says."""
    subprocess.run(
        [sys.executable, "-c",
         "import subprocess, sys; p = subprocess.Popen(['sleep', '300'], start_new_session=True); "
         "open(sys.argv[1], 'w').write(str(p.pid))", pid_file],
        check=True, timeout=30,
    )
    if then == "dies":
        os.kill(os.getpid(), signal.SIGKILL)
    return int(Path(pid_file).read_text())


def _gone(pid: int, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("prewarm", [True, False], ids=["forked", "fresh"])
@pytest.mark.parametrize("then", ["returns", "dies"])
def test_a_daemon_a_rank_started_in_its_own_session_ends_with_the_rank(
    spark, tmp_path: Path, prewarm: bool, then: str, no_leaks
) -> None:  # type: ignore[no-untyped-def]
    pid_file = tmp_path / "daemon.pid"
    cfg = FAST.replace(prewarm=prewarm, max_attempts=1)
    if then == "returns":
        sparkdl.run(_start_a_daemon, str(pid_file), then, num_workers=1, config=cfg)
    else:
        with pytest.raises(sparkdl.RunFailedError):
            sparkdl.run(_start_a_daemon, str(pid_file), then, num_workers=1, config=cfg)
    daemon = int(pid_file.read_text())
    # The rank's process group never held it (setsid); it ended all the same.
    assert _gone(daemon), psutil.Process(daemon).as_dict(["name", "ppid", "status"])


def _open_descriptors_of_a_child() -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", "import os; print(' '.join(sorted(os.listdir('/proc/self/fd'), key=int)))"],
        close_fds=False, capture_output=True, text=True, timeout=30, check=True,
    )
    return out.stdout.split()


def test_what_a_rank_starts_inherits_none_of_the_tasks_descriptors(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    # Even with close_fds=False: the lifeline, control and metrics pipes, rank 0's store socket
    # and the descriptors of torch's store and gloo stay in the rank. 0-2 are the child's stdio,
    # 3 its listdir.
    for fds in sparkdl.run(_gather_descriptors, num_workers=2, config=FAST):
        assert set(fds) <= {"0", "1", "2", "3"}, fds


def _gather_descriptors() -> list[list[str]]:
    import torch
    import torch.distributed as dist

    mine = [int(fd) for fd in _open_descriptors_of_a_child()]
    row = torch.full((16,), -1, dtype=torch.long)
    row[: len(mine)] = torch.tensor(mine[:16])
    gathered = [torch.zeros(16, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, row)
    return [[str(int(v)) for v in g if v >= 0] for g in gathered]


LOCAL_SESSION_OFF_LOOPBACK = textwrap.dedent("""
    import json, os, sys
    import psutil
    import sparkdl
    from pyspark.sql import SparkSession

    host = sys.argv[1]
    # A user's own local session, on the host's address rather than loopback, as Spark picks it
    # when spark.driver.host is unset on a host whose name resolves to its LAN address.
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.driver.host", host).config("spark.driver.bindAddress", host).getOrCreate())

    def listeners():
        import torch.distributed as dist

        dist.barrier()  # every rank's gloo pairs are up
        found = []
        for conn in psutil.net_connections(kind="inet"):
            if conn.status != psutil.CONN_LISTEN or conn.pid is None:
                continue
            try:
                name = psutil.Process(conn.pid).name()
            except psutil.NoSuchProcess:
                continue
            if not name.startswith("java"):  # Spark's own listeners are Spark's business
                found.append([conn.laddr.ip, conn.laddr.port, name, " ".join(psutil.Process(conn.pid).cmdline()[:4])])
        dist.barrier()
        return found

    print("LISTENERS " + json.dumps(sparkdl.run(listeners, num_workers=2, config=sparkdl.RunConfig(echo_logs=False))), flush=True)
    spark.stop()
""")


@pytest.fixture
def host_namespace() -> Any:
    """A network namespace with loopback and one address on a veth of its own (10.213.7.1/24),
    whose other end stays down in the root namespace: a host on a private subnet that no packet
    leaves. Removed, with every process in it, after the test."""
    import shutil

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a network namespace is needed and this test session cannot create one (not root, or no iproute2)")
    name = f"sdl{secrets.token_hex(3)}"
    outer = f"sdlh{secrets.token_hex(3)}"
    steps = [
        ["ip", "netns", "add", name],
        ["ip", "-n", name, "link", "set", "lo", "up"],
        ["ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", name],
        ["ip", "-n", name, "addr", "add", "10.213.7.1/24", "dev", "eth0"],
        ["ip", "-n", name, "link", "set", "eth0", "up"],
    ]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True, timeout=30)
        yield name, "10.213.7.1"
    finally:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "link", "del", outer], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def test_a_local_session_on_the_hosts_address_keeps_every_sparkdl_listener_on_loopback(
    host_namespace: Any, tmp_path: Path
) -> None:
    name, address = host_namespace
    script = tmp_path / "off_loopback.py"
    script.write_text(LOCAL_SESSION_OFF_LOOPBACK)
    env = {**os.environ, "SPARK_LOCAL_IP": address, "PYSPARK_PYTHON": sys.executable}
    out = subprocess.run(["ip", "netns", "exec", name, sys.executable, str(script), address],
                         capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith("LISTENERS ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    listeners = json.loads(lines[0].split(" ", 1)[1])
    # The driver's channel, the TCPStore and gloo: all present, all on 127.0.0.1.
    assert any("sparkdl._internal.rank" in cmd or proc.startswith("sparkdl-rank") for _, _, proc, cmd in listeners), listeners
    assert {ip for ip, *_ in listeners} == {"127.0.0.1"}, listeners
