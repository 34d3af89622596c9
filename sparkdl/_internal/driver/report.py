"""What happened to each rank of each attempt, and the one report a failed run gives.

Pure data and pure functions: no processes, no Spark. The monitor feeds it events.
"""

from __future__ import annotations

import re
import signal
import time
from collections import defaultdict
from dataclasses import dataclass, field

from sparkdl._internal.wire.messages import RankState

# A rank's stacks in the report: the innermost frames of each thread, and at most so many lines.
STACK_FRAMES = 12
STACK_LINES = 80
STACK_LINE_CHARS = 300


@dataclass
class RankRecord:
    """The life of one rank in one attempt, as the driver saw it."""

    attempt: int
    rank: int
    host: str = "?"
    task_pid: int | None = None
    pid: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    error: str | None = None
    traceback: str | None = None
    state: RankState = RankState.STARTING
    # When the driver heard of the failure (its monotonic clock): the policy's timing runs on it.
    failed_at: float | None = None
    tail: list[str] = field(default_factory=list)
    # When it failed by its own host's wall clock (time.time()), if the host said: the report's order.
    failed_wall: float | None = None
    # Its Python stacks (every thread, faulthandler's text), taken while it still ran, and when.
    stack: str | None = None
    stack_when: str | None = None
    # The checkpoints its restores skipped because they did not verify: (number, why).
    skipped: list[tuple[int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state = RankState(self.state)

    @property
    def failed(self) -> bool:
        return self.state.failed

    def outcome(self) -> str:
        if self.state is RankState.SUCCEEDED:
            return "succeeded"
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return f"killed by {name}"
        if self.exit_code is not None:
            return f"exited with code {self.exit_code}"
        if self.state is RankState.LOST:
            return "lost: its Spark task ended without an exit status (task killed or executor lost)"
        if self.state is RankState.STARTING:
            return "never started its process"
        return "stopped while running (the gang was stopped)"

    def summary(self) -> str:
        where = f"rank {self.rank} on {self.host}" + (f" (pid {self.pid})" if self.pid else "")
        text = f"{where}: {self.outcome()}"
        if self.error:
            text += f": {self.error}"
        return text


def skipped_checkpoints(records: list[RankRecord]) -> list[dict[str, object]]:
    """The checkpoints the ranks' restores skipped (they did not verify), by attempt and rank:
    ``{"attempt", "rank", "checkpoint", "reason"}`` each."""
    return [{"attempt": rec.attempt, "rank": rec.rank, "checkpoint": seq, "reason": why}
            for rec in sorted(records, key=lambda r: (r.attempt, r.rank)) for seq, why in rec.skipped]


def root_cause(records: list[RankRecord]) -> RankRecord | None:
    """The earliest failure; later failures are usually its consequences.

    Earliest by the time it happened on its host (``failed_wall``), not by when the driver heard
    of it: a rank's report can overtake another's on the way. Where the first failure the driver
    heard of carries no host time (a lost task says nothing), the driver's order stands; the
    failures with host times are compared by them only within the attempt of that first one.
    """
    failed = [r for r in records if r.failed and r.failed_at is not None]
    if not failed:
        return None
    first = min(failed, key=lambda r: (r.failed_at, r.state is not RankState.FAILED, r.rank))
    if first.failed_wall is None:
        return first
    timed = [r for r in failed if r.attempt == first.attempt and r.failed_wall is not None]
    return min(timed, key=lambda r: (r.failed_wall, r.failed_at, r.rank))


def wall_time(at: float) -> str:
    """A host's ``time.time()`` as UTC, to the millisecond."""
    seconds, ms = divmod(round(at * 1000), 1000)
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds)) + f".{ms:03d} UTC"


def trim_stack(text: str, *, frames: int = STACK_FRAMES, max_lines: int = STACK_LINES) -> list[str]:
    """faulthandler's dump, shortened for the report: the thread that took the signal (the main
    one, as a rule) first, the innermost ``frames`` of each thread, at most ``max_lines`` lines."""
    threads: list[list[str]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" ") or not threads:
            threads.append([])
        threads[-1].append(line[:STACK_LINE_CHARS])
    threads.sort(key=lambda lines: not lines[0].startswith("Current thread"))
    out: list[str] = []
    for lines in threads:
        shown, kept = 0, [lines[0]]
        for line in lines[1:]:
            shown += line.lstrip().startswith("File ")
            if shown > frames:
                outer = sum(1 for rest in lines if rest.lstrip().startswith("File ")) - frames
                kept.append(f"  ... {outer} outer frame(s) not shown")
                break
            kept.append(line)
        out.extend(kept)
    if len(out) > max_lines:
        out = [*out[:max_lines], f"... {len(out) - max_lines} more line(s) not shown"]
    return out


def error_key(error: str) -> str:
    """An error with its numbers (ports, pids, addresses, hex ids) as N: identical errors compare equal."""
    return re.sub(r"\d+", "N", re.sub(r"0x[0-9a-fA-F]+", "0xN", error))


