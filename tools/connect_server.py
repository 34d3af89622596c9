"""A Spark Connect server on loopback, from the jar that ships with pip's pyspark 4.

    with ConnectServer(master="local[2]") as server:   # tests/e2e/test_connect.py, benchmarks
        spark = SparkSession.builder.remote(server.url).getOrCreate()

The server is ``spark-submit --class org.apache.spark.sql.connect.service.SparkConnectServer``
in a process group of its own, bound on ``host`` (127.0.0.1) at a free port, its executors
running ``python`` (default this interpreter). stop() ends the group (the server's JVM and its
Python workers); it is idempotent and also runs at exit. From a shell (Ctrl-C stops it):
``.venv/bin/python tools/connect_server.py --master local[2]`` prints the ``sc://`` URL.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

try:
    from standalone_cluster import ClusterError, spark_home
except ImportError:  # loaded by path, without tools/ on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from standalone_cluster import ClusterError, spark_home

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


def connect_available() -> str | None:
    """Why no Connect server or client can run here (a reason for pytest.skip), or None."""
    try:
        import pyspark
    except ImportError:
        return "pyspark is not installed"
    if int(pyspark.__version__.split(".")[0]) < 4:
        return f"Spark Connect is tested with pyspark 4 (this is {pyspark.__version__}, the classic stack)"
    missing = []
    for module in ("grpc", "grpc_status", "google.rpc", "zstandard"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        return f"the Spark Connect client needs {', '.join(missing)}: pip install 'pyspark[connect]'"
    if not any(spark_home().glob("jars/spark-connect_*.jar")):
        return f"no spark-connect jar in {spark_home() / 'jars'}"
    return None


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ConnectServer:
    """One Spark Connect server; ``confs`` go to its Spark application."""

    def __init__(self, master: str = "local[2]", *, host: str = "127.0.0.1", port: int | None = None,
                 python: str | None = None, confs: dict[str, str] | None = None, start_timeout_s: float = 90.0,
                 driver_memory: str = "1g") -> None:
        self.master, self.host, self.port = master, host, port or free_port(host)
        self.python = python or sys.executable
        self.confs = dict(confs or {})
        self.start_timeout_s, self.driver_memory = start_timeout_s, driver_memory
        self.dir = Path(tempfile.mkdtemp(prefix="sparkdl-connect-"))
        self.log = self.dir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"sc://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        confs = {
            "spark.connect.grpc.binding.address": self.host, "spark.connect.grpc.binding.port": str(self.port),
            "spark.driver.host": self.host, "spark.driver.bindAddress": self.host, "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false", "spark.pyspark.python": self.python,
            "spark.driver.memory": self.driver_memory, **self.confs,
        }
        flat = [arg for key, value in confs.items() for arg in ("--conf", f"{key}={value}")]
        return [str(spark_home() / "bin" / "spark-submit"), "--class", SERVER_CLASS, "--master", self.master,
                "--name", "sparkdl-connect", *flat, "spark-internal"]

    def start(self) -> ConnectServer:
        if reason := connect_available():
            raise ClusterError(reason)
        # Spark's scratch (blockmgr-*, spark-*/userFiles, Connect's artifacts-*) goes to java.io.tmpdir:
        # under the server's directory, cleanup() removes it also after a SIGKILL, which skips the
        # JVM's own removal of it.
        scratch = self.dir / "tmp"
        scratch.mkdir(exist_ok=True)
        java_opts = f"{os.environ.get('JAVA_TOOL_OPTIONS', '')} -Djava.io.tmpdir={scratch}".strip()
        env = {**os.environ, "SPARK_HOME": str(spark_home()), "SPARK_LOCAL_IP": self.host,
               "PYSPARK_PYTHON": self.python, "SPARK_NO_DAEMONIZE": "1", "JAVA_TOOL_OPTIONS": java_opts}
        atexit.register(self.stop)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env=env, cwd=self.dir, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise ClusterError(f"the Connect server exited ({self.proc.returncode}) while starting:\n{self.tail()}")
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=1):
                if "Spark Connect server started" in self.log.read_text(errors="replace"):
                    return
            if time.monotonic() > deadline:
                raise ClusterError(f"the Connect server did not listen on {self.url} within "
                                   f"{self.start_timeout_s:g} s:\n{self.tail()}")
            time.sleep(0.25)

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        """Ends the server's process group (SIGTERM, then SIGKILL after 15 s); idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None:
            for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=wait_s)
                    break
            with contextlib.suppress(ProcessLookupError):  # whatever of the group outlived the JVM
                os.killpg(proc.pid, signal.SIGKILL)
        atexit.unregister(self.stop)

    def cleanup(self) -> None:
        """stop(), then removes the server's directory (its log)."""
        self.stop()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ConnectServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Runs a Spark Connect server on loopback until Ctrl-C.")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--port", type=int, default=15002)
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    confs = dict(c.split("=", 1) for c in args.conf)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt), ConnectServer(args.master, port=args.port, confs=confs) as server:
        print(f"Spark Connect server at {server.url} (master {server.master}, log {server.log}); Ctrl-C stops it",
              flush=True)
        while True:
            time.sleep(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
