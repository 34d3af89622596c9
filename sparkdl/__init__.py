"""sparkdl: distributed PyTorch training and inference inside Apache Spark."""

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
    "TrainState",
    "context",
    "launch",
    "run",
    "write_dataset",
]
__version__ = "0.1.0"
