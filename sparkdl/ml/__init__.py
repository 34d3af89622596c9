"""Spark ML integration: :class:`TorchEstimator` trains a PyTorch model as one stage of a Pipeline,
and :class:`TorchModel` scores DataFrames with it, vectorized over Arrow batches.

Importing this package imports pyspark, so ``sparkdl`` loads it on first use of either class.
Its modules, each importing only those listed before it:

- ``plan``: the task and loss names, and the frozen :class:`~sparkdl.ml.plan.FitPlan` ranks get;
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

from sparkdl.ml.estimator import TorchEstimator
from sparkdl.ml.model import TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
