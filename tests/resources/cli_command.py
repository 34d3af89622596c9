"""The ``sparkdl`` command run as a real subprocess (``python -m sparkdl``), for the tests of
the command line (tests/e2e/test_cli.py, tests/unit/cli/test_cli_usage.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CLI = [sys.executable, "-m", "sparkdl"]


def sparkdl(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
