"""A venv made again at the same path keeps the suite's class archive of Spark's classes: pip gives
every jar the time of its install, tools/bootstrap.sh sets one fixed time on pyspark's jars, and
tests/resources/jvm_archive.py keys the archive on the jars (names, sizes, times) and nothing else
in that directory. A JVM maps the archive only while the jars' sizes and times are those recorded
in it; tests/cluster/test_suite_jvms.py checks the mapping itself."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import REPO
from resources import jvm_archive

JARS = {"spark-core_2.13-4.0.1.jar": 4096, "py4j-0.10.9.9.jar": 1024}


def _install(site: Path) -> Path:
    """What pip leaves: the jars with the time of this install, and a directory beside them."""
    jars = site / "pyspark" / "jars"
    jars.mkdir(parents=True, exist_ok=True)
    for name, size in JARS.items():
        (jars / name).write_bytes(b"\0" * size)
    shutil.rmtree(jars / "connect-repl", ignore_errors=True)  # pip makes it anew
    (jars / "connect-repl").mkdir()
    (jars / "connect-repl" / "ammonite.jar").write_bytes(os.urandom(64))
    return jars


def _bootstrap_jar_times(venv: Path) -> None:
    """tools/bootstrap.sh's own ensure_jar_times, run on ``venv`` (the rest of the script is not run)."""
    script = (REPO / "tools" / "bootstrap.sh").read_text()
    body = script[script.index("ensure_jar_times() {"):]
    body = body[:body.index("\n}\n") + 3]
    subprocess.run(["bash", "-c", f'set -euo pipefail\n{body}\nVENV="$1" ensure_jar_times', "-", str(venv)],
                   check=True, timeout=60)


@pytest.fixture
def java_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key's ``java -version`` part, fixed: this unit test starts no JVM."""
    real = subprocess.run

    def run(cmd: Any, *args: Any, **kwargs: Any) -> Any:
        if cmd[:1] == ["java"]:
            return SimpleNamespace(stderr='openjdk version "17.0.13"\n', returncode=0)
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(jvm_archive.subprocess, "run", run)


def test_a_venv_made_again_at_the_same_path_keeps_the_archives_key(tmp_path: Path, java_version: None) -> None:
    venv = tmp_path / ".venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    jars = _install(site)
    _bootstrap_jar_times(venv)
    assert {int(p.stat().st_mtime) for p in jars.glob("*.jar")} == {946684800}
    first = jvm_archive._key(jars, "-XX:+UseSerialGC")

    # pip installs pyspark again (a fresh clone, a rebuilt venv): new inodes, new times, and the
    # directory beside the jars changed too.
    for p in jars.glob("*.jar"):
        p.unlink()
    _install(site)
    assert jvm_archive._key(jars, "-XX:+UseSerialGC") != first  # pip's times: another archive
    _bootstrap_jar_times(venv)
    assert jvm_archive._key(jars, "-XX:+UseSerialGC") == first

    # Another jar, or the same jar at another size, is another class path: another archive.
    (jars / "spark-core_2.13-4.0.1.jar").write_bytes(b"\0" * 4097)
    _bootstrap_jar_times(venv)
    assert jvm_archive._key(jars, "-XX:+UseSerialGC") != first
