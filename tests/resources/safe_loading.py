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


def plant_checkpoint(directory: str | os.PathLike[str], seq: int, obj: Any, *, record: bool = True) -> None:
    """What an attacker who knows the format plants: ``ckpt-<seq>.pt`` holding ``obj`` and, with
    ``record``, a commit record that matches it (both written straight into place)."""
    import io

    import torch

    from sparkdl._internal.ckpt import records

    buf = io.BytesIO()
    torch.save(obj, buf)
    with open(os.path.join(directory, records.data_name(seq)), "wb") as f:
        f.write(buf.getvalue())
    if record:
        with open(os.path.join(directory, records.record_name(seq)), "wb") as f:
            f.write(records.build(seq, buf.getvalue(), "planted-0", None))


def _plain_draws() -> tuple[float, float, float, list[float]]:
    import numpy as np
    import torch

    return random.random(), random.gauss(0, 1), float(np.random.standard_normal()), torch.rand(3).tolist()
