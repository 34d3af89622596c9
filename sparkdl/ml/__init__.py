"""Spark ML integration: :class:`TorchEstimator` trains a PyTorch model as one stage of a Pipeline,
and :class:`TorchModel` scores DataFrames with it, vectorized over Arrow batches.

The two classes subclass pyspark.ml's, so they load on first use (``sparkdl.ml.TorchModel``
imports pyspark then, ``import sparkdl.ml`` does not): the modules below them, the scoring
function included, import where pyspark is not installed (``tools/gpu-check`` scores on a GPU
machine without Spark). Its modules, each importing only those listed before it:

- ``plan``: the task and loss names, and the frozen :class:`~sparkdl.ml.fit_plan.FitPlan` ranks get;
- ``params``: the Spark ML params and their converters;
- ``persistence``: ``save``/``load`` through Spark ML's writer and reader;
- ``columns``: column type checks, feature and label expressions, the data check of ``fit``;
- ``training``: what each rank runs (model, loss, optimizer, the epoch loop);
- ``probe``: the model tried on a few rows on the driver before training;
- ``scoring``: the Arrow scoring UDF and the per-worker model cache;
- ``model``: :class:`TorchModel`; ``estimator``: :class:`TorchEstimator`.

Both classes save and load under the names ``sparkdl.ml.TorchEstimator`` and
``sparkdl.ml.TorchModel``, as Spark ML stages name their class in the saved metadata.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparkdl.ml.estimator import TorchEstimator
    from sparkdl.ml.model import TorchModel

__all__ = ["TorchEstimator", "TorchModel"]

_LAZY = {"TorchEstimator": "sparkdl.ml.estimator", "TorchModel": "sparkdl.ml.model"}


def __getattr__(name: str) -> Any:
    # Spark ML's reader and pickle find the classes by name here (``sparkdl.ml.TorchModel``).
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sparkdl.ml' has no attribute {name!r}")
