"""Shared fixtures: one Spark session at a time for the whole test session, and leak checks.

Spark allows one SparkContext per process. Tests ask for the session they need through
``spark_session(master, conf)``; a request for the same master and confs reuses the running
session, another stops it and starts the new one. Tests marked ``cluster`` run last, so the
``local[2]`` session is shared by everything before them.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

# tools/ (standalone_cluster.py, netns_cluster.py) is not a package: tests import its modules by name.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

# Everything stays on loopback, and executors use this interpreter (the project's .venv).
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable

_BASE_CONF = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.python.worker.reuse": "true",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.driver.memory": "1g",
}

_current: dict[str, object] = {}


def _get_session(master: str, conf: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    from pyspark.sql import SparkSession

    key = (master, tuple(sorted((conf or {}).items())))
    if _current.get("key") == key:
        return _current["session"]
    old = _current.get("session")
    if old is not None:
        old.stop()  # type: ignore[attr-defined]
        _current.clear()
    builder = SparkSession.builder.master(master).appName("sparkdl-tests")
    for k, v in {**_BASE_CONF, **(conf or {})}.items():
        builder = builder.config(k, v)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    _current.update(key=key, session=session)
    return session


@pytest.fixture(scope="session")
def spark_session() -> Iterator[Callable[..., object]]:
    """A factory: ``spark_session("local[2]")`` or ``spark_session("local-cluster[2,1,1024]", conf)``."""
    yield _get_session
    session = _current.get("session")
    if session is not None:
        session.stop()  # type: ignore[attr-defined]
        _current.clear()


@pytest.fixture(scope="module")
def spark(spark_session):  # type: ignore[no-untyped-def]
    """The shared local[2] session."""
    return spark_session("local[2]")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Switching sessions costs seconds: keep every local[2] test before the cluster tests.
    items.sort(key=lambda item: 1 if item.get_closest_marker("cluster") else 0)


def _rank_processes() -> list[psutil.Process]:
    """Live rank processes: fresh interpreters (``-m sparkdl.rank``) and ranks forked by a zygote,
    and an MPI job's (mpirun, its daemons, sparkdl's agents and proxies)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "name", "status"]):
        cmd = proc.info.get("cmdline") or []
        name = proc.info.get("name") or ""
        if proc.info.get("status") == psutil.STATUS_ZOMBIE:
            continue
        if "sparkdl.rank" in cmd or name.startswith("sparkdl-rank") or "sparkdl.task.mpi_proxy" in cmd \
                or name in ("orted", "mpirun"):
            found.append(proc)
    return found


def _is_pyspark_daemon(proc: psutil.Process) -> bool:
    # PySpark's daemon (a child of the JVM) listens for its own workers; Spark owns it, not sparkdl.
    # The workers it forks share its command line but not its parent, and stay under watch.
    parent = proc.parent()
    return (
        "pyspark.daemon" in " ".join(proc.cmdline())
        and parent is not None
        and parent.name().startswith("java")
    )


def _listeners_outside_jvm() -> set[tuple[str, int, int]]:
    """Listening TCP sockets of non-JVM processes in this test process's tree."""
    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    found = set()
    for proc in procs:
        try:
            if proc.name().startswith("java") or _is_pyspark_daemon(proc):
                continue
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found.add((conn.laddr.ip, conn.laddr.port, proc.pid))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def wait_no_leaks(before: set[tuple[str, int, int]], timeout_s: float = 20.0) -> None:
    """Fails unless, within ``timeout_s``, no rank process runs and no new port listens."""
    deadline = time.monotonic() + timeout_s
    while True:
        ranks = _rank_processes()
        new_listeners = {(ip, port, pid) for ip, port, pid in _listeners_outside_jvm() - before}
        if not ranks and not new_listeners:
            return
        if time.monotonic() > deadline:
            details = [" ".join(p.cmdline()) + f" (pid {p.pid})" for p in ranks]
            for _, _, pid in new_listeners:
                try:
                    proc = psutil.Process(pid)
                    parent = proc.parent()
                    details.append(
                        f"listener pid {pid}: {' '.join(proc.cmdline())} "
                        f"(parent {parent.pid if parent else None} {parent.name() if parent else ''})"
                    )
                except psutil.NoSuchProcess:
                    pass
            raise AssertionError(
                f"left running after the run: rank processes {details}, listeners {new_listeners}"
            )
        time.sleep(0.2)


def wait_for_pids(proc: subprocess.Popen[Any], files: list[Path], timeout_s: float = 120) -> list[int]:
    """The pids that ranks wrote to ``files``, once all are there, while ``proc`` (their client) runs."""
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() and p.read_text() for p in files):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout and proc.stdout.read()[-3000:]
        time.sleep(0.2)
    pids = [int(p.read_text()) for p in files]
    assert all(psutil.pid_exists(pid) for pid in pids)
    return pids


