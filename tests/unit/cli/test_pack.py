"""``sparkdl pack`` refuses, before writing anything, what executors could not run. Packing a real
venv and shipping it to hosts that have nothing is tools/check_packed.py (run by tools/check-wheel)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sparkdl._internal.cli.pack import PackError, check_venv


def test_an_editable_sparkdl_is_refused_naming_the_checkout(tmp_path: Path) -> None:
    # The test venvs install sparkdl with pip install -e (tools/bootstrap.sh).
    out = tmp_path / "env.tar.gz"
    done = subprocess.run([sys.executable, "-m", "sparkdl", "pack", "-o", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "editable" in done.stderr and "install it as a wheel" in done.stderr, done.stderr
    assert Path(__file__).resolve().parents[3].as_uri() in done.stderr  # the checkout it would leave behind
    assert not out.exists()


def test_a_venv_without_torch_pyarrow_or_sparkdl_is_refused_naming_them(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=60)
    with pytest.raises(PackError, match=r"lacks torch, pyarrow, sparkdl"):
        check_venv(tmp_path / "bare")


def test_a_python_that_is_not_a_venv_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PackError, match=r"not a virtual environment \(no pyvenv.cfg\).*conda-pack"):
        check_venv(tmp_path)


def test_a_plain_tar_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    # Spark 3.5 and 4 fail the application at its start on a venv packed as .tar (checked by hand:
    # spark.archives=env.tar#env, "expanding ... would create entry outside of"); .tar.gz works.
    out = tmp_path / "env.tar"
    done = subprocess.run([sys.executable, "-m", "sparkdl", "pack", "-o", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "env.tar: Spark cannot unpack a venv from a plain .tar" in done.stderr, done.stderr
    assert "name it env.tar.gz" in done.stderr and "editable" not in done.stderr, done.stderr
    assert not out.exists()
