"""The driver of a gang of 256: check-in, every line and metric of a burst, and a short failure
report, against the real channel, monitor, output sinks and report (tools/driver_load.py plays the
tasks in a child process, one real connection each). benchmarks/bench_driver_scale.py measures
the same at 64, 256 and 1,024 ranks."""

from __future__ import annotations

from pathlib import Path

import driver_load
import pytest

RANKS = 256


@pytest.mark.parametrize("batch_s", [0.0, 0.05], ids=["a-frame-a-line", "batched-as-tasks-send"])
def test_256_ranks_check_in_and_every_line_and_metric_of_a_burst_arrives_whole_and_once(
    tmp_path: Path, batch_s: float
) -> None:
    measured = driver_load.drive(driver_load.Load(RANKS, lines=200, metrics=10, timeout_s=240, batch_s=batch_s), tmp_path)
    assert measured.problems == []
    assert measured.lines == RANKS * 200 and measured.metrics == RANKS * 10
    # The console (RunConfig.console="auto": deduplicated at 256 ranks): rank 0's 200 lines, the
    # 150 own lines of each other rank, and the 50 lines every rank prints alike far fewer times
    # than by each of the 255 (once each when every rank's came within the hold).
    own = 200 + (RANKS - 1) * 150
    assert own + 50 <= measured.console_lines < own + (RANKS - 1) * 50 // 4, measured.console_lines


@pytest.mark.fault
def test_a_gang_of_256_with_one_failure_gives_a_short_report_with_every_stack_in(tmp_path: Path) -> None:
    measured = driver_load.drive(driver_load.Load(RANKS, lines=5, metrics=1, fail=True, timeout_s=240), tmp_path)
    assert measured.problems == []
    report = measured.report or ""
    assert "rank 0 on sim-host-0 (pid 200000): exited with code 1: ValueError: bad batch 17" in report, report
    # The 255 ranks stopped in the same collective: one entry, one stack.
    assert f"ranks 1-{RANKS - 1} ({RANKS - 1} ranks on 32 hosts" in report, report
    assert report.count("in all_reduce") == 1 and (measured.report_lines or 0) < 30, report


def test_64_ranks_printing_100_lines_and_10_metrics_a_second_lose_nothing(tmp_path: Path) -> None:
    measured = driver_load.drive(driver_load.Load.steady(64, rate=100, seconds=2, timeout_s=120), tmp_path)
    assert measured.problems == []  # every line whole, once and in order in its file; every metric once
    assert measured.lines == 64 * 200 and measured.metrics == 64 * 20
    # 6,400 lines a second offered for 2 s: written within the bound (the driver keeps up here).
    assert measured.relay_s < 2 + 10, measured.relay_s
