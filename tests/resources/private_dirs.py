"""For the tests of sparkdl's private default directories (tests/integration/test_private.py,
tests/unit/fs/test_private_dirs.py): the ``temp_dir`` fixture, which points the temp dir at a fresh
directory made like /tmp, the check that a directory is this user's alone, the conf of the run
directory, and a rank function, registered to be pickled by value so that the ranks need not
import it."""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import pytest

cloudpickle.register_pickle_by_value(sys.modules[__name__])

RUN_DIR_CONF = "spark.sparkdl.runDir"


@pytest.fixture
def temp_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh temp dir (mode 1777, like /tmp) that sparkdl's defaults go under for this test."""
    path = Path(tempfile.mkdtemp(prefix="sparkdl-test-private-"))
    path.chmod(0o1777)
    # tempfile caches the temp dir it found: patch the cache, not TMPDIR.
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def assert_private(path: Path) -> None:
    info = path.lstat()
    assert stat.S_ISDIR(info.st_mode), path
    assert stat.S_IMODE(info.st_mode) == 0o700, f"{path}: mode {stat.S_IMODE(info.st_mode):o}"
    assert info.st_uid == os.getuid(), path


def returns_one() -> int:
    return 1
