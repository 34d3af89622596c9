"""Where the ranks' output goes on the driver: every line, whole, into a file per rank in the run's
directory, and onto the driver's console tagged with its rank.

The lines arrive on the channel's threads, one per rank. Neither sink may hold those threads up:
the console can be a slow pipe (``spark-submit ... | tee``, a CI log, a log collector), and a
rank whose lines wait on it ends its task with them still unread, to be cut off when the run
ends. So a channel thread only appends the line to two queues, and two threads of this object
drain them: one appends to the files (in batches, a file opened only while it is written, so
that a gang of hundreds holds no descriptor per rank), one writes to the console.

:meth:`RankOutput.close` waits for both. The files get everything; the console gets what it
takes within ``RunConfig.log_flush_timeout_s``, and the lines it did not take are counted, so
that the run can say how many and where all of them are.
"""

from __future__ import annotations

import collections
import itertools
import logging
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sparkdl._internal.driver.report import rank_ranges

log = logging.getLogger("sparkdl")

# The console's backlog is held in memory up to this many characters; lines past it go to the
# files only (and are counted as not shown).
CONSOLE_BACKLOG_CHARS = 64 << 20
# The files' pending lines are written out at least this often, and sooner past FILE_BATCH_CHARS.
FILE_FLUSH_S = 0.5
FILE_BATCH_CHARS = 4 << 20
# Lines written to the console in one call (then flushed).
CONSOLE_BATCH_LINES = 512
# With deduplication, how long a line of a rank other than 0 waits for the same line of others.
DEDUPE_HOLD_S = 1.0
# RunConfig.console="auto" deduplicates from this many ranks on.
DEDUPE_FROM_RANKS = 8
CONSOLE_MODES = ("auto", "all", "dedupe")


def file_name(rank: int, attempt: int) -> str:
    """A rank's file: ``rank-3.log`` for the first attempt, ``rank-3.attempt-1.log`` for a rerun."""
    return f"rank-{rank}.log" if attempt == 0 else f"rank-{rank}.attempt-{attempt}.log"


@dataclass(frozen=True)
class Undelivered:
    """What :meth:`RankOutput.close` could not deliver: lines the console did not take, and
    lines no file got (the directory could not be written, with why)."""

    console: int = 0
    files: int = 0
    file_error: str | None = None

    def __bool__(self) -> bool:
        return bool(self.console or self.files)


def dedupes(console: str, world_size: int) -> bool:
    """Whether ``RunConfig.console`` deduplicates the console's lines of a gang of ``world_size``."""
    return console == "dedupe" or (console == "auto" and world_size >= DEDUPE_FROM_RANKS)


@dataclass
class _Group:
    """One stdout line as ranks other than 0 printed it, held for :data:`DEDUPE_HOLD_S`: shown once."""

    seq: int
    attempt: int
    text: str
    due: float
    ranks: list[int]
    members: set[int]


