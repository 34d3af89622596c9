"""The numpy arrays of served shuffle windows, kept for the windows still to be read, so that the
same memory serves every window of every epoch (:mod:`sparkdl._internal.data.reading.read`)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np


def new_array(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return np.empty(shape, dtype=np.dtype(dtype))


class Spares:
    """The numpy arrays of served shuffle windows, kept for the windows still to be read.

    Shared by the thread that serves windows (``give``) and the one that reads them (``take``).
    Two per column are enough: a window is given back before the window after next is read, and
    the last two windows of an epoch hand theirs to the first two of the next.
    """

    _KEEP = 2

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[tuple[int, ...], str], list[np.ndarray]] = {}

    def take(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """An array of ``shape`` and ``dtype``: the first rows of a spare one, or a new one."""
        key = (shape[1:], np.dtype(dtype).str)
        with self._lock:
            free = self._free.get(key)
            spare = free.pop() if free else None
            if spare is None or len(spare) < shape[0]:
                self._free.clear()  # a shape no spare fits: let them all go before allocating
                spare = None
        return new_array(shape, dtype) if spare is None else spare[: shape[0]]

    def give(self, window: dict[str, Any]) -> None:
        """Takes back the numpy arrays of a window whose batches are all cut (all copies)."""
        with self._lock:
            for data in window.values():
                if isinstance(data, np.ndarray):
                    root = data if data.base is None else data.base
                    if isinstance(root, np.ndarray) and root.base is None:
                        free = self._free.setdefault((root.shape[1:], root.dtype.str), [])
                        if len(free) < self._KEEP:
                            free.append(root)

    def clear(self) -> None:
        """Lets every spare array go."""
        with self._lock:
            self._free.clear()


__all__ = ["Spares", "new_array"]
