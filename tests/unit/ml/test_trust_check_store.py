"""Which store the saved-model trust check looks at (sparkdl._internal.ml.persistence): a path
without a scheme is the local disk only where Spark's fs.defaultFS is; where it is HDFS (YARN), Spark
reads the path there, so the driver's local file of the same name proves nothing and is not taken
as the model. Paths that are not checked are said to be unchecked, never passed in silence."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from sparkdl import ConfigError
from sparkdl._internal.ml.persistence import check_trusted_files


@pytest.fixture
def writable_by_others(tmp_path: Path) -> Path:
    saved = tmp_path / "model"
    (saved / "data").mkdir(parents=True)
    (saved / "metadata").write_text("{}")
    os.chmod(saved / "data", 0o777)
    return saved


def test_a_local_path_is_checked_where_the_default_file_system_is_local(writable_by_others: Path) -> None:
    for default_fs in (None, "file:///"):
        with pytest.raises(ConfigError, match=r"is writable by other users \(mode 777\)"):
            check_trusted_files(str(writable_by_others), "TorchModel", default_fs=default_fs)
    with pytest.raises(ConfigError, match="writable by other users"):
        check_trusted_files(f"file://{writable_by_others}", "TorchModel", default_fs="hdfs://namenode:8020")


def test_a_path_on_hdfs_is_not_judged_by_the_local_file_of_its_name_and_is_said_unchecked(
    writable_by_others: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="sparkdl._internal.ml.persistence"):
        check_trusted_files(str(writable_by_others), "TorchModel", default_fs="hdfs://namenode:8020")
        check_trusted_files("s3://bucket/models/m1", "TorchModel")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2
    assert f"{writable_by_others} on hdfs://namenode:8020 was not checked" in said[0]
    assert "s3://bucket/models/m1 was not checked" in said[1] and "checks local paths only" in said[1]
