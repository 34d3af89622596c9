"""The driver's sinks of the ranks' lines (sparkdl/_internal/driver/output.py): every line whole and once in
its rank's file and on the console, from many channel threads at once; nothing hangs or is dropped
silently when the console or the directory fails; deduplicated, a line other ranks print alike is
shown once with their ranks."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.driver.output import DEDUPE_HOLD_S, RankOutput, dedupes, file_name


def _consoles(monkeypatch: pytest.MonkeyPatch) -> tuple[io.StringIO, io.StringIO]:
    """The driver's stdout and stderr, as strings."""
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    return out, err


def _at_once(ranks: int, rank: Callable[[int], None]) -> None:
    """``rank(r)`` for every rank, each in a thread of its own, as the channel's threads call the sink."""
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_lines_from_many_threads_reach_each_file_and_the_console_whole_and_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, err = _consoles(monkeypatch)
    sink = RankOutput(tmp_path / "logs", echo=True)
    ranks, lines = 8, 3000

    def rank(r: int) -> None:
        for i in range(lines):
            sink.line(1 if r == 7 else 0, r, "e" if i % 100 == 99 else "o", f"rank {r} line {i} " + "y" * (i % 300))

    _at_once(ranks, rank)
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


def test_dedupe_shows_rank_0_and_stderr_in_full_and_other_ranks_alike_lines_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, err = _consoles(monkeypatch)
    ranks, epochs = 16, 30
    sink = RankOutput(tmp_path / "logs", echo=True, dedupe=True, world_size=ranks)

    def rank(r: int) -> None:
        for i in range(epochs):
            sink.line(0, r, "o", f"epoch {i} done")  # alike on every rank
            sink.line(0, r, "o", f"rank {r} loss {i}")  # this rank's own
        sink.line(0, r, "e", "UserWarning: the same warning")

    _at_once(ranks, rank)
    assert not sink.close(timeout_s=30)
    shown = out.getvalue().splitlines()
    for i in range(epochs):
        assert f"[rank 0] epoch {i} done" in shown
        # The other ranks' alike line: each of them in exactly one shown line (one, unless a
        # rank was held up for a second), never a line per rank.
        alike = [line for line in shown if line.endswith(f"] epoch {i} done") and not line.startswith("[rank 0]")]
        covered = [r for line in alike for r in _ranks(line)]
        assert sorted(covered) == list(range(1, ranks)) and len(alike) < ranks // 2, alike
        for r in range(ranks):
            assert shown.count(f"[rank {r}] rank {r} loss {i}") == 1
    # stderr of every rank, in full.
    assert sorted(err.getvalue().splitlines()) == sorted(f"[rank {r}] UserWarning: the same warning" for r in range(ranks))
    for r in range(ranks):  # the files: every line, in order
        written = (tmp_path / "logs" / file_name(r, 0)).read_text().splitlines()
        assert written == [x for i in range(epochs) for x in (f"epoch {i} done", f"rank {r} loss {i}")] + [
            "UserWarning: the same warning"]


def _ranks(line: str) -> list[int]:
    """The ranks of a console tag: ``[ranks 1-3, 7] ...`` -> [1, 2, 3, 7]."""
    tag = line[1:line.index("]")].removeprefix("ranks ").removeprefix("rank ")
    found: list[int] = []
    for part in tag.split(", "):
        lo, _, hi = part.partition("-")
        found += range(int(lo), int(hi or lo) + 1)
    return found


def test_a_line_only_some_ranks_print_is_shown_once_after_the_hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    sink = RankOutput(None, echo=True, dedupe=True, world_size=8)
    started = time.monotonic()
    sink.line(0, 2, "o", "loading shard")
    sink.line(0, 1, "o", "loading shard")
    deadline = started + 10
    while "loading shard" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)
    waited = time.monotonic() - started
    assert out.getvalue() == "[ranks 1-2] loading shard\n"  # before the run ends, not at its end
    assert DEDUPE_HOLD_S * 0.9 <= waited < DEDUPE_HOLD_S + 5
    sink.close(timeout_s=5)


def test_the_console_setting() -> None:
    assert [dedupes("auto", n) for n in (1, 7, 8, 1024)] == [False, False, True, True]
    assert dedupes("dedupe", 2) and not dedupes("all", 1024)
    with pytest.raises(ConfigError, match=r"RunConfig.console must be one of 'all' .*'dedupe' .*; got 'some'"):
        RunConfig(console="some")
