"""The checks that settings and arguments share, each with one message shape.

Every message names the setting (``what``), the value it got and what is allowed, so the user
can fix the call without reading sparkdl's source. ``what`` is the name as the user wrote it:
``"RunConfig.timeout_s"``, ``"num_workers"``, ``"maxEpochs"``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from sparkdl._internal.common.errors import ConfigError


def invalid(what: str, value: Any, allowed: str) -> ConfigError:
    """The error of every check: "``what`` must be ``allowed``; got ``value``"."""
    return ConfigError(f"{what} must be {allowed}; got {value!r}")


def one_of(what: str, value: Any, choices: Mapping[str, str] | Sequence[str]) -> Any:
    """``value`` if it is one of ``choices`` (names, or name -> what it means), else the error listing them."""
    if not isinstance(value, str) or value not in choices:
        named = (f"{name!r} ({choices[name]})" if isinstance(choices, Mapping) else repr(name) for name in choices)
        raise invalid(what, value, "one of " + ", ".join(named))
    return value


def is_number(value: Any) -> bool:
    """A real int or float (``bool`` is not a number here), finite."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def is_int(value: Any) -> bool:
    """An integer (``int``, numpy's) that is not a ``bool``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def int_at_least(what: str, value: Any, minimum: int, *, note: str = "", allow_none: bool = False,
                 integral_floats: bool = False) -> int | None:
    """``value`` as an int, or ConfigError "``what`` must be an integer >= ``minimum````note``; got ...".

    ``integral_floats`` also accepts floats with no fraction (``2.0``), as Spark ML params hold them.
    """
    if value is None and allow_none:
        return None
    ok = is_int(value) or (integral_floats and is_number(value) and int(value) == value)
    if not ok or value < minimum:
        raise invalid(what, value, f"an integer >= {minimum}{' or None' if allow_none else ''}{note}")
    return int(value)


def positive_seconds(what: str, value: Any, *, allow_none: bool = False) -> float | None:
    """``value`` as a float, or ConfigError "``what`` must be a positive number of seconds; got ..."."""
    if value is None and allow_none:
        return None
    if not is_number(value) or value <= 0:
        raise invalid(what, value, "a positive number of seconds" + (" or None for no limit" if allow_none else ""))
    return float(value)


def positive_number(what: str, value: Any) -> float:
    """``value`` as a float, or ConfigError "``what`` must be a positive number; got ..."."""
    if not is_number(value) or value <= 0:
        raise invalid(what, value, "a positive number")
    return float(value)


def nearest_multiples(what: str, value: int, step: int) -> str:
    """The counts of ``what`` nearest ``value`` that are multiples of ``step``, as a fix says them:
    ``"num_workers=4 or 6"`` (only ``step`` itself below the first multiple)."""
    low = value - value % step
    return f"{what}={low or step}" + (f" or {low + step}" if low else "")
