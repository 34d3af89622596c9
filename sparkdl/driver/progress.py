"""Metrics that ranks send with ``context().log_metrics``, and the driver's progress line.

The driver appends every record to ``metrics.jsonl`` in the run's directory as it arrives, so a
crashed or interrupted driver still leaves them on disk, and keeps them for the
:class:`~sparkdl.driver.result.RunResult` that :func:`sparkdl.launch` returns.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any


class MetricsLog:
    """Thread-safe: records in memory and, line by line, in a JSON-lines file."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def add(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.records.append(record)
            if self._file is not None:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class Progress:
    """The driver's live progress: epoch, step, throughput and the latest loss, from rank 0's metrics.

    In a notebook it is one line updated in place; in a terminal or a log it is a line printed
    at most every ``interval_s`` seconds, on stderr, so it never mixes into a rank's stdout.
    """

    def __init__(self, interval_s: float, enabled: bool) -> None:
        self.enabled = enabled
        self.interval_s = interval_s
        self._last_print = 0.0
        self._state: dict[str, Any] = {}
        self._rate: tuple[float, float] | None = None  # (time, step) of the previous sample
        self._steps_per_s: float | None = None
        self._handle: Any = None
        self._lock = threading.Lock()

    def update(self, record: dict[str, Any]) -> None:
        if not self.enabled or record.get("rank") != 0:
            return
        with self._lock:
            now = time.monotonic()
            step = record.get("step")
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
        return "sparkdl progress: " + " | ".join(parts)

    def _show(self, text: str) -> None:
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

    def finish(self) -> None:
        if self.enabled and self._state:
            with self._lock:
                self._show(self.render())


def _in_notebook() -> bool:
    """True under a Jupyter kernel, where a display handle can update one line in place."""
    if "IPython" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"
