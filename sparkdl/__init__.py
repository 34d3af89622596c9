"""sparkdl: distributed PyTorch training and inference inside Apache Spark."""

from typing import TYPE_CHECKING, Any

from sparkdl.checkpoint import CheckpointStore, TrainState
from sparkdl.compat import HorovodRunner, TorchDistributor
from sparkdl.config import RunConfig
from sparkdl.context import RunContext, context
from sparkdl.dataset import Dataset, write_dataset
from sparkdl.errors import (
    BackendUnavailableError,
    ConfigError,
    DatasetError,
    InsufficientSlotsError,
    NotInRunError,
    RunFailedError,
    RunTimeoutError,
    SparkDLError,
)
from sparkdl.launch import launch, run
from sparkdl.metrics import RunResult

if TYPE_CHECKING:
    from sparkdl.ml import TorchEstimator, TorchModel

__all__ = [
    "BackendUnavailableError",
    "CheckpointStore",
    "ConfigError",
    "Dataset",
    "DatasetError",
    "HorovodRunner",
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
    "context",
    "launch",
    "run",
    "write_dataset",
]
__version__ = "0.1.0"

# The Spark ML classes subclass pyspark.ml's, so importing them imports pyspark; they load on
# first use, which keeps ``import sparkdl`` light (and free of pyspark and torch).
_LAZY = {"TorchEstimator": "sparkdl.ml", "TorchModel": "sparkdl.ml"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sparkdl' has no attribute {name!r}")