def rank_ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``"0-2, 5, 7-8"``."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# Ranks of an attempt that ended alike (the same outcome and stack, numbers aside) are listed as one
# entry from this many on: a gang of hundreds stopped in one collective reads as one line and one stack.
GROUP_MIN = 3


def _likeness(rec: RankRecord) -> tuple[str, str, str | None]:
    stack = error_key("\n".join(trim_stack(rec.stack))) if rec.stack else ""
    return error_key(rec.error or rec.outcome()), stack, rec.stack_when


def _entries(recs: list[RankRecord], root: RankRecord | None) -> list[list[RankRecord]]:
    """The attempt's ranks in rank order, those alike (and not the root cause) as one entry."""
    alike: dict[tuple[str, str, str | None], list[RankRecord]] = defaultdict(list)
    for rec in recs:
        if rec is not root:
            alike[_likeness(rec)].append(rec)
    entries: list[list[RankRecord]] = []
    grouped: set[int] = set()
    for rec in recs:
        group = alike.get(_likeness(rec), []) if rec is not root else []
        if len(group) >= GROUP_MIN:
            if id(group[0]) not in grouped:
                grouped.add(id(group[0]))
                entries.append(group)
        else:
            entries.append([rec])
    return entries


def _hosts(recs: list[RankRecord]) -> str:
    hosts = sorted({r.host for r in recs})
    return ", ".join(hosts) if len(hosts) <= 3 else f"{len(hosts)} hosts"


def build_report(
    records: list[RankRecord],
    *,
    headline: str,
    hint: str,
    spark_error: str | None = None,
) -> tuple[str, str]:
    """The failure report, and the one-line root cause it names.

    Each attempt lists every rank's outcome; the first failure of each attempt also shows the
    tail of its output, unless an earlier attempt already showed the same error. From
    :data:`GROUP_MIN` on, ranks that ended alike (the same outcome and stack, numbers aside) are
    one entry with one stack, so that the report of a gang of hundreds stays short.
    """
    root = root_cause(records)
    root_line = f"attempt {root.attempt}, {root.summary()}" if root else "no rank reported a failure"
    lines = [headline, f"Root cause: {root_line}"]
    by_attempt: dict[int, list[RankRecord]] = defaultdict(list)
    for rec in records:
        by_attempt[rec.attempt].append(rec)
    shown: set[str] = set()
    for attempt in sorted(by_attempt):
        recs = sorted(by_attempt[attempt], key=lambda r: r.rank)
        attempt_root = root_cause(recs)
        lines.append(f"Attempt {attempt}:")
        for entry in _entries(recs, attempt_root):
            rec = entry[0]
            if len(entry) > 1:
                lines.append(f"  ranks {rank_ranges([r.rank for r in entry])} ({len(entry)} ranks on "
                             f"{_hosts(entry)}; numbers may differ): {rec.outcome()}" + (f": {rec.error}" if rec.error else ""))
                walls = sorted(r.failed_wall for r in entry if r.failed and r.failed_wall is not None)
                if walls:
                    lines.append(f"    failed from {wall_time(walls[0])} to {wall_time(walls[-1])} (their hosts' clocks)")
                if rec.stack:
                    lines.append(f"    stack of each {rec.stack_when or 'before it was stopped'} (rank {rec.rank}'s):")
                    lines.extend(f"    | {line}" for line in trim_stack(rec.stack))
                continue
            marker = "  <- first failure of this attempt" if rec is attempt_root else ""
            lines.append(f"  {rec.summary()}{marker}")
            key = error_key(rec.error or rec.outcome())
            if rec.failed and rec.failed_wall is not None:
                lines.append(f"    failed at {wall_time(rec.failed_wall)} (its host's clock)")
            if rec is attempt_root and rec.tail and key not in shown:
                shown.add(key)
                lines.append("    last output:")
                lines.extend(f"    | {line}" for line in rec.tail)
            if rec.stack:
                pid = f" (pid {rec.pid})" if rec.pid else ""
                lines.append(f"    stack of rank {rec.rank}{pid} {rec.stack_when or 'before it was stopped'}:")
                lines.extend(f"    | {line}" for line in trim_stack(rec.stack))
        for rec in recs:
            lines.extend(f"  rank {rec.rank} skipped checkpoint {seq}, which did not verify: {why}"
                         for seq, why in rec.skipped)
    groups: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for rec in records:
        if rec.failed:
            groups[error_key(rec.error or rec.outcome())][rec.attempt].append(rec.rank)
    repeated = {err: where for err, where in groups.items() if sum(map(len, where.values())) > 1}
    if repeated:
        lines.append("Identical errors (numbers shown as N):")
        for err, where in repeated.items():
            places = ", ".join(f"attempt {a} rank {ranks[0]}" if len(ranks) == 1 else f"attempt {a} ranks {rank_ranges(ranks)}"
                               for a, ranks in sorted(where.items()))
            lines.append(f"  {sum(map(len, where.values()))}x {err}  [{places}]")
    if spark_error:
        first = spark_error.strip().splitlines()[0] if spark_error.strip() else ""
        lines.append(f"Spark said: {first[:500]}")
    lines.append(hint)
    return "\n".join(lines), root_line
