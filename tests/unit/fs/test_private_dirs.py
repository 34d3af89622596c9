"""Where sparkdl writes by default, without a JVM: the metrics of a run on remote storage go to
this user's private ``<temp dir>/sparkdl-<uid>``, a run directory the user set is used as given,
and ranks on the driver refuse a default root that others may write. Each test points the temp
dir at a fresh directory of its own (``temp_dir``); the runs and the dataset cache on a Spark
session are in tests/integration/test_private.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from resources import private_dirs
from resources.private_dirs import RUN_DIR_CONF, assert_private, returns_one

import sparkdl
from sparkdl._internal.driver.cluster import local_metrics_path, run_dir

# The fixture, shared with tests/integration/test_private.py.
temp_dir = private_dirs.temp_dir


def test_metrics_of_a_run_on_remote_storage_go_to_the_private_directory(temp_dir: Path) -> None:
    path = local_metrics_path("hdfs://nn:8020/runs/abc", "abc")
    mine = temp_dir / f"sparkdl-{os.getuid()}"
    assert path == mine / "runs" / "abc" / "metrics.jsonl"
    assert_private(mine / "runs")


def test_processes_on_the_driver_refuse_a_world_writable_default_root(temp_dir: Path) -> None:
    mine = temp_dir / f"sparkdl-{os.getuid()}"
    mine.mkdir()
    mine.chmod(0o777)
    with pytest.raises(sparkdl.ConfigError) as exc:
        sparkdl.TorchDistributor(num_processes=1, local_mode=True, use_gpu=False).run(returns_one)
    assert str(mine) in str(exc.value) and "TMPDIR" in str(exc.value)
    assert list(mine.iterdir()) == []


def test_a_run_dir_the_user_set_is_used_as_given(temp_dir: Path) -> None:
    chosen = temp_dir / "shared-runs"
    chosen.mkdir()
    chosen.chmod(0o777)  # not private, but chosen: sparkdl does not second-guess it
    assert run_dir({RUN_DIR_CONF: f"{chosen}/"}, "abc") == f"{chosen}/abc"
    assert run_dir({RUN_DIR_CONF: "hdfs://nn:8020/runs"}, "abc") == "hdfs://nn:8020/runs/abc"
    assert not (temp_dir / f"sparkdl-{os.getuid()}").exists()  # the default was not even made
