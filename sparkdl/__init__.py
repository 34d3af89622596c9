"""sparkdl: distributed PyTorch training and inference inside Apache Spark."""

from typing import TYPE_CHECKING, Any

from sparkdl._internal.ckpt.store import CheckpointStore
from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import (
    BackendUnavailableError,
    ConfigError,
    DatasetError,
    InsufficientSlotsError,
    NotInRunError,
    RunFailedError,
    RunTimeoutError,
    SparkDLError,
    TrialPruned,
)
from sparkdl._internal.data.decoding.images import ImageDecoder
from sparkdl._internal.driver.result import RunResult
from sparkdl._internal.driver.run import launch, run
from sparkdl._internal.rank.context import RunContext, context
from sparkdl._internal.train.keras import keras_checkpoint, keras_resume
from sparkdl._internal.train.state import TrainState
from sparkdl._internal.tune.search import tune
from sparkdl._version import __version__ as __version__
from sparkdl.compat import HorovodRunner, TorchDistributor
from sparkdl.data import Dataset, write_dataset

if TYPE_CHECKING:
    from sparkdl.ml import TorchEstimator, TorchModel

__all__ = [
    "BackendUnavailableError",
    "CheckpointStore",
    "ConfigError",
    "Dataset",
    "DatasetError",
    "HorovodRunner",
    "ImageDecoder",
    "InsufficientSlotsError",
    "NotInRunError",
    "RunConfig",
    "RunContext",
    "RunFailedError",
    "RunResult",
    "RunTimeoutError",
    "SparkDLError",
    "TorchDistributor",
    "TorchEstimator",
    "TorchModel",
    "TrainState",
    "TrialPruned",
    "context",
    "keras_checkpoint",
    "keras_resume",
    "launch",
    "run",
    "tune",
    "write_dataset",
]

# The Spark ML classes subclass pyspark.ml's, so importing them imports pyspark; they load on
# first use, which keeps ``import sparkdl`` light (and free of pyspark and torch).
_LAZY = {"TorchEstimator": "sparkdl.ml", "TorchModel": "sparkdl.ml"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sparkdl' has no attribute {name!r}")
