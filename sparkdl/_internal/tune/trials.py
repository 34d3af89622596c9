"""One search's trials in an Optuna study: which are this search's, new ones, resumed ones, their
outcomes, and what the progress line says of them.

A search is known by its directory (``tune_dir``): every trial it makes carries the directory in
the user attribute :data:`SEARCH_ATTR`, so that calling ``sparkdl.tune`` again with the same study
and directory (after the driver died) finds them: the finished ones are kept, and the ones left
RUNNING are resumed, from their own checkpoints, as the same Optuna trials.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sparkdl._internal.common.errors import ConfigError

if TYPE_CHECKING:
    import optuna

log = logging.getLogger(__name__)

SEARCH_ATTR = "sparkdl.tune_dir"
ERROR_ATTR = "sparkdl.error"
RUN_ATTR = "sparkdl.run_id"


def require_optuna() -> Any:
    """The optuna module; ConfigError saying how to install it."""
    try:
        import optuna
    except ImportError as exc:
        raise ConfigError("sparkdl.tune searches with Optuna, which is not installed: pip install 'sparkdl[tune]' "
                          "(or optuna)") from exc
    return optuna


def search_trials(study: optuna.Study, tune_dir: str) -> list[optuna.trial.FrozenTrial]:
    """The trials of the search in ``tune_dir``, in order."""
    return [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get(SEARCH_ATTR) == tune_dir]


def prunes(study: optuna.Study) -> bool:
    """Whether the study's pruner can prune (ranks then wait for each report's decision)."""
    optuna = require_optuna()
    return not isinstance(study.pruner, optuna.pruners.NopPruner)


@dataclass
class Tally:
    """What the search's progress line says; thread-safe through ``lock``."""

    total: int
    direction_max: bool
    running: int = 0
    complete: int = 0
    pruned: int = 0
    failed: int = 0
    best: float | None = None
    best_trial: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    out: Any = None  # where the line goes: sys.stderr when None

    def started(self, number: int, resumed: bool) -> None:
        with self.lock:
            self.running += 1
            self._say(f"trial {number} {'resumed' if resumed else 'started'}")

    def ended(self, number: int, state: str, value: float | None) -> None:
        with self.lock:
            self.running -= 1
            if state == "COMPLETE":
                self.complete += 1
                if value is not None and not math.isnan(value) and (
                    self.best is None or (value > self.best if self.direction_max else value < self.best)
                ):
                    self.best, self.best_trial = value, number
            elif state == "PRUNED":
                self.pruned += 1
            elif state != "RUNNING":
                self.failed += 1
            said = {"COMPLETE": "completed", "PRUNED": "was pruned", "RUNNING": "was stopped"}.get(state, "failed")
            self._say(f"trial {number} {said}" + (f" with {value:.6g}" if value is not None else ""))

    def _say(self, event: str) -> None:
        done = self.complete + self.pruned + self.failed
        best = f"; best {self.best:.6g} (trial {self.best_trial})" if self.best is not None else ""
        line = (f"sparkdl tune: {event}: {self.running} running, {done} of {self.total} finished "
                f"({self.pruned} pruned, {self.failed} failed){best}")
        out = self.out or sys.stderr
        try:
            out.write(line + "\n")
            out.flush()
        except (OSError, ValueError):
            pass


class Judge:
    """Rank 0's reports of one trial, into the study: ``trial.report`` and, when the study
    prunes, its pruner's decision (None: no decision is sent to the ranks)."""

    def __init__(self, trial: optuna.Trial, pruning: bool, reported: set[int]) -> None:
        self.trial = trial
        self.pruning = pruning
        self.last: float | None = None
        self._reported = set(reported)  # steps the study has (a resumed trial's, from before)
        self._lock = threading.Lock()

    def __call__(self, step: int, value: float) -> bool | None:
        with self._lock:
            self.last = value
            if step not in self._reported:
                # A rerun reports the steps after its checkpoint again: the first value stands.
                self._reported.add(step)
                self.trial.report(value, step)
            if not self.pruning:
                return None
            return bool(self.trial.should_prune())


def first_lines(text: str, limit: int = 2000) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."
