"""For the safe-loading tests (tests/integration/test_safe_loading.py,
tests/unit/train/test_safe_checkpoints.py): what an attacker plants in a checkpoint, and the draws
of every RNG that a checkpoint must restore. Registered to be pickled by value, so the ranks need
not import it."""

from __future__ import annotations

import os
import random
import sys
from typing import Any

import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Planted:
    """What an attacker plants: unpickling it creates the directory ``marker``, i.e. runs code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.makedirs, (self.marker, 0o777, True))


def _plain_draws() -> tuple[float, float, float, list[float]]:
    import numpy as np
    import torch

    return random.random(), random.gauss(0, 1), float(np.random.standard_normal()), torch.rand(3).tolist()
