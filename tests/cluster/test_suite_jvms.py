"""The suite's JVMs map Spark's classes from the archive tests/conftest.py points them at
(tests/resources/jvm_archive.py): the driver and the executors of a ``local-cluster`` session. If
an upgrade of pyspark or Java changed the class path the launcher gives them, the JVMs would load
every class from the jars again, silently, and each would take 4-5 s more CPU to start."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import psutil
import pytest
from conftest import JVM_ARCHIVE, child_jvms

pytestmark = [pytest.mark.spark, pytest.mark.cluster]


def _archive() -> Path:
    found = re.search(r"-XX:SharedArchiveFile=(\S+)", os.environ.get("JAVA_TOOL_OPTIONS", ""))
    assert found, f"JAVA_TOOL_OPTIONS names no archive: {os.environ.get('JAVA_TOOL_OPTIONS')!r}"
    return Path(found.group(1))


@pytest.mark.skipif(not JVM_ARCHIVE, reason="SPARKDL_TEST_JVM_ARCHIVE=0")
def test_the_driver_and_executors_map_the_class_archive(local_cluster) -> None:  # type: ignore[no-untyped-def]
    archive = _archive()
    assert archive.is_file(), archive
    local_cluster.range(4).repartition(2).count()  # both executors at work
    jvms = {}  # pid -> (command line, the files it maps), of every live JVM this process started
    for proc in child_jvms(psutil.Process()):
        with contextlib.suppress(psutil.Error):  # a JVM that ended meanwhile
            jvms[proc.pid] = (" ".join(proc.cmdline()), {m.path for m in proc.memory_maps(grouped=True)})
    executors = [cmd for cmd, _ in jvms.values() if "CoarseGrainedExecutorBackend" in cmd]
    assert len(jvms) >= 3 and len(executors) >= 2, [cmd[-200:] for cmd, _ in jvms.values()]
    for cmd, mapped in jvms.values():
        assert str(archive) in mapped, f"{cmd[:300]} does not map {archive}"
