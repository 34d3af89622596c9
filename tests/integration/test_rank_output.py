"""Every line a rank prints reaches the driver, whatever its stdout is.

The driver's stdout here is a real pipe read by a slow consumer (as under ``spark-submit ... | tee``,
a CI log or a log collector). The ranks print far more than the pipe holds, and end long before the
consumer has read it: ``sparkdl.run`` returns only once every line was written out, each once, and
every line is in the run's log files as well. A consumer that stops reading does not hold the run:
it returns within ``log_flush_timeout_s``, saying how many lines the console did not take and
where they all are.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import sparkdl

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.spark

LINES, WIDTH = 4000, 90  # per rank: 2 ranks print ~0.8 MB, a pipe holds 64 KiB


class SlowPipe:
    """A pipe whose reader takes ``rate`` bytes a second, and none while paused."""

    def __init__(self, rate: float) -> None:
        read_fd, write_fd = os.pipe()
        self.writer = os.fdopen(write_fd, "w", encoding="utf-8")
        self._reader = os.fdopen(read_fd, "rb", buffering=0)
        self._rate = rate
        self.data = bytearray()
        self.reading = threading.Event()
        self.reading.set()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            self.reading.wait()
            chunk = self._reader.read(4096)
            if not chunk:
                return
            self.data += chunk
            time.sleep(len(chunk) / self._rate)

    def text(self) -> str:
        return self.data.decode()

    def close(self) -> None:
        self.reading.set()
        self.writer.close()
        self._thread.join(60)
        self._reader.close()
        assert not self._thread.is_alive()


def chatter(lines: int, width: int) -> int:
    import sys

    import sparkdl

    rank = sparkdl.context().rank
    for i in range(lines):
        print(f"line {rank} {i} " + "x" * width)
    print(f"last words of rank {rank}", file=sys.stderr)
    return rank


def _shown(text: str) -> dict[int, list[int]]:
    """The rank lines on the console, per rank, in the order they came."""
    seen: dict[int, list[int]] = {}
    for rank, i in re.findall(r"^\[rank (\d+)\] line \d+ (\d+) x+$", text, flags=re.M):
        seen.setdefault(int(rank), []).append(int(i))
    return seen


def _files_complete(log_dir: str) -> None:
    """Each rank's file has every line it printed, whole and once: its stdout in order, its stderr
    line (a stream of its own, so anywhere among them)."""
    for rank in (0, 1):
        lines = (Path(log_dir) / f"rank-{rank}.log").read_text().splitlines()
        last = f"last words of rank {rank}"
        assert lines.count(last) == 1, (rank, len(lines))
        lines.remove(last)
        assert lines == [f"line {rank} {i} " + "x" * WIDTH for i in range(LINES)], (rank, len(lines))


@pytest.fixture
def slow_stdout(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The driver's stdout becomes the pipe (set in the test itself: pytest's capture sets
    sys.stdout again between a fixture and the test)."""
    pipe = SlowPipe(rate=400_000)  # ~2 s for what the ranks print; they are done long before
    try:
        yield pipe
    finally:
        monkeypatch.undo()
        pipe.close()


def test_every_line_reaches_a_slow_pipe_once_before_run_returns(
    spark: Any, slow_stdout: SlowPipe, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdout", slow_stdout.writer)
    result = sparkdl.launch(chatter, LINES, WIDTH, num_workers=2, spark=spark)
    print("RUN RETURNED")  # written after whatever run wrote, in order
    sys.stdout.flush()
    assert result.value == 0
    deadline = time.monotonic() + 60
    while "RUN RETURNED" not in slow_stdout.text() and time.monotonic() < deadline:
        time.sleep(0.05)
    text = slow_stdout.text()
    before, _, _ = text.partition("RUN RETURNED")
    # Every line of both ranks, once and in order, before run returned.
    assert _shown(before) == {0: list(range(LINES)), 1: list(range(LINES))}, {r: len(v) for r, v in _shown(before).items()}
    _files_complete(result.log_dir)


def test_a_console_that_takes_nothing_holds_the_run_only_for_log_flush_timeout_s(
    spark: Any, slow_stdout: SlowPipe, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdout", slow_stdout.writer)
    slow_stdout.reading.clear()  # the consumer stopped reading (a paused pager, a stuck collector)
    cfg = sparkdl.RunConfig(log_flush_timeout_s=2)
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="sparkdl"):
        result = sparkdl.launch(chatter, LINES, WIDTH, num_workers=2, spark=spark, config=cfg)
    took = time.monotonic() - began
    assert result.value == 0 and took < 45, took
    warning = next(r.getMessage() for r in caplog.records if "not shown on the console" in r.getMessage())
    assert "log_flush_timeout_s=2" in warning and result.log_dir in warning, warning
    not_shown = int(warning.split("sparkdl: ", 1)[1].split(" ", 1)[0])
    # Every line is in the files, whatever the console took.
    _files_complete(result.log_dir)
    slow_stdout.close()
    shown = sum(len(v) for v in _shown(slow_stdout.text()).values())
    # What the console took and what the warning counts add up to every line, none twice (a batch
    # may have been on its way when the wait ended; the two stderr lines may be among those counted).
    assert not_shown > 0 and 2 * LINES - 512 <= shown + not_shown <= 2 * LINES + 2, (shown, not_shown)
