"""The driver's progress line from every rank's step (sparkdl/_internal/driver/progress.py): the spread, the
slowest rank and the stragglers; step reports feed it without becoming metrics; and a console
that stalls never stalls the threads that feed it. The line and the report from a real run:
tests/integration/test_launch.py."""

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
    assert progress.drain(10)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.endswith("ranks' steps 70/120/121 (min/median/max; slowest rank 3) | stragglers: ranks 3"), line
    assert progress.stragglers() == ("Stragglers of attempt 0 (steps behind the median 120 by more than "
                                     "RunConfig.straggler_factor=1.5): rank 3 at step 70.")
    # A new attempt starts the count afresh.
    monitor.metric(1, 1, Metric({"step": 3, PROGRESS_KEY: 1}))
    assert progress.stragglers() is None
    assert progress.drain(10)  # its line is written before the test's capture ends


def test_the_straggler_factor_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"RunConfig.straggler_factor must be a number > 1.*; got 1"):
        RunConfig(straggler_factor=1)


def test_a_stalled_stderr_never_holds_up_the_threads_that_receive_the_ranks_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver's stderr that stops taking lines (a full pipe nobody reads, a log collector that
    hangs) for longer than the tasks' send timeout: the metrics keep flowing through the monitor,
    as the connections' threads deliver them, and the console gets the newest line once it drains."""
    import fcntl
    import os
    import sys
    import threading
    import time

    read_end, write_end = os.pipe()
    flags = fcntl.fcntl(write_end, fcntl.F_GETFL)
    fcntl.fcntl(write_end, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    try:  # whole lines of PIPE_BUF bytes, each written whole or not at all: the first line the
        while True:  # writer gets out then starts a line of its own, whenever its thread runs
            os.write(write_end, b"x" * 4095 + b"\n")
    except BlockingIOError:
        pass  # the pipe is full: the next blocking write waits until someone reads
    fcntl.fcntl(write_end, fcntl.F_SETFL, flags)
    stalled = os.fdopen(write_end, "w", buffering=1)
    monkeypatch.setattr(sys, "stderr", stalled)
    progress = Progress(0.0, enabled=True)
    metrics = MetricsLog(None)
    monitor = Monitor(2, 1, RunConfig(), None, metrics, progress)
    delivered = threading.Event()

    def connection() -> None:  # what a connection's thread does with each metric a rank sends
        for step in range(200):
            monitor.metric(0, step % 2, Metric({"epoch": 0, "loss": 1.0 / (step + 1), "step": step}))
        delivered.set()

    thread = threading.Thread(target=connection, daemon=True)
    started = time.monotonic()
    thread.start()
    try:
        assert delivered.wait(5), "a stalled stderr held up the thread that receives the ranks' messages"
        assert time.monotonic() - started < 5 and len(metrics.records) == 200
        assert not progress.drain(0.5)  # the console has not taken the line yet
    finally:
        drained = b""
        os.set_blocking(read_end, False)
        deadline = time.monotonic() + 10
        while progress._writer is not None and time.monotonic() < deadline:
            try:
                drained += os.read(read_end, 1 << 16)
            except BlockingIOError:
                time.sleep(0.01)
        assert progress.drain(5)
        while True:
            try:
                drained += os.read(read_end, 1 << 16)
            except BlockingIOError:
                break
        monkeypatch.undo()
        stalled.close()
        os.close(read_end)
    lines = [line for line in drained.decode(errors="replace").splitlines() if line.startswith("sparkdl progress")]
    assert lines and "ranks' steps 198/199/199" in lines[-1], lines[-3:]  # the newest line came out
    assert progress.dropped > 0  # lines the stalled console could not take were replaced by newer ones
