"""The ``sparkdl`` command line without a JVM: its parser and usage errors, the exit status of a
run, the doctor's Java row with no Java and with a fake one, ``--remote`` without a server, the
listener, and the doctor rows for the driver channel and Horovod's MPI controller built from
given facts. Most run the command as a real subprocess (``python -m sparkdl``); the doctor
with a real Java, and runs on Spark, are in tests/e2e/test_cli.py.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import path_without
from resources.cli_command import sparkdl

import sparkdl._internal.cli.runner as cli_run
from sparkdl._internal import cli
from sparkdl._internal.common.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "major"),
    [
        ('openjdk version "17.0.15" 2025-04-15', 17),
        ('java version "1.8.0_292"', 8),
        ('openjdk version "21-ea" 2023-09-19', 21),
        ('openjdk version "11.0.2" 2019-01-15', 11),
        ("no version here", None),
    ],
)
def test_parse_java_version(text: str, major: int | None) -> None:
    assert cli.parse_java_version(text) == major


def test_run_keeps_the_scripts_own_options() -> None:
    args = cli.build_parser().parse_args(["run", "-n", "2", "--max-attempts", "3", "train.py", "--lr", "0.1", "-n", "5"])
    assert (args.num_workers, args.max_attempts, args.script) == (2, 3, "train.py")
    assert args.script_args == ["--lr", "0.1", "-n", "5"]


def _fake_java(directory: Path, version_line: str) -> None:
    java = directory / "java"
    java.write_text(f"#!/bin/sh\necho '{version_line}' >&2\n")
    java.chmod(java.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize(
    ("version_line", "problem"),
    [
        (None, "no java on PATH and no JAVA_HOME"),
        ('openjdk version "11.0.2" 2019-01-15', "Java 11 is too old: sparkdl needs Java >= 17"),
    ],
)
def test_doctor_says_what_is_wrong_with_java_and_how_to_fix_it(tmp_path: Path, version_line: str | None, problem: str) -> None:
    if version_line is not None:
        _fake_java(tmp_path, version_line)
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(tmp_path)  # this directory only: no real java, no nvidia-smi
    out = sparkdl("doctor", env=env)  # without --no-spark: the Spark part is skipped, not tried
    assert out.returncode == 1, out.stdout + out.stderr
    assert problem in out.stdout
    assert "fix: install Java 17" in out.stdout
    assert "skipped: fix Java and pyspark first" in out.stdout


def test_run_refuses_a_missing_script(tmp_path: Path) -> None:
    out = sparkdl("run", "-n", "2", "nope.py", cwd=tmp_path)
    assert out.returncode == 2 and "nope.py: no such file" in out.stderr


@pytest.mark.parametrize(("error", "code"), [("RunFailedError", 1), ("RunTimeoutError", 124)])
def test_run_exit_status(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, error: str, code: int) -> None:
    """The mapping of run outcomes to exit codes, with sparkdl.run and the session stubbed out."""
    import sparkdl as package

    class Stopped:
        stopped = False

        def stop(self) -> None:
            Stopped.stopped = True

    def failing_run(*args: Any, **kwargs: Any) -> None:
        raise getattr(package, error)("the report", attempts=2, root_cause="rank 1 exited with code 3")

    script = tmp_path / "s.py"
    script.write_text("pass\n")
    monkeypatch.setattr(cli_run, "_session", lambda *a, **k: Stopped())
    monkeypatch.setattr(package, "run", failing_run)
    assert cli.main(["run", "-n", "2", str(script)]) == code
    assert Stopped.stopped


@pytest.mark.parametrize(("source", "line"), [
    ("import horovod.torch as hvd\n\nhvd.init()\n", 3),
    ("import horovod.torch\nhorovod.torch.init()\n", 2),
    ("from horovod import torch as hvd\nhvd.init()\n", 2),
    ("from horovod.torch import init, rank\ninit()\n", 2),
    ("from horovod.torch import *\ninit()\n", 2),
    ("def main():\n    import horovod.tensorflow.keras as hvd\n    hvd.init()\n", 3),
    # Not Horovod's init: torch.distributed's, another module's, an import without a call.
    ("import torch.distributed as dist\ndist.init_process_group('gloo')\n", None),
    ("import mylib as hvd\nhvd.init()\n", None),
    ("try:\n    import horovod.torch as hvd\nexcept ImportError:\n    hvd = None\n", None),
    ("this is not python(\n", None),
])
def test_horovod_init_is_found_in_a_script(source: str, line: int | None) -> None:
    assert cli_run.horovod_init_line(source) == line


def test_run_refuses_a_horovod_script_under_the_torch_backend(tmp_path: Path) -> None:
    script = tmp_path / "hvd_train.py"
    script.write_text("import horovod.torch as hvd\nhvd.init()\nprint(hvd.size())\n")
    out = sparkdl("run", "-n", "2", str(script), cwd=tmp_path)
    # A usage error before any session: not two one-process Horovod jobs that exit 0.
    assert out.returncode == 2, out.stdout + out.stderr
    assert "calls Horovod's init() (line 2)" in out.stderr and "--backend horovod" in out.stderr
    assert cli.build_parser().parse_args(["run", "--backend", "horovod", str(script)]).backend == "horovod"


def test_console_script_is_installed() -> None:
    exe = Path(sys.executable).parent / "sparkdl"
    assert exe.is_file(), "pip install -e . creates the sparkdl console script"
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("sparkdl ")


def test_help_shows_the_example() -> None:
    out = sparkdl("run", "--help")
    assert out.returncode == 0
    assert "sparkdl run -n 2 train.py --lr 0.1" in textwrap.dedent(out.stdout).replace("\n", " ").replace("  ", " ")


# ---- --remote (Spark Connect): what needs no server ------------------------------------------


@pytest.mark.parametrize("command", ["doctor", "run"])
@pytest.mark.parametrize("source", ["--remote", "SPARK_REMOTE"])
def test_remote_with_master_is_a_usage_error_naming_both(tmp_path: Path, command: str, source: str) -> None:
    (tmp_path / "s.py").write_text("raise SystemExit('must not run')\n")
    env = {k: v for k, v in os.environ.items() if k != "SPARK_REMOTE"}
    args = [command, "--master", "local[2]"]
    if source == "--remote":
        args += ["--remote", "sc://127.0.0.1:15002"]
    else:
        env["SPARK_REMOTE"] = "sc://127.0.0.1:15002"
    out = sparkdl(*args, *(["s.py"] if command == "run" else []), cwd=tmp_path, env=env, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "--master local[2]" in out.stderr and source in out.stderr and "sc://127.0.0.1:15002" in out.stderr, out.stderr
    assert out.stdout == ""  # refused before any check or session


def test_the_remote_url_comes_from_the_flag_then_the_confs_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from sparkdl._internal.cli.options import remote_url

    parse = cli.build_parser().parse_args
    monkeypatch.delenv("SPARK_REMOTE", raising=False)
    assert remote_url(parse(["doctor"]), {}) is None
    monkeypatch.setenv("SPARK_REMOTE", "sc://env:1")
    assert remote_url(parse(["doctor"]), {}) == "sc://env:1"
    assert remote_url(parse(["doctor"]), {"spark.remote": "sc://conf:2"}) == "sc://conf:2"
    assert remote_url(parse(["doctor", "--remote", "sc://flag:3"]), {"spark.remote": "sc://conf:2"}) == "sc://flag:3"
    with pytest.raises(ConfigError, match=r"--master local and --conf spark\.remote \(sc://conf:2\)"):
        remote_url(parse(["doctor", "--master", "local"]), {"spark.remote": "sc://conf:2"})


@pytest.mark.parametrize("command", ["doctor", "run"])
def test_a_connect_url_where_no_server_listens_fails_at_once(tmp_path: Path, command: str) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on once this block ends
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "s.py").write_text("raise SystemExit('must not run')\n")
    out = sparkdl(command, "--remote", f"sc://127.0.0.1:{port}", *(["s.py"] if command == "run" else []),
                  cwd=tmp_path, timeout=60)  # pyspark's client alone retries for minutes
    assert out.returncode == 1, out.stdout + out.stderr
    if command == "doctor" and not _connect_client_installed():
        # The classic stack has no Connect client: the doctor says so, and tries no session.
        assert "the Spark Connect client needs grpcio" in out.stdout and "pip install 'sparkdl[connect]'" in out.stdout
        assert "skipped: fix pyspark and the Spark Connect client first" in out.stdout
        return
    assert f"no Spark Connect server answers at 127.0.0.1:{port}" in out.stdout + out.stderr


def _connect_client_installed() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("grpc", "grpc_status", "zstandard"))


def test_the_listener_takes_connections_and_closes(tmp_path: Path) -> None:
    import socket

    from sparkdl._internal.cli.listen import Listener

    listener = Listener("127.0.0.1")
    with listener as (host, port):
        for _ in range(3):
            with socket.create_connection((host, port), timeout=5) as conn:
                assert conn.recv(1) == b""  # it sends nothing and closes
    assert listener.accepted == 3
    with pytest.raises(OSError), socket.create_connection((host, port), timeout=5):
        pass


class _FakeApi:
    remote = True

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def channel_host(self) -> str:
        return "10.1.2.3"

    def channel_mode(self) -> str:
        return self.mode


@pytest.mark.parametrize(("mode", "status"), [("direct", cli.ERROR), ("auto", cli.WARN), (None, cli.OK)])
def test_the_channel_row_says_which_hosts_do_not_reach_the_client(mode: str | None, status: str) -> None:
    from sparkdl._internal.cli.executors import _check_channel

    rows = [{"host": "a", "address": "10.0.0.1", "channel": None},
            {"host": "b", "address": "10.0.0.2", "channel": None if mode is None else "TimeoutError: timed out"}]
    report = cli.Report()
    _check_channel(report, _FakeApi(mode or "direct"), rows)  # type: ignore[arg-type]
    (row,) = report.checks
    assert (row.name, row.status, row.driver) == ("driver channel", status, "10.1.2.3")
    if mode is None:
        assert row.executors == "reached from 2/2 probe tasks"
    else:
        assert row.executors == "not reached from 10.0.0.2" and "TimeoutError" in row.problem
        assert "spark.sparkdl.channelHost" in row.fix and "run the client nearer the cluster" in row.fix


# ---- Horovod's MPI controller (RunConfig(horovod_controller='mpi')): optional, so info at most ----


def test_the_executor_probe_says_why_the_mpi_controller_cannot_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from sparkdl._internal.cli import executor_probe as probe

    assert probe._mpi(None) is None  # no Horovod: nothing to check
    if importlib.util.find_spec("horovod") is None:
        pytest.skip("Horovod is not installed")
    monkeypatch.setenv("PATH", path_without(tmp_path, "mpirun", "orted"))
    facts = probe._mpi("0.28.1")
    assert facts is not None and set(facts) == {"no"}
    if "needs Horovod built with PyTorch and Gloo" not in facts["no"]:  # else Horovod itself is unusable here
        assert facts["no"].startswith("no mpirun or orted on the PATH. "), facts


def test_the_mpi_row_names_the_executors_without_it_and_merges_the_drivers_reason() -> None:
    from sparkdl._internal.cli.executor_probe import MPI_ROW, check_executor_mpi

    no_mpi = {"no": "no mpirun or orted on the PATH. horovod_controller='mpi' needs Open MPI 4 (apt-get install openmpi-bin)"}
    ok = {"ok": "Horovod 0.28.1, Open MPI 4.1.4"}
    envs = [{"host": "a", "address": "10.0.0.1", "mpi": ok}, {"host": "b", "address": "10.0.0.2", "mpi": no_mpi},
            {"host": "c", "address": "10.0.0.3", "mpi": None}]
    report = cli.Report()
    report.add(MPI_ROW, cli.OK, ok["ok"])
    check_executor_mpi(report, envs)
    (row,) = report.checks
    assert row.executors == ("Horovod 0.28.1, Open MPI 4.1.4 on 1/3, needs horovod on 1/3, unavailable on 1/3")
    assert row.status == cli.INFO
    assert row.problem == ("optional: needed only for RunConfig(horovod_controller='mpi'); "
                           "on the executors on 10.0.0.2: no mpirun or orted on the PATH")
    assert row.fix == "horovod_controller='mpi' needs Open MPI 4 (apt-get install openmpi-bin)"
    # The driver lacks it for the same reason: said once, for both.
    report = cli.Report()
    report.add(MPI_ROW, cli.INFO, "unavailable", problem="optional: x; on this machine: no mpirun or orted on the PATH", fix="f")
    check_executor_mpi(report, envs[1:2])
    assert report.checks[0].problem == "optional: x; on this machine and on the executors on 10.0.0.2: no mpirun or orted on the PATH"
    assert (report.checks[0].executors, report.checks[0].fix) == ("unavailable on 1/1", "f")
    # No Horovod anywhere: the horovod row says it all.
    report = cli.Report()
    report.add(MPI_ROW, cli.INFO, "needs horovod")
    check_executor_mpi(report, [envs[2], {**envs[2], "host": "d", "address": "10.0.0.4"}])
    assert (report.checks[0].executors, report.checks[0].problem) == ("needs horovod on 2/2", "")
