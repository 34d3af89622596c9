"""``sparkdl conf``: the templates every message and page points at are in the installed package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sparkdl._internal.cli.templates import DIR, TEMPLATES


def _sparkdl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sparkdl", *args], capture_output=True, text=True, timeout=60)


def test_every_template_is_listed_printed_and_found_by_path() -> None:
    listing = _sparkdl("conf")
    assert listing.returncode == 0, listing.stderr
    for name, (file, _) in TEMPLATES.items():
        assert name in listing.stdout and file in listing.stdout
        printed = _sparkdl("conf", name)
        where = Path(_sparkdl("conf", name, "--path").stdout.strip())
        assert printed.returncode == 0 and where.parent == DIR and where.name == file
        assert printed.stdout == where.read_text() and printed.stdout.strip()
    assert "spark.task.resource.gpu.amount" in _sparkdl("conf", "gpu").stdout


def test_the_discovery_script_runs_and_speaks_sparks_format() -> None:
    script = _sparkdl("conf", "gpu-discovery", "--path").stdout.strip()
    assert os.access(script, os.X_OK)
    done = subprocess.run([script], capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["name"] == "gpu" and isinstance(found["addresses"], list)


def test_an_unknown_template_is_a_usage_error_naming_the_choices() -> None:
    done = _sparkdl("conf", "tpu")
    assert done.returncode == 2 and "gpu" in done.stderr and "cpu" in done.stderr