class RankOutput:
    """The sinks of every rank's lines; thread-safe. ``log_dir=None`` keeps no files, and
    ``echo=False`` shows nothing on the console.

    ``dedupe``: the console shows rank 0's lines and every rank's stderr (warnings, errors) as
    they come, and a stdout line that ranks other than 0 print alike (the same text and attempt)
    once, with their ranks (``[ranks 1-1023] ...``), when all ``world_size - 1`` printed it or
    :data:`DEDUPE_HOLD_S` after the first did. Held lines are shown in the order they were first
    printed, so a rank's line that joined an earlier one of others may show before that rank's
    own line printed just before it (by at most the hold); the files have every line of every
    rank, in order.
    """

    def __init__(self, log_dir: Path | None, *, echo: bool, backlog_chars: int = CONSOLE_BACKLOG_CHARS,
                 dedupe: bool = False, world_size: int = 1) -> None:
        self.log_dir = log_dir
        self.echo = echo
        self.dedupe = dedupe
        self._others = max(world_size - 1, 1)
        self._groups: collections.deque[_Group] = collections.deque()  # held, oldest first
        self._open: dict[tuple[int, str], _Group] = {}  # the newest group of each line
        self._seq = 0
        self._backlog_chars = backlog_chars
        self._lock = threading.Condition()
        self._closing = False
        # The files' side: lines per file name, not yet written.
        self._pending: dict[str, list[str]] = {}
        self._pending_chars = 0
        self._file_error: str | None = None
        self._files_lost = 0
        # (stream, tagged text, the ranks' lines it stands for) in arrival order.
        self._console: collections.deque[tuple[str, str, int]] = collections.deque()
        self._console_chars = 0
        self._console_busy = False  # a batch is being written
        self._not_shown = 0  # lines past the backlog, or left when close gave up
        self._gave_up = False
        self._files: threading.Thread | None = None
        if log_dir is not None:
            try:
                log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            except OSError as exc:
                self._file_error = f"{type(exc).__name__}: {exc}"
            self._files = threading.Thread(target=self._write_files, name="sparkdl-rank-files", daemon=True)
            self._files.start()
        if echo:
            # Never joined: a console blocked in a write must not hold the run (see close).
            threading.Thread(target=self._write_console, name="sparkdl-rank-console", daemon=True).start()

    def line(self, attempt: int, rank: int, stream: str, text: str) -> None:
        """One whole line (without its newline) of ``rank``'s stdout (``stream="o"``) or stderr."""
        with self._lock:
            if self._closing:
                self._files_lost += self.log_dir is not None
                self._not_shown += self.echo
                return
            if self.log_dir is not None:
                self._pending.setdefault(file_name(rank, attempt), []).append(text + "\n")
                self._pending_chars += len(text) + 1
                if self._pending_chars >= FILE_BATCH_CHARS:
                    self._lock.notify_all()
            if self.echo:
                if self.dedupe and rank != 0 and stream == "o":
                    self._hold(attempt, rank, text)
                else:
                    self._show(stream, f"{_tag([rank], attempt)} {text}\n", 1)

    def _show(self, stream: str, tagged: str, lines: int, held: int = 0) -> None:
        """Queues ``tagged`` (standing for ``lines`` lines of the ranks) for the console; under the
        lock. ``held``: the characters the line's group already counted in the backlog."""
        self._console_chars -= held
        if self._console_chars + len(tagged) > self._backlog_chars:
            self._not_shown += lines
            return
        if not self._console:  # the writer waits only on an empty queue
            self._lock.notify_all()
        self._console.append((stream, tagged, lines))
        self._console_chars += len(tagged)

    def _hold(self, attempt: int, rank: int, text: str) -> None:
        """Adds a stdout line of a rank other than 0 to the held group of the same line; under the lock."""
        key = (attempt, text)
        group = self._open.get(key)
        if group is None or rank in group.members:  # the same line again from one rank: a new group
            if self._console_chars + len(text) > self._backlog_chars:  # held lines count in the backlog
                self._not_shown += 1
                return
            self._console_chars += len(text)
            self._seq += 1
            group = _Group(self._seq, attempt, text, time.monotonic() + DEDUPE_HOLD_S, [], set())
            self._open[key] = group
            if not self._groups:
                self._lock.notify_all()  # the writer waits for the first group's time
            self._groups.append(group)
        group.ranks.append(rank)
        group.members.add(rank)
        if len(group.ranks) >= self._others:
            self._release(group.seq)

    def _release(self, upto: int) -> None:
        """Shows the held groups up to sequence number ``upto``, oldest first; under the lock."""
        while self._groups and self._groups[0].seq <= upto:
            group = self._groups.popleft()
            key = (group.attempt, group.text)
            if self._open.get(key) is group:
                del self._open[key]
            self._show("o", f"{_tag(group.ranks, group.attempt)} {group.text}\n", len(group.ranks), len(group.text))

    def _release_due(self) -> float | None:
        """Shows the groups whose time has come; returns the seconds until the next one's."""
        now = time.monotonic()
        due = [g.seq for g in itertools.takewhile(lambda g: g.due <= now, self._groups)]
        if due:
            self._release(due[-1])
        return self._groups[0].due - now if self._groups else None

    # ---- the threads ------------------------------------------------------------------------

    def _write_files(self) -> None:
        assert self.log_dir is not None
        while True:
            with self._lock:
                if not self._closing and self._pending_chars < FILE_BATCH_CHARS:
                    self._lock.wait(FILE_FLUSH_S)
                batch, self._pending, self._pending_chars = self._pending, {}, 0
                done = self._closing
            for name, lines in batch.items():
                if self._file_error is not None:
                    self._files_lost += len(lines)
                    continue
                try:
                    with open(self.log_dir / name, "a", encoding="utf-8", errors="replace") as f:
                        f.writelines(lines)
                except OSError as exc:
                    self._file_error = f"{type(exc).__name__}: {exc}"
                    self._files_lost += len(lines)
            if done and not batch:
                return

    def _write_console(self) -> None:
        while True:
            with self._lock:
                self._release_due()  # also while the console is busy with other lines
                while not self._console and not self._closing:
                    wait = self._release_due()
                    if self._console:
                        break
                    self._lock.wait(wait)
                if self._gave_up or (self._closing and not self._console):
                    return
                batch = [self._console.popleft() for _ in range(min(CONSOLE_BATCH_LINES, len(self._console)))]
                self._console_chars -= sum(len(text) for _, text, _ in batch)
                self._console_busy = True
            try:
                start = 0
                while start < len(batch):  # runs of one stream, each written and flushed at once
                    stream = batch[start][0]
                    end = start
                    while end < len(batch) and batch[end][0] == stream:
                        end += 1
                    out = sys.stderr if stream == "e" else sys.stdout
                    out.write("".join(text for _, text, _ in batch[start:end]))
                    out.flush()
                    start = end
            except (OSError, ValueError) as exc:  # a closed or broken console: the files have the lines
                with self._lock:
                    self._not_shown += sum(n for _, _, n in batch) + sum(n for _, _, n in self._console)
                    self._console.clear()
                    self._gave_up = True
                    self._console_busy = False
                    self._lock.notify_all()
                log.debug("sparkdl: the console stopped taking the ranks' output: %s", exc)
                return
            with self._lock:
                self._console_busy = False
                self._lock.notify_all()

    # ---- the end ----------------------------------------------------------------------------

    def close(self, timeout_s: float) -> Undelivered:
        """Writes out every pending line: the files all of them, the console what it takes within
        ``timeout_s``. Returns what was not delivered; later lines are counted as such."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._groups:
                self._release(self._groups[-1].seq)  # the ranks have ended: nothing more will join
            self._closing = True
            self._lock.notify_all()
            while (self._console or self._console_busy) and not self._gave_up:
                left = deadline - time.monotonic()
                if left <= 0:
                    # The console takes no more in time: what is queued is not shown (the thread,
                    # blocked in a write, stops after it).
                    self._not_shown += sum(n for _, _, n in self._console)
                    self._console.clear()
                    self._console_chars = 0
                    self._gave_up = True
                    break
                self._lock.wait(left)
        if self._files is not None:
            self._files.join()  # local file writes: bounded by the disk, not by a reader
        return Undelivered(console=self._not_shown, files=self._files_lost, file_error=self._file_error)

    def say(self, undelivered: Undelivered, timeout_s: float) -> None:
        """Warns about what :meth:`close` could not deliver, naming where all of it is."""
        where = f"every line is in {self.log_dir}" if self.log_dir is not None and not undelivered.files else None
        if undelivered.console:
            log.warning(
                "sparkdl: %d line(s) of the ranks' output were not shown on the console: it did not take them "
                "within RunConfig.log_flush_timeout_s=%g s%s", undelivered.console, timeout_s,
                f"; {where}" if where else "")
        if undelivered.files:
            log.warning("sparkdl: %d line(s) of the ranks' output could not be written under %s (%s)",
                        undelivered.files, self.log_dir, undelivered.file_error)


def _tag(ranks: list[int], attempt: int) -> str:
    """``[rank 3]``, ``[ranks 1-7, 9, attempt 1]``."""
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"
    return f"[{who}]" if attempt == 0 else f"[{who}, attempt {attempt}]"
