"""What a trial of ``sparkdl.tune`` tells its ranks, and what they tell back.

A trial is one ``sparkdl.run`` gang. Its ranks learn the trial (number, parameters, whether the
study prunes) from their environment (:class:`TrialSpec`); they send ``context().report(value,
step)`` to the driver as a metric record marked with :data:`REPORT_KEY`; rank 0's goes to the
study's pruner, and the decision (:class:`Decide`) goes to every rank of the gang: over the
task's channel to its lane, then down the rank's control pipe as one JSON line
(:func:`decision_line`). A rank reads its decision for a step before it goes on, so every rank
leaves the same step with the same decision. :class:`Pruned` is what rank 0 returns when the
trial ends pruned.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The key of a Metric record that is a trial's report (its "objective" and "step" are the value).
REPORT_KEY = "sparkdl.report"
OBJECTIVE = "objective"
_ENV = "SPARKDL_TRIAL"


@dataclass(frozen=True)
class TrialSpec:
    """The trial a run is (``sparkdl.tune``), as its ranks see it: ``context().trial``.

    Attributes:
        number: the trial's number in the study (Optuna's ``trial.number``).
        params: what the search space returned for this trial.
        pruning: whether the driver answers each report with a decision (the study has a pruner
            other than Optuna's ``NopPruner``); without it ``report`` does not wait.
    """

    number: int
    params: Mapping[str, Any] = field(default_factory=dict)
    pruning: bool = True

    def env(self) -> dict[str, str]:
        return {_ENV: json.dumps({"number": self.number, "params": dict(self.params), "pruning": self.pruning})}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TrialSpec | None:
        raw = env.get(_ENV)
        if not raw:
            return None
        data = json.loads(raw)
        return cls(int(data["number"]), dict(data["params"]), bool(data["pruning"]))


@dataclass(frozen=True)
class Decide:
    """The driver's answer to rank 0's report at ``step``: ``prune`` the trial or go on. Sent to
    every rank of the gang, whichever rank's report it answers."""

    step: int
    prune: bool

    def encode(self) -> dict[str, Any]:
        return {"do": "decide", "step": self.step, "prune": self.prune}

    @classmethod
    def asked(cls, frame: dict[str, Any] | None) -> Decide | None:
        """The decision in a frame from the driver, None when the frame is not one."""
        if frame is None or frame.get("do") != "decide":
            return None
        step, prune = frame.get("step"), frame.get("prune")
        if isinstance(step, bool) or not isinstance(step, int) or not isinstance(prune, bool):
            return None
        return cls(step, prune)


def decision_line(decision: Decide | None, *, off: str | None = None) -> bytes:
    """One line of the rank's control pipe after its gang: a decision, or (``off``) why no
    decision will come (the gang reports through the relay hub, which does not carry them)."""
    body = {"off": off} if decision is None else {"step": decision.step, "prune": decision.prune}
    return (json.dumps(body) + "\n").encode()


@dataclass(frozen=True)
class Pruned:
    """Rank 0's return value when its trial ended pruned (``TrialPruned`` raised, Optuna's or sparkdl's)."""

    step: int | None = None


def is_pruned_exception(exc: BaseException) -> bool:
    """Whether ``exc`` ends a trial as pruned: :class:`sparkdl.TrialPruned` or ``optuna.TrialPruned``
    (matched by name, so that a rank need not import Optuna)."""
    return type(exc).__name__ == "TrialPruned" and type(exc).__module__.split(".")[0] in ("sparkdl", "optuna")
