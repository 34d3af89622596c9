"""The driver's sinks of the ranks' lines (sparkdl/driver/output.py): every line whole and once in
its rank's file and on the console, from many channel threads at once; nothing hangs or is dropped
silently when the console or the directory fails."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from sparkdl.driver.output import RankOutput, file_name


def test_lines_from_many_threads_reach_each_file_and_the_console_whole_and_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    sink = RankOutput(tmp_path / "logs", echo=True)
    ranks, lines = 8, 3000

    def rank(r: int) -> None:
        for i in range(lines):
            sink.line(1 if r == 7 else 0, r, "e" if i % 100 == 99 else "o", f"rank {r} line {i} " + "y" * (i % 300))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not sink.close(timeout_s=30)
    for r in range(ranks):
        written = (tmp_path / "logs" / file_name(r, 1 if r == 7 else 0)).read_text().splitlines()
        assert written == [f"rank {r} line {i} " + "y" * (i % 300) for i in range(lines)]
        tag = f"[rank {r}, attempt 1]" if r == 7 else f"[rank {r}]"
        # On the console, tagged; each stream in the order the rank printed it.
        for stream, console in (("o", out), ("e", err)):
            shown = [line for line in console.getvalue().splitlines() if line.startswith(tag + " ")]
            assert shown == [f"{tag} rank {r} line {i} " + "y" * (i % 300)
                             for i in range(lines) if (i % 100 == 99) == (stream == "e")]
    assert (tmp_path / "logs" / "rank-7.attempt-1.log").exists() and not (tmp_path / "logs" / "rank-7.log").exists()


def test_a_console_that_blocks_is_given_up_after_the_timeout_and_the_files_keep_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    read_fd, write_fd = os.pipe()  # nobody reads it: the first write that fills it blocks
    console = os.fdopen(write_fd, "w", encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", console)
    sink = RankOutput(tmp_path / "logs", echo=True, backlog_chars=200_000)
    for i in range(20_000):
        sink.line(0, 0, "o", f"{i:05d} " + "z" * 60)
    began = time.monotonic()
    undelivered = sink.close(timeout_s=0.5)
    assert time.monotonic() - began < 5
    # Past the backlog, and what was still queued at the timeout: counted, not lost. Not counted:
    # what the pipe took (64 KiB) and the batch blocked on its way into it.
    assert 20_000 - (65_536 // 67 + 1) - 512 <= undelivered.console < 20_000 and not undelivered.files
    assert len((tmp_path / "logs" / "rank-0.log").read_text().splitlines()) == 20_000
    with caplog.at_level(logging.WARNING, logger="sparkdl"):
        sink.say(undelivered, 0.5)
    assert f"{undelivered.console} line(s)" in caplog.text and str(tmp_path / "logs") in caplog.text
    os.close(read_fd)  # the blocked write fails now (EPIPE): the writer ends
    monkeypatch.undo()
    with contextlib.suppress(OSError):
        console.close()


def test_a_directory_that_cannot_be_written_is_said_and_the_console_still_gets_every_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    (tmp_path / "logs").write_text("a file where the directory should be")
    sink = RankOutput(tmp_path / "logs", echo=True)
    for i in range(10):
        sink.line(0, 3, "o", f"line {i}")
    undelivered = sink.close(timeout_s=10)
    assert undelivered.files == 10 and not undelivered.console
    assert "FileExistsError" in (undelivered.file_error or "") or "NotADirectoryError" in (undelivered.file_error or "")
    assert out.getvalue().splitlines() == [f"[rank 3] line {i}" for i in range(10)]
    with caplog.at_level(logging.WARNING, logger="sparkdl"):
        sink.say(undelivered, 10)
    assert "10 line(s)" in caplog.text and "could not be written" in caplog.text


def test_a_console_that_went_away_ends_the_writer_and_its_lines_are_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = io.StringIO()
    out.close()  # writes raise ValueError, as on a console that went away
    monkeypatch.setattr(sys, "stdout", out)
    sink = RankOutput(tmp_path / "logs", echo=True)
    sink.line(0, 0, "o", "first")
    sink.line(0, 0, "o", "second")
    undelivered = sink.close(timeout_s=10)
    assert undelivered.console == 2 and not undelivered.files
    assert (tmp_path / "logs" / "rank-0.log").read_text() == "first\nsecond\n"
