"""Metrics that ranks send with ``context().log_metrics``, and the driver's progress line.

The driver appends every record to ``metrics.jsonl`` in the run's directory as it arrives, so a
crashed or interrupted driver still leaves them on disk, and keeps them for the
:class:`~sparkdl._internal.driver.result.RunResult` that :func:`sparkdl.launch` returns.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from sparkdl._internal.driver.report import rank_ranges
from sparkdl._internal.wire.messages import PROGRESS_KEY as PROGRESS_KEY


class MetricsLog:
    """Thread-safe: records in memory (unless ``keep`` is False: a relay hub, whose record of the
    attempt carries them) and, line by line, in a JSON-lines file."""

    def __init__(self, path: Path | None, *, keep: bool = True) -> None:
        self.path = path
        self.keep = keep
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def add(self, record: dict[str, Any]) -> None:
        with self._lock:
            if self.keep:
                self.records.append(record)
            if self._file is not None:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


# Below this median step nobody is called a straggler: at the start, ranks are a few steps apart.
STRAGGLER_MIN_MEDIAN = 10


class Progress:
    """The driver's live progress: epoch, step, throughput and the latest loss, from rank 0's metrics,
    and, once several ranks report their step, the spread of the steps and the stragglers.

    In a notebook it is one line updated in place; in a terminal or a log it is a line printed
    at most every ``interval_s`` seconds, on stderr, so it never mixes into a rank's stdout.

    A straggler is a rank of the current attempt whose step times ``straggler_factor`` is below
    the median step (once the median is :data:`STRAGGLER_MIN_MEDIAN` or more). Steps are tracked
    with the line off too, for the failure report.
    """

    def __init__(self, interval_s: float, enabled: bool, straggler_factor: float = 1.5) -> None:
        self.enabled = enabled
        self.straggler_factor = straggler_factor
        self._steps: dict[int, float] = {}  # rank -> its latest step, in attempt self._attempt
        self._attempt = 0
        self.interval_s = interval_s
        self._last_print = 0.0
        self._state: dict[str, Any] = {}
        self._rate: tuple[float, float] | None = None  # (time, step) of the previous sample
        self._steps_per_s: float | None = None
        self._handle: Any = None
        self._lock = threading.Lock()
        # The console is written by a thread of its own: the connections' threads that feed
        # update() must never wait on a stderr that stalls (a full pipe, a slow log collector),
        # or the tasks' sends time out and the ranks lose their link to the driver. Only the
        # newest line waits to be written; the ones it replaced are counted in ``dropped``.
        self._out = threading.Condition()
        self._pending: str | None = None
        self._writer: threading.Thread | None = None
        self.dropped = 0

    def update(self, record: dict[str, Any]) -> None:
        rank, step = record.get("rank"), record.get("step")
        with self._lock:
            attempt = record.get("attempt", 0)
            if isinstance(attempt, int) and attempt > self._attempt:
                self._attempt, self._steps = attempt, {}
            if isinstance(rank, int) and isinstance(step, (int, float)) and attempt == self._attempt:
                self._steps[rank] = step
            if not self.enabled:
                return
            now = time.monotonic()
            if rank != 0:
                if self._state and now - self._last_print >= self.interval_s:
                    self._last_print = now
                    self._show(self.render())
                return
            if isinstance(step, (int, float)):
                if self._rate is not None and step > self._rate[1] and now > self._rate[0]:
                    self._steps_per_s = (step - self._rate[1]) / (now - self._rate[0])
                if self._rate is None or now - self._rate[0] >= 1.0 or step < self._rate[1]:
                    self._rate = (now, float(step))
            self._state.update(record)
            if now - self._last_print >= self.interval_s:
                self._last_print = now
                self._show(self.render())

    def render(self) -> str:
        s = self._state
        parts = [f"attempt {s.get('attempt', 0)}"]
        if "epoch" in s:
            parts.append(f"epoch {s['epoch']}")
        step = s.get("epoch_step", s.get("step"))
        if step is not None:
            total = s.get("steps_per_epoch")
            parts.append(f"step {step}" + (f"/{total}" if total else ""))
        if self._steps_per_s is not None:
            parts.append(f"{self._steps_per_s:.1f} steps/s")
        if isinstance(s.get("loss"), (int, float)):
            parts.append(f"loss {s['loss']:.4g}")
        if len(self._steps) > 1:
            low, median, high = self._spread()
            slowest = min(self._steps, key=lambda r: (self._steps[r], r))
            parts.append(f"ranks' steps {low:g}/{median:g}/{high:g} (min/median/max; slowest rank {slowest})")
            if behind := self._behind(median):
                parts.append(f"stragglers: ranks {rank_ranges(behind)}")
        return "sparkdl progress: " + " | ".join(parts)

    def _spread(self) -> tuple[float, float, float]:
        steps = sorted(self._steps.values())
        return steps[0], steps[len(steps) // 2], steps[-1]

    def _behind(self, median: float) -> list[int]:
        if median < STRAGGLER_MIN_MEDIAN:
            return []
        return sorted(r for r, step in self._steps.items() if step * self.straggler_factor < median)

    def stragglers(self) -> str | None:
        """The stragglers of the latest attempt, with their steps, in a sentence; None when none."""
        with self._lock:
            if len(self._steps) < 2:
                return None
            median = self._spread()[1]
            behind = self._behind(median)
            if not behind:
                return None
            shown = ", ".join(f"rank {r} at step {self._steps[r]:g}" for r in behind[:8])
            more = f" and {len(behind) - 8} more" if len(behind) > 8 else ""
            return (f"Stragglers of attempt {self._attempt} (steps behind the median {median:g} by more than "
                    f"RunConfig.straggler_factor={self.straggler_factor:g}): {shown}{more}.")

    def _show(self, text: str) -> None:
        with self._out:
            if self._pending is not None:
                self.dropped += 1
            self._pending = text
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_pending, name="sparkdl-progress", daemon=True)
                self._writer.start()

    def _write_pending(self) -> None:
        while True:
            with self._out:
                text, self._pending = self._pending, None
                if text is None:
                    self._writer = None
                    self._out.notify_all()
                    return
            self._emit(text)

    def drain(self, timeout_s: float) -> bool:
        """Waits until the lines shown so far are written, at most ``timeout_s``; False when the
        console did not take them in time (its last line is then dropped with the writer)."""
        with self._out:
            return self._out.wait_for(lambda: self._writer is None, timeout=timeout_s)

    def _emit(self, text: str) -> None:
        if _in_notebook():
            try:
                from IPython.display import display

                # Raw text/plain, so the notebook shows the line itself, not a quoted str.
                bundle = {"text/plain": text}
                if self._handle is None:
                    self._handle = display(bundle, raw=True, display_id=True)
                else:
                    self._handle.update(bundle, raw=True)
                return
            except Exception:
                pass
        sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def finish(self, timeout_s: float = 10.0) -> None:
        """Shows the last line and waits, at most ``timeout_s``, for the console to take it."""
        if self.enabled and self._state:
            with self._lock:
                self._show(self.render())
        self.drain(timeout_s)


def _in_notebook() -> bool:
    """True under a Jupyter kernel, where a display handle can update one line in place."""
    if "IPython" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"
