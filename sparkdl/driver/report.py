"""What happened to each rank of each attempt, and the one report a failed run gives.

Pure data and pure functions: no processes, no Spark. The monitor feeds it events.
"""

from __future__ import annotations

import re
import signal
from collections import defaultdict
from dataclasses import dataclass, field

from sparkdl.wire.messages import RankState


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
    failed_at: float | None = None
    tail: list[str] = field(default_factory=list)

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


def root_cause(records: list[RankRecord]) -> RankRecord | None:
    """The earliest failure as the driver saw it; later failures are usually its consequences."""
    failed = [r for r in records if r.failed and r.failed_at is not None]
    if not failed:
        return None
    return min(failed, key=lambda r: (r.failed_at, r.state is not RankState.FAILED, r.rank))


def error_key(error: str) -> str:
    """An error with its numbers (ports, pids, addresses) as N: identical errors compare equal."""
    return re.sub(r"\d+", "N", error)


def build_report(
    records: list[RankRecord],
    *,
    headline: str,
    hint: str,
    spark_error: str | None = None,
) -> tuple[str, str]:
    """The failure report, and the one-line root cause it names.

    Each attempt lists every rank's outcome; the first failure of each attempt also shows the
    tail of its output, unless an earlier attempt already showed the same error.
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
        for rec in recs:
            marker = "  <- first failure of this attempt" if rec is attempt_root else ""
            lines.append(f"  {rec.summary()}{marker}")
            key = error_key(rec.error or rec.outcome())
            if rec is attempt_root and rec.tail and key not in shown:
                shown.add(key)
                lines.append("    last output:")
                lines.extend(f"    | {line}" for line in rec.tail)
    groups: dict[str, list[str]] = defaultdict(list)
    for rec in records:
        if rec.failed:
            groups[error_key(rec.error or rec.outcome())].append(f"attempt {rec.attempt} rank {rec.rank}")
    repeated = {err: where for err, where in groups.items() if len(where) > 1}
    if repeated:
        lines.append("Identical errors (numbers shown as N):")
        for err, where in repeated.items():
            lines.append(f"  {len(where)}x {err}  [{', '.join(where)}]")
    if spark_error:
        first = spark_error.strip().splitlines()[0] if spark_error.strip() else ""
        lines.append(f"Spark said: {first[:500]}")
    lines.append(hint)
    return "\n".join(lines), root_line
