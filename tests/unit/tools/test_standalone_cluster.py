"""The environment tools/standalone_cluster.py and tools/netns_cluster.py give a test cluster's JVMs:
no stray conf reaches them, and, with pip's pyspark, their class path is a plain session's."""

from __future__ import annotations

from pathlib import Path

from standalone_cluster import conf_dir_env


def test_a_spark_home_without_conf_gets_no_conf_dir_even_if_the_caller_set_one(tmp_path: Path) -> None:
    env = conf_dir_env({"SPARK_CONF_DIR": "/etc/callers-cluster", "PATH": "/bin"}, tmp_path, tmp_path / "own")
    assert env == {"PATH": "/bin"}  # the launcher then puts <home>/conf/ (missing) first, as for a local session


def test_a_spark_home_with_conf_gets_the_clusters_empty_dir_instead(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "spark-defaults.conf").write_text("spark.master yarn\n")
    env = conf_dir_env({"SPARK_CONF_DIR": "/etc/callers-cluster"}, tmp_path, tmp_path / "own")
    assert env == {"SPARK_CONF_DIR": str(tmp_path / "own")}
