"""Where a run's directory goes without spark.sparkdl.runDir: on the cluster's Hadoop default file
system when that is not local (fs.defaultFS), here a real FTP server, else the driver's temp dir."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest
from resources.ftp import ftp_server

from sparkdl._internal.driver.cluster import RUN_DIR_CONF, run_dir, runs_root
from sparkdl._internal.fs.private import user_root


def test_a_remote_default_file_system_holds_the_runs_under_the_users_home(tmp_path: Path) -> None:
    with ftp_server(tmp_path) as base:
        root = runs_root({}, default_fs=base + "/", user="alice")
        assert root == f"{base}/user/alice/sparkdl/runs"
        assert (tmp_path / "user" / "alice" / "sparkdl" / "runs").is_dir()  # created on the server
        assert run_dir({}, "0123abcd", default_fs=base, user="alice") == f"{root}/0123abcd"
        # What the user set wins, as given.
        assert runs_root({RUN_DIR_CONF: "/mnt/shared/runs"}, default_fs=base, user="alice") == "/mnt/shared/runs"


def test_a_local_default_file_system_keeps_the_private_temp_dir() -> None:
    for default_fs in (None, "file:///", "/"):
        assert Path(runs_root({}, default_fs=default_fs)) == user_root() / "runs"


def test_a_default_file_system_the_driver_cannot_write_falls_back_saying_what_to_set(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    caplog.set_level(logging.WARNING, logger="sparkdl._internal.driver.cluster")
    assert Path(runs_root({}, default_fs=f"ftp://trainer:s3cret@127.0.0.1:{port}", user="bob")) == user_root() / "runs"
    said = caplog.text
    assert "fs.defaultFS" in said and RUN_DIR_CONF in said and f"127.0.0.1:{port}/user/bob/sparkdl/runs" in said
    assert "s3cret" not in said
