"""Features that the model cannot take as they are stored: an image column (encoded bytes from
Spark's ``binaryFile`` source, or the struct of its ``image`` source) with a per-sample function
``fn(value, rng) -> array`` that decodes it, such as :class:`sparkdl.ImageDecoder`.

In ``fit``, the ranks' loaders run ``featuresDecoder`` (with its augmentation, each sample's draws
from its row) on their decode workers, and the validation rows go through ``evalDecoder``; the fitted
model scores with ``evalDecoder``, on the executors, a batch of rows at a time. An ``ImageDecoder``
that crops at random is evaluated with the same decoder cropping at the center, unless
``evalDecoder`` says otherwise. Decoded ``uint8`` arrays reach the model as floats in ``[0, 1]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sparkdl._internal.common.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    from pyspark.sql.types import DataType

__all__ = ["check_decoder", "decode_values", "eval_decoder", "holds_images"]


def check_decoder(name: str) -> Any:
    """The converter of the param ``name``: None, or a callable taking ``(value, rng)``."""

    def convert(value: Any) -> Any:
        if value is None or callable(value):
            return value
        raise ConfigError(
            f"{name} must be a per-sample function fn(value, rng) -> array, such as sparkdl.ImageDecoder(224), "
            f"or None; got {type(value).__name__}"
        )

    return convert


def eval_decoder(train: Any, explicit: Any) -> Any:
    """The decoder of validation and scoring: ``explicit``, else ``train``'s deterministic form."""
    if explicit is not None or train is None:
        return explicit
    for_eval = getattr(train, "for_eval", None)
    return for_eval() if callable(for_eval) else train


def holds_images(t: DataType) -> bool:
    """Whether a column of type ``t`` holds images: encoded bytes, or Spark's image struct."""
    from pyspark.sql import types as T

    if isinstance(t, T.BinaryType):
        return True
    return isinstance(t, T.StructType) and {"data", "nChannels", "height", "width"} <= set(t.fieldNames())


def decode_values(decoder: Any, values: Sequence[Any], col: str, what: str = "featuresDecoder") -> np.ndarray:
    """``decoder`` applied to each value, stacked: ``[len(values), ...]``, or a ConfigError naming
    the column and the first value that failed. Each value gets a generator seeded alike, so a
    decoder without random draws (an evaluation crop) gives each image its one result."""
    import numpy as np

    out = []
    for i, value in enumerate(values):
        if value is None:
            raise ConfigError(f"featuresCol={col!r} is null in a row to decode; drop or fill those rows first")
        if hasattr(value, "asDict"):  # a struct collected to the driver (a pyspark Row): as the loader gives it
            value = value.asDict()
        try:
            out.append(np.asarray(decoder(value, np.random.default_rng(0))))
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"{what} failed on row {i} of a batch of featuresCol={col!r}: {type(exc).__name__}: {exc}"
            ) from exc
        if out[-1].shape != out[0].shape:
            raise ConfigError(
                f"{what} gave arrays of shapes {out[0].shape} and {out[-1].shape} for rows of featuresCol={col!r}; "
                "it must give every row one shape (ImageDecoder(size=...) does)"
            )
    return np.stack(out) if out else np.zeros((0,), np.uint8)