def wait_ended(pids: list[int], timeout_s: float, after: str) -> None:
    """Fails unless every process of ``pids`` ends (or is a zombie) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while alive := [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]:
        assert time.monotonic() < deadline, f"ranks {alive} still run {timeout_s:g} s after {after}"
        time.sleep(0.2)


@pytest.fixture
def no_leaks() -> Iterator[None]:
    """Asserts that a test leaves no rank process running and no new port listening."""
    before = _listeners_outside_jvm()
    yield
    wait_no_leaks(before)


@pytest.fixture(scope="session")
def fake_gpus(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], str]:
    """A factory of GPU discovery scripts that give every fake worker GPUs of its own.

    ``fake_gpus(k)`` writes a script whose n-th call (Spark calls it once per worker) reports the
    addresses ``n*k .. n*k+k-1``; calls claim their n with ``mkdir``, which is atomic. Distinct
    addresses per worker are what let a test tell one executor's GPUs from another's.
    """

    def make(per_worker: int) -> str:
        directory = tmp_path_factory.mktemp("fake-gpus")
        (directory / "claims").mkdir()
        script = directory / "discover.sh"
        script.write_text(
            "#!/usr/bin/env bash\n"
            f"# Fake GPUs for tests: call n reports addresses n*{per_worker} .. n*{per_worker}+{per_worker - 1}.\n"
            f"n=0; while ! mkdir '{directory}/claims/'$n 2>/dev/null; do n=$((n+1)); done\n"
            f'first=$((n*{per_worker})); list=""\n'
            f'for ((i=first; i<first+{per_worker}; i++)); do list="$list${{list:+,}}\\"$i\\""; done\n'
            'echo "{\\"name\\": \\"gpu\\", \\"addresses\\": [$list]}"\n'
        )
        script.chmod(0o755)
        return str(script)

    return make


@pytest.fixture(scope="session")
def executor_gpus() -> Callable[[], dict[int, set[str]]]:
    """``executor_gpus()``: Spark's side of GPU assignment, each live executor JVM's pid -> the GPU
    addresses its worker allocated to it, read from the resources file on its command line
    (standalone and local-cluster pass ``--resourcesFile``), independently of sparkdl."""
    return _executor_gpus


def _executor_gpus() -> dict[int, set[str]]:
    import json

    found: dict[int, set[str]] = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        if (
            "org.apache.spark.executor.CoarseGrainedExecutorBackend" in cmd
            and "--resourcesFile" in cmd
        ):
            path = cmd[cmd.index("--resourcesFile") + 1]
            with open(path) as f:
                allocations = json.load(f)
            found[proc.info["pid"]] = {
                a for r in allocations if r["id"]["resourceName"] == "gpu" for a in r["addresses"]
            }
    return found


class OtherUser:
    """A throwaway Unix account on this host: another tenant, for the tests of issue 17."""

    def __init__(self, name: str) -> None:
        import pwd

        entry = pwd.getpwnam(name)
        self.name, self.uid, self.gid = name, entry.pw_uid, entry.pw_gid
        # The system's interpreter: the project's may sit where another user cannot reach it
        # (under /root). Attack scripts use the standard library only.
        self.python = "/usr/bin/python3"
        self._dirs: list[str] = []

    def shared_dir(self) -> Path:
        """A fresh directory this user can read and write (pytest's own are private to root)."""
        import tempfile

        path = tempfile.mkdtemp(prefix="sparkdl-tenant-")
        os.chmod(path, 0o777)
        self._dirs.append(path)
        return Path(path)

    def popen(self, args: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """Starts ``args`` as this user (no supplementary groups, its own session)."""
        kwargs.setdefault("start_new_session", True)
        kwargs.setdefault("env", {"PATH": "/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8"})
        return subprocess.Popen(args, user=self.uid, group=self.gid, extra_groups=[], **kwargs)  # type: ignore[call-overload, no-any-return]

    def run(self, args: list[str], timeout: float = 60, **kwargs: object) -> subprocess.CompletedProcess[bytes]:
        """Runs ``args`` as this user to the end (bounded by ``timeout``), output captured."""
        proc = self.popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return subprocess.CompletedProcess(args, proc.returncode, out, err)

    def processes(self) -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == self.uid]

    def end_all(self) -> None:
        import shutil

        for proc in self.processes():
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(self.processes(), timeout=10)
        for path in self._dirs:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def other_user() -> Iterator[OtherUser]:
    """A second local user, created for this test session and removed after it, with every
    process it still runs. Creating one needs root: elsewhere the test is skipped, and the skip
    (shown in the summary, ``-rs``) says why."""
    import secrets
    import shutil

    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("a second Unix user is needed and this test session cannot create one (not root, or no useradd)")
    if not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("a second Unix user is needed to run /usr/bin/python3, and this host has none")
    name = f"sdlt{secrets.token_hex(3)}"
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin", name],
        check=True, capture_output=True, timeout=30,
    )
    user = OtherUser(name)
    try:
        yield user
    finally:
        user.end_all()
        subprocess.run(["userdel", name], capture_output=True, timeout=30)


def path_without(tmp_path: Path, *names: str) -> str:
    """$PATH with each directory that holds one of ``names`` replaced by links to all else it holds."""
    dirs = []
    for i, entry in enumerate(os.environ["PATH"].split(os.pathsep)):
        d = Path(entry)
        if not any((d / n).exists() for n in names):
            dirs.append(entry)
            continue
        copy = tmp_path / f"path{i}"
        copy.mkdir()
        for f in d.iterdir():
            if f.name not in names:
                (copy / f.name).symlink_to(f)
        dirs.append(str(copy))
    return os.pathsep.join(dirs)
