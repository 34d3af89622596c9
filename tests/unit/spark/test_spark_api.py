"""sparkdl._internal.spark.spark_api without a JVM: what a master URL says about task slots, and which sessions
count as Spark Connect ones (the Connect paths themselves run in tests/e2e/test_connect.py)."""

from __future__ import annotations

import pytest

from sparkdl._internal.spark.spark_api import is_local_master, is_remote, master_slots


@pytest.mark.parametrize(
    ("master", "task_cpus", "slots"),
    [
        ("local", 1, 1),
        ("local[4]", 1, 4),
        ("local[4]", 2, 2),
        ("local[3, 2]", 1, 3),  # local[N, maxFailures]: N cores
        ("local-cluster[2,2,1024]", 1, 4),
        ("local-cluster[2, 3, 512]", 2, 2),  # 3 cores per worker, 2 per task: one slot each
        ("local[*]", 1, None),  # the server's cores, which a Connect client cannot count
        ("spark://10.0.0.1:7077", 1, None),
        ("yarn", 1, None),
        ("k8s://https://api:6443", 1, None),
    ],
)
def test_the_slots_a_master_url_fixes(master: str, task_cpus: int, slots: int | None) -> None:
    assert master_slots(master, task_cpus) == slots


def test_local_masters_run_tasks_in_the_drivers_jvm() -> None:
    assert is_local_master("local") and is_local_master("local[2]") and is_local_master("local[2, 3]")
    assert not is_local_master("local-cluster[2,1,1024]") and not is_local_master("spark://h:7077")


def test_a_connect_session_is_told_from_a_classic_one_by_its_class() -> None:
    pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    assert not is_remote(SparkSession.__new__(SparkSession))
    try:
        from pyspark.sql.connect.session import SparkSession as RemoteSession
    except ImportError:  # no Connect client (the classic stack)
        return
    assert is_remote(RemoteSession.__new__(RemoteSession))
