"""What :func:`sparkdl.launch` returns, and the run's record in MLflow."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import DataFrame, SparkSession


@dataclass
class RunResult:
    """What :func:`sparkdl.launch` returns: rank 0's value, the metrics, and where the run kept its files.

    ``attempts`` counts the gangs that formed and ``world_sizes`` gives each one's number of ranks,
    in order: ``[4, 4, 3]`` when the third attempt ran on fewer ranks (``RunConfig.min_workers``).
    ``log_dir`` holds every line each rank printed, a file per rank and attempt (``rank-0.log``,
    ``rank-0.attempt-1.log``), on the driver's disk. ``skipped_checkpoints`` names each checkpoint
    a restore skipped because it did not match its commit record (torn, truncated, shards
    missing), and why: ``{"attempt": 2, "rank": 0, "checkpoint": 5, "reason": "..."}``; the run
    resumed from an older one.

    Example::

        result = sparkdl.launch(train, ds, num_workers=4)
        result.metrics.groupby("epoch")["loss"].mean()
        result.plot("loss")
    """

    value: Any
    run_id: str
    run_dir: str
    checkpoint_dir: str
    attempts: int
    world_sizes: list[int] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list, repr=False)
    metrics_path: str | None = None
    log_dir: str | None = None
    skipped_checkpoints: list[dict[str, Any]] = field(default_factory=list)

    @property
    def metrics(self) -> pd.DataFrame:
        """Every record as a pandas DataFrame, with the columns ``rank``, ``attempt``, ``time``, ``step`` and the metric keys."""
        import pandas as pd

        frame = pd.DataFrame.from_records(self.records)
        for col in ("rank", "attempt", "time", "step"):
            if col not in frame.columns:
                frame[col] = pd.Series(dtype="float64")
        return frame

    def metrics_spark(self, spark: SparkSession) -> DataFrame:
        """The metrics as a Spark DataFrame."""
        return spark.createDataFrame(self.metrics)

    def plot(self, *keys: str, x: str = "step", rank: int | None = 0) -> Any:
        """Plots metrics ``keys`` (default: every numeric metric) against ``x``; returns the matplotlib Axes."""
        import matplotlib.pyplot as plt

        frame = self.metrics
        if rank is not None:
            frame = frame[frame["rank"] == rank]
        skip = {"rank", "attempt", "time", x}
        if not keys:
            keys = tuple(c for c in frame.columns if c not in skip and frame[c].dtype.kind in "if")
        _, ax = plt.subplots()
        for key in keys:
            data = frame[[x, key]].dropna()
            ax.plot(data[x], data[key], label=key)
        ax.set_xlabel(x)
        ax.legend()
        return ax


def log_to_mlflow(result: RunResult, *, num_workers: int, backend: str, succeeded: bool) -> None:
    """Logs a run to MLflow: its settings, rank 0's metrics by step, the metrics file, the model.

    It logs into the active MLflow run when there is one (so a notebook's own run collects it),
    else into a new run named ``sparkdl-<run id>``. The final model is rank 0's return value
    when that is a ``torch.nn.Module`` or a state_dict, saved with ``torch.save`` under
    ``model/``.
    """
    import os
    import tempfile

    import mlflow

    own_run = mlflow.active_run() is None
    if own_run:
        mlflow.start_run(run_name=f"sparkdl-{result.run_id}")
    try:
        mlflow.log_params({
            "sparkdl.run_id": result.run_id,
            "sparkdl.num_workers": num_workers,
            "sparkdl.backend": backend,
            "sparkdl.attempts": result.attempts,
            "sparkdl.world_sizes": ",".join(map(str, result.world_sizes)),
            "sparkdl.succeeded": succeeded,
        })
        skip = {"rank", "attempt", "time", "step"}
        for index, record in enumerate(r for r in result.records if r.get("rank") == 0):
            values = {
                k: float(v) for k, v in record.items()
                if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            if values:
                mlflow.log_metrics(values, step=int(record.get("step", index)))
        if result.metrics_path and os.path.exists(result.metrics_path):
            mlflow.log_artifact(result.metrics_path, "sparkdl")
        if succeeded and _is_model(result.value):
            import torch

            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "model.pt")
                torch.save(result.value, path)
                mlflow.log_artifact(path, "model")
    finally:
        if own_run:
            mlflow.end_run(status="FINISHED" if succeeded else "FAILED")


def _is_model(value: Any) -> bool:
    try:
        import torch
    except ImportError:
        return False
    if isinstance(value, torch.nn.Module):
        return True
    return isinstance(value, dict) and bool(value) and all(isinstance(v, torch.Tensor) for v in value.values())
