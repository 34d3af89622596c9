"""How the drop-ins call the user's function: its keyword arguments checked against its signature
before anything starts, as the originals do, then bound to it. A leaf: standard library only."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any


def bind_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Callable[..., Any]:
    """``fn`` with the user's keyword arguments bound."""
    # The user's keyword arguments travel bound to fn, so that names sparkdl.run takes itself
    # (backend, config, use_gpu, ...) reach fn instead of clashing with sparkdl.run's own.
    return functools.partial(fn, **kwargs) if kwargs else fn


def check_call(what: str, fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """Raises ``TypeError`` naming ``what`` when ``fn`` cannot take ``kwargs``, before anything starts."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without a signature to check: it runs unchecked
        return
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        raise TypeError(
            f"{what}: {getattr(fn, '__name__', fn)!s}{signature} cannot be called with the keyword "
            f"arguments {sorted(kwargs)}: {exc}"
        ) from None
