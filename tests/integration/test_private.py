"""Where sparkdl writes by default is this user's own: ``<temp dir>/sparkdl-<uid>``, mode 0700.

Each test points the temp dir at a fresh directory of its own (``tempfile.tempdir``; sparkdl
resolves its defaults in the driver, this process), made like /tmp (mode 1777) so that a second
user can create in it too. Runs and the dataset cache go through the public entry points on the
shared local[2] session; a directory that is not private is refused before anything is read from
or written into it, with a ConfigError that names it and the setting that moves it. What needs
no Spark session (the metrics of a remote run, a run directory the user set, ranks on the
driver) is in tests/unit/fs/test_private_dirs.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
from resources import private_dirs
from resources.ftp import ftp_server
from resources.private_dirs import RUN_DIR_CONF, assert_private, returns_one

import sparkdl
from sparkdl._internal.data.writing.cache import CACHE_DIR_CONF

# The rank functions below travel by value, as a notebook's functions do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# One rank, no process group, no zygote: the smallest real run; every wait bounded.
FAST = sparkdl.RunConfig(
    start_timeout_s=60, slot_wait_s=2, connect_timeout_s=20, kill_grace_s=20, timeout_s=90,
    prewarm=False, init_process_group=False,
)

# The fixture, shared with tests/unit/fs/test_private_dirs.py.
temp_dir = private_dirs.temp_dir


@pytest.fixture
def no_cache_conf(spark: Any) -> Any:
    """The shared session, with spark.sparkdl.cacheDir unset (the default cache)."""
    spark.conf.unset(CACHE_DIR_CONF)
    return spark


def saves_a_checkpoint() -> int:
    sparkdl.context().save_checkpoint({"step": 1})
    return sparkdl.context().rank


# --- what is created ---------------------------------------------------------------------------


@pytest.mark.spark
def test_a_run_without_run_dir_writes_under_a_private_directory(spark: Any, temp_dir: Path, no_leaks: None) -> None:
    result = sparkdl.launch(saves_a_checkpoint, num_workers=1, config=FAST)
    assert result.value == 0
    mine = temp_dir / f"sparkdl-{os.getuid()}"
    assert_private(mine)
    assert_private(mine / "runs")
    assert result.run_dir == str(mine / "runs" / result.run_id)
    assert result.checkpoint_dir.endswith(f"{mine}/runs/{result.run_id}/checkpoints")
    assert any((mine / "runs" / result.run_id / "checkpoints").iterdir()), "no checkpoint was written"
    assert result.metrics_path == str(mine / "runs" / result.run_id / "metrics.jsonl")


@pytest.mark.spark
def test_on_a_cluster_whose_default_file_system_is_remote_runs_go_there(
    spark: Any, temp_dir: Path, tmp_path: Path, no_leaks: None
) -> None:
    # fs.defaultFS as core-site.xml sets it on a YARN cluster (hdfs://...); here a real FTP server.
    hadoop = spark.sparkContext._jsc.hadoopConfiguration()
    before = hadoop.get("fs.defaultFS")
    served = tmp_path / "ftp-root"
    served.mkdir()
    with ftp_server(served) as base:
        hadoop.set("fs.defaultFS", base + "/")
        try:
            result = sparkdl.launch(saves_a_checkpoint, num_workers=1, config=FAST)
        finally:
            hadoop.set("fs.defaultFS", before)
    user = spark.sparkContext.sparkUser()
    assert result.value == 0
    assert result.run_dir == f"{base}/user/{user}/sparkdl/runs/{result.run_id}"
    written = served / "user" / user / "sparkdl" / "runs" / result.run_id / "checkpoints"
    assert any(written.iterdir()), "no checkpoint reached the default file system"
    assert not (temp_dir / f"sparkdl-{os.getuid()}" / "runs" / result.run_id / "checkpoints").exists()


@pytest.mark.spark
def test_the_default_dataset_cache_is_a_private_directory(no_cache_conf: Any, temp_dir: Path) -> None:
    ds = sparkdl.write_dataset(no_cache_conf.range(8).selectExpr("id", "id * 2 AS label"), num_files=1)
    mine = temp_dir / f"sparkdl-{os.getuid()}"
    assert_private(mine)
    assert_private(mine / "cache")
    assert ds.url.startswith(f"file://{mine}/cache/") and ds.num_rows == 8


# --- what is refused ---------------------------------------------------------------------------


@pytest.mark.spark
def test_a_world_writable_default_root_is_refused_by_a_run(spark: Any, temp_dir: Path) -> None:
    mine = temp_dir / f"sparkdl-{os.getuid()}"
    mine.mkdir()
    mine.chmod(0o777)
    with pytest.raises(sparkdl.ConfigError) as exc:
        sparkdl.run(returns_one, num_workers=1, config=FAST)
    assert str(mine) in str(exc.value) and RUN_DIR_CONF in str(exc.value) and "writable by other users" in str(exc.value)
    assert list(mine.iterdir()) == []


@pytest.mark.spark
def test_a_symlinked_default_root_is_refused_by_the_cache(no_cache_conf: Any, temp_dir: Path) -> None:
    decoy = temp_dir / "decoy"
    decoy.mkdir(mode=0o700)
    mine = temp_dir / f"sparkdl-{os.getuid()}"
    mine.symlink_to(decoy)
    with pytest.raises(sparkdl.ConfigError) as exc:
        sparkdl.write_dataset(no_cache_conf.range(4).selectExpr("id AS label"), num_files=1)
    assert str(mine) in str(exc.value) and CACHE_DIR_CONF in str(exc.value) and "symlink" in str(exc.value)
    assert list(decoy.iterdir()) == []


@pytest.mark.spark
def test_a_world_writable_cache_directory_is_refused_but_a_chosen_one_is_used(no_cache_conf: Any, temp_dir: Path) -> None:
    mine = temp_dir / f"sparkdl-{os.getuid()}"
    mine.mkdir(mode=0o700)
    (mine / "cache").mkdir()
    (mine / "cache").chmod(0o777)
    df = no_cache_conf.range(4).selectExpr("id AS label")
    with pytest.raises(sparkdl.ConfigError) as exc:
        sparkdl.write_dataset(df, num_files=1)
    assert str(mine / "cache") in str(exc.value) and CACHE_DIR_CONF in str(exc.value)
    assert list((mine / "cache").iterdir()) == []
    # The same directory, named by the user, is the user's choice: used as given.
    no_cache_conf.conf.set(CACHE_DIR_CONF, str(mine / "cache"))
    try:
        ds = sparkdl.write_dataset(df, num_files=1)
    finally:
        no_cache_conf.conf.unset(CACHE_DIR_CONF)
    assert ds.url.startswith(f"file://{mine}/cache/") and ds.num_rows == 4


# --- another user on the same host -------------------------------------------------------------


@pytest.mark.spark
def test_a_root_another_user_created_first_gets_nothing(no_cache_conf: Any, temp_dir: Path, other_user: Any) -> None:
    mine = temp_dir / f"sparkdl-{os.getuid()}"
    # The other tenant squats on this user's name first, open to everyone.
    squat = other_user.run(
        [other_user.python, "-c", "import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o777)", str(mine)],
        timeout=30,
    )
    assert squat.returncode == 0, squat.stderr.decode()
    assert mine.stat().st_uid == other_user.uid

    with pytest.raises(sparkdl.ConfigError) as exc:
        sparkdl.run(returns_one, num_workers=1, config=FAST)
    message = str(exc.value)
    assert str(mine) in message and RUN_DIR_CONF in message and f"uid {other_user.uid}" in message

    with pytest.raises(sparkdl.ConfigError) as exc:
        sparkdl.write_dataset(no_cache_conf.range(4).selectExpr("id AS label"), num_files=1)
    assert str(mine) in str(exc.value) and CACHE_DIR_CONF in str(exc.value)

    assert list(mine.iterdir()) == []
