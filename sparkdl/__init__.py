"""sparkdl: distributed PyTorch training and inference inside Apache Spark."""

from sparkdl.config import RunConfig
from sparkdl.context import RunContext, context
from sparkdl.errors import (
    BackendUnavailableError,
    ConfigError,
    InsufficientSlotsError,
    NotInRunError,
    RunFailedError,
    RunTimeoutError,
    SparkDLError,
)
from sparkdl.launch import run

__all__ = [
    "BackendUnavailableError",
    "ConfigError",
    "InsufficientSlotsError",
    "NotInRunError",
    "RunConfig",
    "RunContext",
    "RunFailedError",
    "RunTimeoutError",
    "SparkDLError",
    "context",
    "run",
]
__version__ = "0.1.0"
