"""``sparkdl doctor``'s rows for the run and cache directories, from what the executors reported:
a directory the user named (or the cache) that a host does not see is an error; the default run
directory is a warning, as runs that never save work there (sparkdl._internal.spark.reach)."""

from __future__ import annotations

from sparkdl._internal.cli.checks import ERROR, OK, WARN, Report
from sparkdl._internal.cli.executors import _check_shared
from sparkdl._internal.driver.cluster import RUN_DIR_CONF
from sparkdl._internal.spark.reach import Marker

ROWS = [{"host": "w1", "address": "10.9.0.11", "unshared": {"run directory": "file:///tmp/r has no file"}},
        {"host": "w2", "address": "10.9.0.12", "unshared": {}}]


def _rows(strict: bool) -> dict[str, tuple[str, str]]:
    report = Report()
    dirs = {"run directory": (Marker("file:///tmp/r", "t" * 48, strict), RUN_DIR_CONF),
            "cache directory": (Marker("file:///shared/c", "u" * 48), "spark.sparkdl.cacheDir")}
    _check_shared(report, ROWS, dirs, "every executor")
    return {c.name: (c.status, c.problem) for c in report.checks}


def test_a_run_directory_the_user_set_that_a_host_lacks_is_an_error() -> None:
    rows = _rows(strict=True)
    assert rows["run directory"][0] == ERROR and "10.9.0.11" in rows["run directory"][1]
    assert rows["cache directory"] == (OK, "")


def test_the_default_run_directory_that_a_host_lacks_is_a_warning_naming_the_setting() -> None:
    status, problem = _rows(strict=False)["run directory"]
    assert status == WARN and "first checkpoint save fails" in problem and RUN_DIR_CONF in problem, problem
