"""The driver's progress line from every rank's step (sparkdl/_internal/driver/progress.py): the spread, the
slowest rank and the stragglers; step reports feed it without becoming metrics. The line and the
report from a real run: tests/integration/test_launch.py."""

from __future__ import annotations

import pytest

from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.driver.monitor import Monitor
from sparkdl._internal.driver.progress import PROGRESS_KEY, MetricsLog, Progress
from sparkdl._internal.wire.messages import Metric


def test_step_reports_feed_the_spread_and_the_stragglers_but_not_the_metrics(capsys: pytest.CaptureFixture[str]) -> None:
    progress = Progress(0.0, enabled=True, straggler_factor=1.5)
    metrics = MetricsLog(None)
    monitor = Monitor(4, 1, RunConfig(), None, metrics, progress)
    monitor.metric(0, 0, Metric({"epoch": 0, "loss": 0.5, "step": 6}))
    for rank, step in ((1, 5), (2, 6), (3, 2)):
        monitor.metric(0, rank, Metric({"step": step, PROGRESS_KEY: 1}))
    assert [r["rank"] for r in metrics.records] == [0]  # the step reports are not metrics
    # A median under 10 steps: ranks a few steps apart at the start are no stragglers.
    assert progress.stragglers() is None
    for rank, step in ((0, 120), (1, 118), (2, 121), (3, 70)):
        monitor.metric(0, rank, Metric({"step": step, PROGRESS_KEY: 1}))
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.endswith("ranks' steps 70/120/121 (min/median/max; slowest rank 3) | stragglers: ranks 3"), line
    assert progress.stragglers() == ("Stragglers of attempt 0 (steps behind the median 120 by more than "
                                     "RunConfig.straggler_factor=1.5): rank 3 at step 70.")
    # A new attempt starts the count afresh.
    monitor.metric(1, 1, Metric({"step": 3, PROGRESS_KEY: 1}))
    assert progress.stragglers() is None


def test_the_straggler_factor_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"straggler_factor=1.*a number > 1"):
        RunConfig(straggler_factor=1)
