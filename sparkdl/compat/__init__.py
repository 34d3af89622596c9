"""Drop-in replacements for Databricks' ``HorovodRunner``, Spark's ``TorchDistributor`` and
spark-tensorflow-distributor's ``MirroredStrategyRunner``.

Change one import and existing code runs on sparkdl, with gang rerun, live rank-tagged logs,
time bounds and the failure report::

    # from sparkdl import HorovodRunner          (was: from sparkdl import HorovodRunner)
    # from sparkdl import TorchDistributor       (was: from pyspark.ml.torch.distributor import TorchDistributor)

The drop-ins refuse what the originals refuse, with exceptions of the same built-in types, at the
same point: a bad setting or Spark conf at construction, arguments a script cannot take at ``run``.
Petastorm's converter has its own drop-in, :mod:`sparkdl.compat.petastorm`.
"""

from sparkdl._internal.compat.drop_ins import TorchDistributor
from sparkdl._internal.compat.gpus import GpuConfigError
from sparkdl._internal.compat.horovod_runner import HorovodRunner
from sparkdl._internal.compat.tf_distributor import MirroredStrategyRunner

__all__ = ["GpuConfigError", "HorovodRunner", "MirroredStrategyRunner", "TorchDistributor"]
