"""A real Spark standalone cluster on loopback: one master and N workers, started with spark-class.

pip's pyspark ships ``bin/spark-class`` but not ``sbin/start-master.sh``; the daemons' main classes
start just as well by hand. Everything binds to 127.0.0.1 (``SPARK_LOCAL_IP`` and ``--host``),
on free ports, and every process started here (the daemons, the executors the workers launch,
their Python workers) is stopped by :meth:`StandaloneCluster.stop`.

As a context manager (the tests use it this way)::

    with StandaloneCluster(workers=2, cores=1, memory="1g") as cluster:
        subprocess.run([cluster.spark_submit, "--master", cluster.master_url, "jobs/etl.py"])

From a shell, to try spark-submit against a cluster (Ctrl-C stops it all)::

    .venv/bin/python tools/standalone_cluster.py --workers 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType

HOST = "127.0.0.1"


def spark_home() -> Path:
    """``$SPARK_HOME`` when it has bin/spark-class, else the pyspark package (pip's Spark)."""
    env = os.environ.get("SPARK_HOME")
    if env and (Path(env) / "bin" / "spark-class").is_file():
        return Path(env)
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def conf_dir_env(env: dict[str, str], home: Path, own: Path) -> dict[str, str]:
    """``env`` with the ``SPARK_CONF_DIR`` a test cluster's JVMs get, so that none reads a stray conf
    (the caller's ``SPARK_CONF_DIR``, a ``conf/`` in Spark's home): none at all where Spark's home
    has no ``conf/`` (pip's pyspark), so that their class path is the one pyspark's launcher gives a
    local session and they map the class archive the suite makes from one (tests/resources/jvm_archive.py);
    else ``own``, an empty directory of the cluster's (made by its ``start``)."""
    env = {k: v for k, v in env.items() if k != "SPARK_CONF_DIR"}
    if (home / "conf").exists():
        env["SPARK_CONF_DIR"] = str(own)
    return env


def free_port() -> int:
    """A port free on 127.0.0.1 right now (the daemon binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) == 0


class ClusterError(RuntimeError):
    """The cluster did not come up; the message holds the tails of the daemons' logs."""


class StandaloneCluster:
    """A master and ``workers`` workers of ``cores`` cores and ``memory`` each, on loopback.

    Args:
        workers: worker daemons to start.
        cores, memory: what each worker offers to executors.
        python: the interpreter executors run Python with (PYSPARK_PYTHON); default this one.
        start_timeout_s: bound on the master and all workers being up and registered.
        daemon_memory: heap of each daemon JVM (SPARK_DAEMON_MEMORY).
        master_port, webui_port: fixed ports for the master; default free ones.
    """

    def __init__(
        self,
        workers: int = 2,
        *,
        cores: int = 1,
        memory: str = "1g",
        python: str | None = None,
        start_timeout_s: float = 60.0,
        daemon_memory: str = "256m",
        master_port: int | None = None,
        webui_port: int | None = None,
        worker_opts: list[str] | None = None,
    ) -> None:
        self.workers = workers
        self.cores = cores
        self.memory = memory
        self.python = python or sys.executable
        self.start_timeout_s = start_timeout_s
        self.daemon_memory = daemon_memory
        self.home = spark_home()
        self.master_port = master_port or free_port()
        self.webui_port = webui_port or free_port()
        self.worker_opts = list(worker_opts or [])
        self.worker_ports: list[int] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        self.dir = Path(tempfile.mkdtemp(prefix="sparkdl-standalone-"))

    @property
    def master_url(self) -> str:
        return f"spark://{HOST}:{self.master_port}"

    @property
    def spark_submit(self) -> str:
        return str(self.home / "bin" / "spark-submit")

    @property
    def ports(self) -> list[int]:
        """Every port the daemons were told to listen on."""
        return [self.master_port, self.webui_port, *self.worker_ports]

    def env(self) -> dict[str, str]:
        """The environment of the daemons, and a good one for spark-submit against them."""
        env = dict(os.environ)
        env.update(
            SPARK_HOME=str(self.home),
            SPARK_LOCAL_IP=HOST,
            SPARK_DAEMON_MEMORY=self.daemon_memory,
            # The master's REST submission server would listen on a fixed port (6066): not needed.
            SPARK_MASTER_OPTS=f"{os.environ.get('SPARK_MASTER_OPTS', '')} -Dspark.master.rest.enabled=false".strip(),
            SPARK_WORKER_OPTS=" ".join([os.environ.get("SPARK_WORKER_OPTS", ""), *self.worker_opts]).strip(),
            PYSPARK_PYTHON=self.python,
            PYSPARK_DRIVER_PYTHON=self.python,
        )
        return conf_dir_env(env, self.home, self.dir / "conf")

    def _start(self, name: str, args: list[str]) -> None:
        log = self.dir / f"{name}.log"
        self.logs.append(log)
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [str(self.home / "bin" / "spark-class"), *args],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=self.env(), cwd=self.dir,
                # A process group of its own: stop() signals the daemon and everything it started.
                start_new_session=True,
            )
        self.procs.append(proc)

    def start(self) -> StandaloneCluster:
        """Starts the master, then the workers; returns once every worker is ALIVE on the master."""
        (self.dir / "conf").mkdir(exist_ok=True)  # empty: SPARK_CONF_DIR where Spark's home has a conf/
        try:
            self._start("master", [
                "org.apache.spark.deploy.master.Master",
                "--host", HOST, "--port", str(self.master_port), "--webui-port", str(self.webui_port),
            ])
            for i in range(self.workers):
                port, ui = free_port(), free_port()
                self.worker_ports += [port, ui]
                work = self.dir / f"worker-{i}"
                work.mkdir()
                self._start(f"worker-{i}", [
                    "org.apache.spark.deploy.worker.Worker",
                    "--host", HOST, "--port", str(port), "--webui-port", str(ui),
                    "--cores", str(self.cores), "--memory", self.memory, "--work-dir", str(work),
                    self.master_url,
                ])
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def status(self) -> dict[str, object] | None:
        """The master's status page as JSON, or None while it does not answer."""
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.webui_port}/json/", timeout=2) as resp:
                data: dict[str, object] = json.loads(resp.read())
                return data
        except (OSError, ValueError):
            return None

    def alive_workers(self) -> int:
        status = self.status() or {}
        workers = status.get("workers") or []
        return sum(1 for w in workers if isinstance(w, dict) and w.get("state") == "ALIVE")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            for proc, log in zip(self.procs, self.logs, strict=True):
                if proc.poll() is not None:
                    raise ClusterError(f"{log.stem} exited with {proc.returncode} while starting\n{self.log_tails()}")
            if self.alive_workers() == self.workers:
                return
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"the cluster was not up after {self.start_timeout_s:g} s (start_timeout_s): "
                    f"{self.alive_workers()} of {self.workers} workers ALIVE\n{self.log_tails()}"
                )
            time.sleep(0.25)

    def log_tails(self, lines: int = 15) -> str:
        parts = []
        for log in self.logs:
            text = log.read_text(errors="replace").splitlines() if log.exists() else []
            parts.append(f"--- {log.name} (last {lines} lines)\n" + "\n".join(text[-lines:]))
        return "\n".join(parts)

    def pids(self) -> set[int]:
        """Every live process of the cluster: the daemons and all their descendants."""
        import psutil

        found: set[int] = set()
        for proc in self.procs:
            try:
                parent = psutil.Process(proc.pid)
                found.add(parent.pid)
                found.update(c.pid for c in parent.children(recursive=True))
            except psutil.NoSuchProcess:
                continue
        return found

    def stop(self, timeout_s: float = 20.0) -> list[int]:
        """Stops every process the cluster started; returns the pids still alive (none, normally)."""
        import psutil

        pids = self.pids()
        # Workers first, so that the master does not try to reschedule on survivors.
        for proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        # Whatever is left, in the daemons' groups or started in a new session by a child.
        survivors = []
        for pid in pids:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    p.kill()
                    survivors.append(p)
            except psutil.NoSuchProcess:
                continue
        psutil.wait_procs(survivors, timeout=10)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        return alive

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> StandaloneCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
        self.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Runs a Spark standalone cluster on 127.0.0.1 until Ctrl-C.")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cores", type=int, default=1, help="cores per worker")
    p.add_argument("--memory", default="1g", help="memory per worker")
    p.add_argument("--port", type=int, default=7077, help="master port (default: %(default)s)")
    p.add_argument("--webui-port", type=int, default=8080, help="master web UI port (default: %(default)s)")
    args = p.parse_args(argv)
    cluster = StandaloneCluster(args.workers, cores=args.cores, memory=args.memory,
                                master_port=args.port, webui_port=args.webui_port)
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    with cluster:
        print(f"master {cluster.master_url}, web UI http://{HOST}:{cluster.webui_port}, {args.workers} workers; Ctrl-C stops")
        print(f"  SPARK_LOCAL_IP={HOST} {cluster.spark_submit} --master {cluster.master_url} "
              f"--conf spark.pyspark.python={cluster.python} jobs/train.py", flush=True)
        while not stop:
            time.sleep(0.5)
    print("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
