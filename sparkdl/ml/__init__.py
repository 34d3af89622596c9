"""Spark ML integration: :class:`TorchEstimator` trains a PyTorch model as one stage of a Pipeline,
and :class:`TorchModel` scores DataFrames with it, vectorized over Arrow batches.

The two classes subclass pyspark.ml's, so they load on first use (``sparkdl.ml.TorchModel``
imports pyspark then, ``import sparkdl.ml`` does not): their modules are internal.

Both classes save and load under the names ``sparkdl.ml.TorchEstimator`` and
``sparkdl.ml.TorchModel``, as Spark ML stages name their class in the saved metadata.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparkdl._internal.ml.estimator import TorchEstimator
    from sparkdl._internal.ml.model import TorchModel

__all__ = ["TorchEstimator", "TorchModel"]

_LAZY = {"TorchEstimator": "sparkdl._internal.ml.estimator", "TorchModel": "sparkdl._internal.ml.model"}


def __getattr__(name: str) -> Any:
    # Spark ML's reader and pickle find the classes by name here (``sparkdl.ml.TorchModel``).
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sparkdl.ml' has no attribute {name!r}")
