"""A rank's output relay on a real pipe: lines that come together go to the driver in few batches,
whole and in order; a lone line is not held back; a line is never cut, however it is read."""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Any

from sparkdl._internal.task.link import _LOG_PIECE_CHARS, DriverLink
from sparkdl._internal.task.rankproc import BATCH_S, _Relay
from sparkdl._internal.wire.messages import LogLine, LogLines


class _Calls:
    """What the relay handed on, one entry per call (a batch or a single line)."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.at: list[float] = []

    def line(self, stream: str, text: str) -> bool:
        return self.lines(stream, [text])

    def lines(self, stream: str, texts: list[str]) -> bool:
        self.calls.append(list(texts))
        self.at.append(time.monotonic())
        return True

    def metric(self, record: dict[str, Any]) -> bool:
        return True

    def got(self) -> list[str]:
        return [text for call in self.calls for text in call]


def _relay(sink: _Calls) -> tuple[int, _Relay]:
    read_fd, write_fd = os.pipe()
    ready = threading.Event()
    ready.set()
    return write_fd, _Relay(os.fdopen(read_fd, "rb"), "o", sink, ready, deque(maxlen=10), None)


def test_a_burst_goes_in_few_batches_whole_and_in_order() -> None:
    sink = _Calls()
    write_fd, relay = _relay(sink)
    lines = [f"line {i} " + "x" * (i % 97) for i in range(20_000)]
    data = "".join(line + "\n" for line in lines).encode()
    for start in range(0, len(data), 4093):  # writes that end mid-line
        os.write(write_fd, data[start:start + 4093])
    os.close(write_fd)
    relay.thread.join(30)
    assert sink.got() == lines
    assert len(sink.calls) < len(lines) / 100, len(sink.calls)


def test_a_lone_line_goes_within_the_window_and_a_partial_one_waits_for_its_end() -> None:
    sink = _Calls()
    write_fd, relay = _relay(sink)
    try:
        sent = time.monotonic()
        os.write(write_fd, b"alone\n")
        deadline = sent + 5
        while not sink.calls and time.monotonic() < deadline:
            time.sleep(0.005)
        assert sink.calls == [["alone"]] and sink.at[0] - sent < BATCH_S + 1.0
        os.write(write_fd, b"half a lin")
        time.sleep(3 * BATCH_S)
        assert sink.got() == ["alone"]  # not cut at the read
        os.write(write_fd, "e, ünï\nand the last, without a newline".encode())
    finally:
        os.close(write_fd)
    relay.thread.join(10)
    assert sink.got() == ["alone", "half a line, ünï", "and the last, without a newline"]


def test_a_multibyte_character_split_between_reads_stays_whole() -> None:
    sink = _Calls()
    write_fd, relay = _relay(sink)
    line = ("é" * 40_000 + "€" * 30_000).encode()  # longer than one read of the pipe
    os.write(write_fd, line[:65_537])  # ends in the middle of a character
    time.sleep(2 * BATCH_S)
    os.write(write_fd, line[65_537:] + b"\n")
    os.close(write_fd)
    relay.thread.join(10)
    assert sink.got() == [line.decode()]


def test_a_line_of_many_reads_comes_whole_and_without_copying_it_over_and_over() -> None:
    sink = _Calls()
    write_fd, relay = _relay(sink)
    line = b"z" * (64 * 1024 * 1024)  # 1,024 reads of the pipe; joined once, it takes well under a second
    writer = threading.Thread(target=lambda: (os.write(write_fd, line + b"\nnext\n"), os.close(write_fd)))
    started = time.monotonic()
    writer.start()
    relay.thread.join(60)
    writer.join(10)
    assert [len(t) for t in sink.got()] == [len(line), 4] and time.monotonic() - started < 20


class _Frames:
    def __init__(self) -> None:
        self.frames: list[dict[str, Any]] = []

    def send(self, frame: dict[str, Any]) -> None:
        self.frames.append(frame)


def test_the_driver_link_packs_lines_into_frames_of_bounded_size_and_a_huge_line_alone() -> None:
    conn = _Frames()
    link = DriverLink(conn, rank=3)  # type: ignore[arg-type]
    huge = "h" * (_LOG_PIECE_CHARS + 10)
    texts = ["a", "b", huge, "c", *(["m" * 1000] * 2000)]
    assert link.lines("e", texts)
    kinds = [f["t"] for f in conn.frames]
    assert kinds[0] == LogLines.kind and conn.frames[0]["ls"] == ["a", "b"]
    assert kinds[1:3] == [LogLine.kind, LogLine.kind] and conn.frames[1]["more"] and not conn.frames[2]["more"]
    assert all(sum(map(len, f.get("ls", [f.get("l", "")]))) <= _LOG_PIECE_CHARS for f in conn.frames)
    joined: list[str] = []
    for frame in conn.frames:
        joined += frame["ls"] if frame["t"] == LogLines.kind else [frame["l"]]
    assert "".join(joined[2:4]) == huge and [joined[0], joined[1], *joined[4:]] == ["a", "b", "c", *(["m" * 1000] * 2000)]


def test_progress_bar_redraws_keep_only_the_last_one_and_endless_output_goes_in_bounded_lines(monkeypatch: Any) -> None:
    """tqdm redraws its line with carriage returns and writes a newline only at the end (or
    never): the relay keeps what a terminal would show, not every redraw since the last newline,
    and output with no newline at all goes on in lines of at most MAX_LINE_BYTES."""
    import sparkdl._internal.task.rankproc as rankproc

    sink = _Calls()
    write_fd, relay = _relay(sink)
    for i in range(50_000):  # 1.3 MB of redraws: each ends with \r, as tqdm writes them
        os.write(write_fd, f"  {i:6d}/50000 steps\r".encode())
    os.write(write_fd, b"  done\r\n")  # the last redraw, ended as on Windows
    os.close(write_fd)
    relay.thread.join(30)
    assert sink.got() == ["  done\r"]

    monkeypatch.setattr(rankproc, "MAX_LINE_BYTES", 1 << 20)
    sink = _Calls()
    write_fd, relay = _relay(sink)
    writer = threading.Thread(target=lambda: (os.write(write_fd, b"q" * (5 << 20) + b"end"), os.close(write_fd)))
    writer.start()
    relay.thread.join(60)
    writer.join(10)
    got = sink.got()
    assert "".join(got) == "q" * (5 << 20) + "end"  # nothing lost, in order
    assert max(map(len, got)) < (1 << 20) + (64 << 10) and len(got) >= 5  # never much more than the bound at once


def test_the_driver_joins_a_long_lines_pieces_once_and_keeps_at_most_the_bound(monkeypatch: Any, tmp_path: Any) -> None:
    import sparkdl._internal.driver.monitor as monitor_module
    from sparkdl._internal.common.config import RunConfig
    from sparkdl._internal.driver.monitor import Monitor
    from sparkdl._internal.driver.output import RankOutput
    from sparkdl._internal.driver.progress import MetricsLog, Progress

    monkeypatch.setattr(monitor_module, "MAX_LINE_BYTES", 3000)
    output = RankOutput(tmp_path, echo=False)
    monitor = Monitor(1, 1, RunConfig(), None, MetricsLog(None), Progress(1.0, enabled=False), output=output)
    for piece in ("a" * 1000, "b" * 1000, "c" * 1000, "d" * 1000):
        monitor.log(0, 0, LogLine("o", piece, more=True))
    monitor.log(0, 0, LogLine("o", "end"))
    monitor.log(0, 0, LogLine("o", "next"))
    output.close(timeout_s=5)
    assert monitor.cut_chars == 1000
    [log] = list(tmp_path.rglob("*.log")) or list(p for p in tmp_path.rglob("*") if p.is_file())
    assert log.read_text().splitlines() == ["a" * 1000 + "b" * 1000 + "c" * 1000 + "end", "next"]
