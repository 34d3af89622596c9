"""Refusing a diverged state: where a checkpoint holds NaN or infinite numbers
(``RunConfig.checkpoint_finite_only``)."""

from __future__ import annotations

import math
from typing import Any

from sparkdl._internal.common.errors import SparkDLError


def nonfinite_paths(obj: Any, at: str = "") -> list[str]:
    """Where ``obj`` holds a NaN or an infinity (floating tensors and Python floats), by path."""
    import torch

    found: list[str] = []
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        if (local.is_floating_point() or local.is_complex()) and not bool(torch.isfinite(local).all()):
            found.append(at or "(the object)")
    elif isinstance(obj, float):
        if not math.isfinite(obj):
            found.append(at or "(the object)")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            found += nonfinite_paths(v, f"{at}/{k}" if at else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found += nonfinite_paths(v, f"{at}[{i}]")
    return found


def refuse_nonfinite(bad: list[str], what: str) -> None:
    """Raises :class:`NonFiniteCheckpointError` for ``what`` when ``bad`` (from :func:`nonfinite_paths`) names any place."""
    if bad:
        raise NonFiniteCheckpointError(
            f"{what} was not committed: it holds NaN or infinite values at {', '.join(bad[:5])}"
            f"{' ...' if len(bad) > 5 else ''} (the run diverged), and RunConfig.checkpoint_finite_only=True "
            "keeps such a state from replacing the good checkpoints kept; the rerun resumes from the newest "
            "of those. Lower the learning rate, or clip gradients"
        )


class NonFiniteCheckpointError(SparkDLError):
    """A checkpoint holding NaN or infinite values, refused under ``RunConfig.checkpoint_finite_only``."""
