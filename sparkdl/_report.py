"""What happened to each rank of each attempt, and the one report a failed run gives.

Pure data and pure functions: no processes, no Spark. The launcher feeds it events.
"""

from __future__ import annotations

import re
import signal
from collections import defaultdict
from dataclasses import dataclass, field


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
    state: str = "starting"  # starting | running | succeeded | failed | lost
    failed_at: float | None = None
    tail: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.state in ("failed", "lost")

    def outcome(self) -> str:
        if self.state == "succeeded":
            return "succeeded"
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return f"killed by {name}"
        if self.exit_code is not None:
            return f"exited with code {self.exit_code}"
        if self.state == "lost":
            return "lost: its Spark task ended without an exit status (task killed or executor lost)"
        if self.state == "starting":
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
    return min(failed, key=lambda r: (r.failed_at, r.state != "failed", r.rank))


def decide(failed_attempt: int, max_attempts: int) -> str:
    """Retry policy: ``"rerun"`` while attempts remain after ``failed_attempt``, else ``"stop"``."""
    return "rerun" if failed_attempt + 1 < max_attempts else "stop"


# Errors in the program itself: raised the same way by every rank, a rerun meets them again.
PROGRAM_ERRORS = frozenset({
    "TypeError",
    "NameError",
    "AttributeError",
    "ImportError",
    "ModuleNotFoundError",
    "SyntaxError",
    "IndentationError",
    "NotImplementedError",
    "UnboundLocalError",
})


def _error_type(error: str | None) -> str:
    head = (error or "").split(":", 1)[0].strip()
    return head.rsplit(".", 1)[-1]


def unrecoverable(
    attempt: list[RankRecord], previous: list[RankRecord], *, progressed: bool
) -> str | None:
    """Why rerunning the gang after this failed attempt cannot help, or None when it may.

    A rerun is skipped only when the attempt made no progress (saved no new checkpoint) and
    either every rank failed with the same error of a kind that is a bug in the program
    (``TypeError``, ``NameError``, ...), or the attempt failed with the same root cause as the
    attempt before it. Anything else (a crash, a signal, a lost executor, a timeout in a
    collective, a one-off error on one rank) is worth a rerun.
    """
    if progressed or not attempt:
        return None
    errors = {_error_key(r.error) for r in attempt if r.state == "failed" and r.error}
    all_failed = all(r.state == "failed" and r.error for r in attempt)
    if all_failed and len(errors) == 1:
        kind = _error_type(attempt[0].error)
        if kind in PROGRAM_ERRORS:
            return f"every rank raised the same {kind} ({attempt[0].error}); a rerun would raise it again"
    root, before = root_cause(attempt), root_cause(previous)
    if (
        root is not None
        and before is not None
        and root.error
        and _error_key(root.error) == _error_key(before.error or "")
    ):
        return (
            f"attempt {root.attempt} failed with the same root cause as attempt {before.attempt} "
            f"({root.error}) and saved no checkpoint in between"
        )
    return None


def _error_key(error: str) -> str:
    # Ports, pids and addresses differ between otherwise identical errors.
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
            key = _error_key(rec.error or rec.outcome())
            if rec is attempt_root and rec.tail and key not in shown:
                shown.add(key)
                lines.append("    last output:")
                lines.extend(f"    | {line}" for line in rec.tail)
    groups: dict[str, list[str]] = defaultdict(list)
    for rec in records:
        if rec.failed:
            groups[_error_key(rec.error or rec.outcome())].append(f"attempt {rec.attempt} rank {rec.rank}")
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
