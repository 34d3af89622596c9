"""Spark ML integration: :class:`TorchEstimator` trains a PyTorch model as one stage of a Pipeline,
and :class:`TorchModel` scores DataFrames with it, vectorized over Arrow batches.

The path of ``fit(df)``:

1. **Validate** on the driver, before anything is written or trained: the columns exist and have
   usable types (one schema pass, no job); the features have one length and no null or NaN, and
   the labels suit the loss (one aggregation job); the model accepts a few real rows and its
   output matches the labels and the loss (one ``limit`` job, the model run on the driver).
2. **Write** the features (``array<float>``) and labels with :func:`sparkdl.write_dataset`,
   holding out ``validationFraction`` of the rows (``randomSplit`` with the seed).
3. **Train** with :func:`sparkdl.run`: DDP on ``numWorkers`` gang-scheduled ranks, the loop driven
   by :class:`sparkdl.TrainState`, so a failed rank reruns the gang and training resumes from the
   last checkpoint, history included. Rank 0 prints one line per epoch (relayed to the driver),
   and every epoch's metrics are reduced over all ranks with ``all_reduce``.
4. **Return** a :class:`TorchModel` holding the trained module (cloudpickled, CPU) and the history.

Scoring (``TorchModel.transform``) adds one column computed by an iterator UDF over Arrow batches
(``arrow_udf`` on pyspark >= 4.1, ``pandas_udf`` before): the model runs on whole batches of up to
``inferenceBatchSize`` rows, never on one row at a time. Only the features column travels to
Python and only the prediction comes back; every other column stays in the JVM. The model's bytes
reach the executors once, as a Spark broadcast; each Python worker unpickles them the first time
it scores with that model and keeps the module in a small per-process cache keyed by the model's
content hash and device, so later batches, tasks and jobs served by the same (reused) worker skip
the load. The module runs on the GPU Spark assigned to the task, when there is one.

Persistence goes through Spark ML's ``MLWriter``/``MLReader`` (``save``/``load``, and inside a
saved ``Pipeline``/``PipelineModel``): JSON-able params go to the usual ``metadata`` file;
values that are not JSON (a module, a model factory, an optimizer factory, a loss function) and
the trained module are cloudpickled into ``data/`` (Parquet, written and read by Spark, so any
filesystem Spark reaches works). Loading unpickles: load only models you trust.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark import keyword_only
from pyspark.ml.base import Estimator, Model
from pyspark.ml.param import Param, Params
from pyspark.ml.param.shared import HasFeaturesCol, HasLabelCol, HasPredictionCol, HasSeed
from pyspark.ml.util import (
    DefaultParamsReader,
    DefaultParamsWriter,
    MLReadable,
    MLReader,
    MLWritable,
    MLWriter,
)

from sparkdl.config import RunConfig
from sparkdl.errors import ConfigError, SparkDLError

if TYPE_CHECKING:
    import torch
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.types import DataType

    from sparkdl.dataset import Dataset

__all__ = ["TorchEstimator", "TorchModel"]

CLASSIFICATION = "classification"
REGRESSION = "regression"
_TASKS = (CLASSIFICATION, REGRESSION)

# Named losses: the task each implies and how labels must look.
_CLASS_LOSSES = ("cross_entropy", "nll")  # integer class indices in [0, C); output (N, C)
_BINARY_LOSSES = ("bce_with_logits",)  # labels in [0, 1]; output (N,) or (N, 1), a logit
_REGRESSION_LOSSES = ("mse", "l1", "smooth_l1", "huber")  # output shaped like the label
_LOSSES = _CLASS_LOSSES + _BINARY_LOSSES + _REGRESSION_LOSSES
_OPTIMIZERS = ("adam", "adamw", "sgd")

# Rows of model input probed on the driver before training.
_PROBE_ROWS = 4
# Saved blobs are cut into Parquet rows of this size.
_BLOB_CHUNK = 16 * 1024 * 1024
_FORMAT = 1
# Modules kept per Python worker; more than one model is rare, and each may be large.
_WORKER_CACHE_SIZE = 2


# --------------------------------------------------------------------------------------------
# Param converters: they normalize a value and refuse a bad one, naming the param
# --------------------------------------------------------------------------------------------


def _int_at_least(name: str, minimum: int) -> Callable[[Any], int]:
    def convert(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < minimum:
            raise ConfigError(f"{name} must be an integer >= {minimum}; got {value!r}")
        return int(value)

    return convert


def _fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ConfigError(f"validationFraction must be a number in [0, 1); got {value!r}")
    return float(value)


def _positive_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"learningRate must be a positive number; got {value!r}")
    return float(value)


def _optional_bool(value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise ConfigError(f"useGpu must be True, False or None (use the task's GPU when Spark assigns one); got {value!r}")


def _optional_str(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if not isinstance(value, str):
        raise ConfigError(f"expected a string (a path or URL) or None; got {value!r}")
    return value


def _task(value: Any) -> str | None:
    if value is None or value in _TASKS:
        return cast("str | None", value)
    raise ConfigError(f"task must be 'classification', 'regression' or None (inferred from the loss); got {value!r}")


def _loss(value: Any) -> Any:
    if isinstance(value, str):
        if value not in _LOSSES:
            raise ConfigError(
                f"loss={value!r} is not a known loss name; choose one of {', '.join(map(repr, _LOSSES))}, "
                "or pass a callable (output, label) -> scalar tensor"
            )
        return value
    if callable(value):
        return value
    raise ConfigError(f"loss must be a loss name or a callable (output, label) -> scalar tensor; got {value!r}")


def _optimizer(value: Any) -> Any:
    if isinstance(value, str):
        if value not in _OPTIMIZERS:
            raise ConfigError(
                f"optimizer={value!r} is not a known optimizer name; choose one of "
                f"{', '.join(map(repr, _OPTIMIZERS))} (with learningRate), or pass a factory such as "
                "lambda params: torch.optim.Adam(params, lr=1e-3)"
            )
        return value
    if callable(value):
        return value
    raise ConfigError(f"optimizer must be a name or a callable params -> torch.optim.Optimizer; got {value!r}")


def _model(value: Any) -> Any:
    if callable(value):  # an nn.Module is callable too
        return value
    raise ConfigError(
        f"model must be a torch.nn.Module or a zero-argument function that returns one; got {type(value).__name__}"
    )


def _backend(value: Any) -> str:
    if value == "torch":
        return "torch"
    raise ConfigError(
        f"backend={value!r}: TorchEstimator trains with backend='torch' (DDP) only. Its resumable loop "
        "(sparkdl.TrainState) agrees on checkpoints through torch.distributed, which a Horovod run does "
        "not initialize; for Horovod, call sparkdl.run(fn, backend='horovod') with your own loop"
    )


def _run_config(value: Any) -> RunConfig | None:
    if value is None or isinstance(value, RunConfig):
        return value
    if isinstance(value, Mapping):  # how a saved estimator stores it
        return RunConfig(**dict(value))
    raise ConfigError(f"runConfig must be a sparkdl.RunConfig or None; got {type(value).__name__}")


# --------------------------------------------------------------------------------------------
# Params
# --------------------------------------------------------------------------------------------


class _ScoringParams(HasFeaturesCol, HasPredictionCol):
    """Params shared by the estimator and the model: what scoring needs."""

    _input_kwargs: dict[str, Any]  # set by pyspark's keyword_only

    task: Param[Any] = Param(
        Params._dummy(),
        "task",
        "'classification' (prediction: the argmax class, or logit > 0 for a single output) or "
        "'regression' (prediction: the model's output); None: inferred from the loss",
        typeConverter=_task,
    )
    inferenceBatchSize: Param[int] = Param(
        Params._dummy(),
        "inferenceBatchSize",
        "rows the model scores at once in transform (bounds memory per call)",
        typeConverter=_int_at_least("inferenceBatchSize", 1),
    )
    useGpu: Param[Any] = Param(
        Params._dummy(),
        "useGpu",
        "run on the GPU Spark assigns to each task; None: when spark.task.resource.gpu.amount is set",
        typeConverter=_optional_bool,
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(
            featuresCol="features", predictionCol="prediction", task=None, inferenceBatchSize=1024, useGpu=None
        )

    def getTask(self) -> str | None:
        """The task: ``'classification'``, ``'regression'`` or None (inferred from the loss)."""
        return cast("str | None", self.getOrDefault(self.task))

    def getInferenceBatchSize(self) -> int:
        """Rows scored per model call in ``transform``."""
        return self.getOrDefault(self.inferenceBatchSize)

    def getUseGpu(self) -> bool | None:
        """Whether to use the task's GPU (None: when Spark assigns one)."""
        return cast("bool | None", self.getOrDefault(self.useGpu))

    def setFeaturesCol(self, value: str) -> Any:
        """Sets the features column (a Spark ML vector or an array of numbers)."""
        return self._set(featuresCol=value)

    def setPredictionCol(self, value: str) -> Any:
        """Sets the name of the column ``transform`` adds."""
        return self._set(predictionCol=value)

    def setTask(self, value: str | None) -> Any:
        """Sets the task, ``'classification'`` or ``'regression'``."""
        return self._set(task=value)

    def setInferenceBatchSize(self, value: int) -> Any:
        """Sets the rows scored per model call in ``transform``."""
        return self._set(inferenceBatchSize=value)

    def setUseGpu(self, value: bool | None) -> Any:
        """Sets whether to use the task's GPU."""
        return self._set(useGpu=value)


class _EstimatorParams(_ScoringParams, HasLabelCol, HasSeed):
    model: Param[Any] = Param(
        Params._dummy(), "model", "a torch.nn.Module, or a zero-argument function that returns one", typeConverter=_model
    )
    optimizer: Param[Any] = Param(
        Params._dummy(),
        "optimizer",
        "'adam', 'adamw', 'sgd' (momentum 0.9), with learningRate; or a function params -> torch.optim.Optimizer",
        typeConverter=_optimizer,
    )
    learningRate: Param[float] = Param(
        Params._dummy(), "learningRate", "learning rate of a named optimizer", typeConverter=_positive_float
    )
    loss: Param[Any] = Param(
        Params._dummy(),
        "loss",
        f"one of {', '.join(_LOSSES)}, or a function (output, label) -> scalar tensor",
        typeConverter=_loss,
    )
    batchSize: Param[int] = Param(
        Params._dummy(), "batchSize", "rows per batch on each worker", typeConverter=_int_at_least("batchSize", 1)
    )
    epochs: Param[int] = Param(
        Params._dummy(), "epochs", "passes over the training rows", typeConverter=_int_at_least("epochs", 1)
    )
    numWorkers: Param[int] = Param(
        Params._dummy(), "numWorkers", "ranks (Spark task slots) to train on", typeConverter=_int_at_least("numWorkers", 1)
    )
    backend: Param[str] = Param(Params._dummy(), "backend", "distributed backend: 'torch'", typeConverter=_backend)
    checkpointDir: Param[Any] = Param(
        Params._dummy(),
        "checkpointDir",
        "where checkpoints go (shared by all executors); a fit given a directory with checkpoints of "
        "an earlier fit of the same data resumes it. None: a new directory per fit",
        typeConverter=_optional_str,
    )
    checkpointEvery: Param[int] = Param(
        Params._dummy(),
        "checkpointEvery",
        "also checkpoint every this many steps (0: only at the end of each epoch)",
        typeConverter=_int_at_least("checkpointEvery", 0),
    )
    validationFraction: Param[float] = Param(
        Params._dummy(),
        "validationFraction",
        "fraction of the rows held out to compute validation metrics after every epoch",
        typeConverter=_fraction,
    )
    runConfig: Param[Any] = Param(
        Params._dummy(), "runConfig", "bounds of the training run (sparkdl.RunConfig)", typeConverter=_run_config
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(
            labelCol="label",
            seed=0,
            optimizer="adam",
            learningRate=1e-3,
            loss="cross_entropy",
            batchSize=32,
            epochs=10,
            numWorkers=1,
            backend="torch",
            checkpointDir=None,
            checkpointEvery=0,
            validationFraction=0.0,
            runConfig=None,
        )


# --------------------------------------------------------------------------------------------
# Persistence shared by the estimator and the model
# --------------------------------------------------------------------------------------------

_JSON_SCALARS = (str, int, float, bool, type(None))


class _Persistable(Params):
    """Splits param values into JSON ones (``metadata``) and pickled ones (``data/``)."""

    def _json_and_pickled(self) -> tuple[dict[str, Any], dict[str, Any]]:
        json_params: dict[str, Any] = {}
        pickled: dict[str, Any] = {}
        for param, value in self._paramMap.items():
            if isinstance(value, RunConfig):
                json_params[param.name] = value.to_dict()
            elif isinstance(value, _JSON_SCALARS):
                json_params[param.name] = value
            else:
                pickled[param.name] = value
        return json_params, pickled

    def _extra_state(self) -> tuple[dict[str, Any], dict[str, bytes]]:
        """Metadata and blobs of the instance beyond its params."""
        return {}, {}

    def _set_extra_state(self, meta: Mapping[str, Any], blobs: Mapping[str, bytes]) -> None:
        """Restores what :meth:`_extra_state` saved."""


class _Writer(MLWriter):
    def __init__(self, instance: _Persistable) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        import cloudpickle

        json_params, pickled = self.instance._json_and_pickled()
        meta, blobs = self.instance._extra_state()
        blobs = dict(blobs)
        if pickled:
            try:
                blobs["params"] = cloudpickle.dumps(pickled, protocol=5)
            except Exception as exc:
                raise ConfigError(
                    f"the params {sorted(pickled)} of {self.instance.uid} cannot be pickled for saving "
                    f"({type(exc).__name__}: {exc}); they must not hold a SparkSession, lock or open file"
                ) from exc
        extra = {"sparkdl": {"format": _FORMAT, **meta, "blobs": sorted(blobs)}}
        # A SparkContext: pyspark 3.5 takes only that here; pyspark 4 takes it or a session.
        DefaultParamsWriter.saveMetadata(
            self.instance, path, self.sparkSession.sparkContext, extraMetadata=extra, paramMap=json_params
        )
        if blobs:
            _write_blobs(self.sparkSession, os.path.join(path, "data"), blobs)


class _Reader(MLReader[Any]):
    def __init__(self, cls: type[_Persistable]) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        import cloudpickle

        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession.sparkContext)
        saved = metadata.get("sparkdl") or {}
        expected = f"{self.cls.__module__}.{self.cls.__name__}"
        if metadata.get("class") != expected:
            raise SparkDLError(
                f"{path} holds a {metadata.get('class')}, not a {expected}; load it with that class "
                "(or with PipelineModel.load / Pipeline.load for a saved pipeline)"
            )
        if saved.get("format") != _FORMAT:
            raise SparkDLError(
                f"{path} holds a {metadata.get('class')} saved in format {saved.get('format')!r}; this "
                f"sparkdl reads format {_FORMAT}. Load it with the sparkdl version that saved it"
            )
        instance: Any = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        names = list(saved.get("blobs") or [])
        blobs = _read_blobs(self.sparkSession, os.path.join(path, "data"), names) if names else {}
        if "params" in blobs:
            instance._set(**cloudpickle.loads(blobs["params"]))
        instance._set_extra_state(saved, blobs)
        return instance


def _write_blobs(spark: SparkSession, path: str, blobs: Mapping[str, bytes]) -> None:
    rows = [
        (name, i, bytearray(data[start : start + _BLOB_CHUNK]))
        for name, data in sorted(blobs.items())
        for i, start in enumerate(range(0, max(len(data), 1), _BLOB_CHUNK))
    ]
    # Spark writes it, so the model goes wherever the metadata goes (HDFS, S3, ...).
    spark.createDataFrame(rows, "name string, chunk int, data binary").coalesce(1).write.parquet(path)


def _read_blobs(spark: SparkSession, path: str, names: Sequence[str]) -> dict[str, bytes]:
    pieces: dict[str, list[tuple[int, bytes]]] = {name: [] for name in names}
    for row in spark.read.parquet(path).collect():
        pieces.setdefault(row["name"], []).append((int(row["chunk"]), bytes(row["data"])))
    missing = [n for n in names if not pieces.get(n)]
    if missing:
        raise SparkDLError(f"{path} lacks the saved part(s) {missing}; the saved model is incomplete")
    return {name: b"".join(data for _, data in sorted(parts)) for name, parts in pieces.items()}


# --------------------------------------------------------------------------------------------
# TorchEstimator
# --------------------------------------------------------------------------------------------


class TorchEstimator(Estimator["TorchModel"], _EstimatorParams, _Persistable, MLWritable, MLReadable["TorchEstimator"]):
    """A Spark ML Estimator that trains a PyTorch model with DDP on ``numWorkers`` Spark tasks.

    Features come from ``featuresCol`` (a Spark ML vector, e.g. a VectorAssembler's output, or an
    array of numbers, every row of the same length); labels from ``labelCol``. ``fit`` validates
    the data and the model first (see the module docstring), writes the data with
    :func:`sparkdl.write_dataset`, trains with :func:`sparkdl.run` (the gang reruns and resumes
    from the last checkpoint when a rank fails), and returns a :class:`TorchModel`.

    Example::

        from pyspark.ml import Pipeline
        from pyspark.ml.feature import StandardScaler, VectorAssembler

        est = sparkdl.TorchEstimator(
            model=lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)),
            optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
            loss="cross_entropy", featuresCol="scaled", labelCol="label",
            batchSize=32, epochs=10, numWorkers=2, validationFraction=0.1,
        )
        pipeline = Pipeline(stages=[VectorAssembler(inputCols=pixels, outputCol="raw"),
                                    StandardScaler(inputCol="raw", outputCol="scaled"), est])
        model = pipeline.fit(train_df)
        model.transform(test_df).select("label", "prediction")
        model.stages[-1].history        # [{"epoch": 1, "train_loss": ..., "val_loss": ..., ...}, ...]

    Params (all also ``getX``/``setX``):
        model: a ``torch.nn.Module`` (its initial weights are used) or a zero-argument factory.
            The module's class must be importable where the executors run, or defined in the
            driver's ``__main__``/notebook (then it travels by value).
        optimizer: ``"adam"`` (default), ``"adamw"`` or ``"sgd"`` (momentum 0.9), with
            ``learningRate`` (default 1e-3); or a factory ``params -> torch.optim.Optimizer``.
        loss: ``"cross_entropy"`` (default) or ``"nll"`` (labels: class indices 0..C-1, output
            ``(N, C)``), ``"bce_with_logits"`` (labels in [0, 1], output ``(N,)`` or ``(N, 1)``),
            ``"mse"``, ``"l1"``, ``"smooth_l1"``, ``"huber"`` (output shaped like the label: one
            value per row for a scalar label, ``(N, L)`` for an array or vector label of length
            L); or a callable ``(output, label) -> scalar tensor`` (labels are then float
            tensors, or int64 with ``task="classification"``).
        task: ``"classification"`` or ``"regression"``; inferred from a named loss, and
            ``"regression"`` (raw outputs) for a callable one unless set.
        featuresCol, labelCol, predictionCol: column names (``"features"``, ``"label"``, ``"prediction"``).
        batchSize (32): rows per batch on each worker. The last partial batch of each epoch is
            dropped, unless the data is smaller than one batch per worker.
        epochs (10), numWorkers (1), seed (0: model initialisation, the shuffle and the split).
        backend ("torch"), useGpu (None: the task's GPU when ``spark.task.resource.gpu.amount``
            is set), runConfig (a :class:`sparkdl.RunConfig`: the run's bounds).
        checkpointDir (None: a new directory per fit under ``spark.sparkdl.runDir``) and
            checkpointEvery (0: checkpoint at the end of each epoch only; N: also every N steps).
        validationFraction (0.0): rows held out; with it, every epoch records ``val_loss`` (and
            ``val_accuracy`` for classification).
        inferenceBatchSize (1024): rows per model call in ``transform``.
    """

    @keyword_only
    def __init__(
        self,
        *,
        model: Any = None,
        featuresCol: str = "features",
        labelCol: str = "label",
        predictionCol: str = "prediction",
        optimizer: Any = "adam",
        learningRate: float = 1e-3,
        loss: Any = "cross_entropy",
        task: str | None = None,
        batchSize: int = 32,
        epochs: int = 10,
        numWorkers: int = 1,
        backend: str = "torch",
        useGpu: bool | None = None,
        seed: int = 0,
        checkpointDir: str | None = None,
        checkpointEvery: int = 0,
        validationFraction: float = 0.0,
        inferenceBatchSize: int = 1024,
        runConfig: RunConfig | None = None,
    ) -> None:
        super().__init__()
        self._set(**self._input_kwargs)

    @keyword_only
    def setParams(
        self,
        *,
        model: Any = None,
        featuresCol: str = "features",
        labelCol: str = "label",
        predictionCol: str = "prediction",
        optimizer: Any = "adam",
        learningRate: float = 1e-3,
        loss: Any = "cross_entropy",
        task: str | None = None,
        batchSize: int = 32,
        epochs: int = 10,
        numWorkers: int = 1,
        backend: str = "torch",
        useGpu: bool | None = None,
        seed: int = 0,
        checkpointDir: str | None = None,
        checkpointEvery: int = 0,
        validationFraction: float = 0.0,
        inferenceBatchSize: int = 1024,
        runConfig: RunConfig | None = None,
    ) -> TorchEstimator:
        """Sets the params given by keyword; returns the estimator."""
        return self._set(**self._input_kwargs)

    # -- getters and setters, Spark ML style -------------------------------------------------

    def getModel(self) -> Any:
        """The module or factory to train."""
        return self.getOrDefault(self.model)

    def setModel(self, value: Any) -> TorchEstimator:
        return self._set(model=value)

    def getOptimizer(self) -> Any:
        return self.getOrDefault(self.optimizer)

    def setOptimizer(self, value: Any) -> TorchEstimator:
        return self._set(optimizer=value)

    def getLearningRate(self) -> float:
        return self.getOrDefault(self.learningRate)

    def setLearningRate(self, value: float) -> TorchEstimator:
        return self._set(learningRate=value)

    def getLoss(self) -> Any:
        return self.getOrDefault(self.loss)

    def setLoss(self, value: Any) -> TorchEstimator:
        return self._set(loss=value)

    def getBatchSize(self) -> int:
        return self.getOrDefault(self.batchSize)

    def setBatchSize(self, value: int) -> TorchEstimator:
        return self._set(batchSize=value)

    def getEpochs(self) -> int:
        return self.getOrDefault(self.epochs)

    def setEpochs(self, value: int) -> TorchEstimator:
        return self._set(epochs=value)

    def getNumWorkers(self) -> int:
        return self.getOrDefault(self.numWorkers)

    def setNumWorkers(self, value: int) -> TorchEstimator:
        return self._set(numWorkers=value)

    def getBackend(self) -> str:
        return self.getOrDefault(self.backend)

    def setBackend(self, value: str) -> TorchEstimator:
        return self._set(backend=value)

    def getCheckpointDir(self) -> str | None:
        return cast("str | None", self.getOrDefault(self.checkpointDir))

    def setCheckpointDir(self, value: str | None) -> TorchEstimator:
        return self._set(checkpointDir=value)

    def getCheckpointEvery(self) -> int:
        return self.getOrDefault(self.checkpointEvery)

    def setCheckpointEvery(self, value: int) -> TorchEstimator:
        return self._set(checkpointEvery=value)

    def getValidationFraction(self) -> float:
        return self.getOrDefault(self.validationFraction)

    def setValidationFraction(self, value: float) -> TorchEstimator:
        return self._set(validationFraction=value)

    def getRunConfig(self) -> RunConfig | None:
        return cast("RunConfig | None", self.getOrDefault(self.runConfig))

    def setRunConfig(self, value: RunConfig | None) -> TorchEstimator:
        return self._set(runConfig=value)

    def setLabelCol(self, value: str) -> TorchEstimator:
        return self._set(labelCol=value)

    def setSeed(self, value: int) -> TorchEstimator:
        return self._set(seed=value)

    # -- persistence -------------------------------------------------------------------------

    def write(self) -> MLWriter:
        """An MLWriter: JSON params to ``metadata``; model, optimizer and loss callables pickled to ``data/``."""
        return _Writer(self)

    @classmethod
    def read(cls) -> MLReader[TorchEstimator]:
        """An MLReader for estimators saved with :meth:`save`."""
        return _Reader(cls)

    # -- fit ---------------------------------------------------------------------------------

    def _fit(self, dataset: DataFrame) -> TorchModel:
        import torch

        from sparkdl.dataset import write_dataset
        from sparkdl.launch import run

        if not self.isDefined(self.model):
            raise ConfigError(
                "TorchEstimator needs a model: pass model=<torch.nn.Module or zero-argument factory>"
            )
        plan = self._plan()
        facts = _inspect(dataset, plan)
        driver_module, num_outputs = _probe(dataset, plan, facts)

        prepared = dataset.select(
            _features_expr(dataset, plan.features_col).alias("x"), _label_expr(dataset, plan).alias("y")
        )
        session = dataset.sparkSession
        num_files = _num_files(session, plan.num_workers)
        val_ds: Dataset | None = None
        if plan.validation_fraction > 0:
            train_df, val_df = prepared.randomSplit([1.0 - plan.validation_fraction, plan.validation_fraction], plan.seed)
            train_ds = write_dataset(train_df, num_files=num_files)
            val_ds = write_dataset(val_df, num_files=num_files)
        else:
            train_ds = write_dataset(prepared, num_files=num_files)

        result = run(
            _train_on_rank,
            plan,
            train_ds,
            val_ds,
            num_workers=plan.num_workers,
            backend=self.getBackend(),
            use_gpu=self.getUseGpu(),
            config=self.getRunConfig(),
            spark=session,
            checkpoint_dir=self.getCheckpointDir(),
        )
        if not isinstance(result, dict):
            raise SparkDLError("rank 0 returned no trained weights (internal error)")
        driver_module.load_state_dict(result["state_dict"])
        driver_module.to(torch.device("cpu")).eval()
        model = TorchModel(
            model=driver_module,
            featuresCol=plan.features_col,
            predictionCol=self.getPredictionCol(),
            task=plan.task,
            inferenceBatchSize=self.getInferenceBatchSize(),
            useGpu=self.getUseGpu(),
        )
        model._num_features = facts.num_features
        model._num_outputs = num_outputs
        model._history = [dict(h) for h in result["history"]]
        # Like Spark's own models, the model takes the uid of the estimator that made it.
        return model._resetUid(self.uid)

    def _plan(self) -> _FitPlan:
        loss = self.getLoss()
        task = self.getTask()
        if task is None:
            if isinstance(loss, str):
                task = REGRESSION if loss in _REGRESSION_LOSSES else CLASSIFICATION
            else:
                task = REGRESSION
        elif isinstance(loss, str) and (task == CLASSIFICATION) != (loss not in _REGRESSION_LOSSES):
            raise ConfigError(
                f"task={task!r} does not fit loss={loss!r}; leave task unset to infer it from the loss, "
                "or choose a loss for that task"
            )
        features_col, label_col = self.getFeaturesCol(), self.getLabelCol()
        if features_col == label_col:
            raise ConfigError(f"featuresCol and labelCol are both {features_col!r}; they must be different columns")
        _backend(self.getBackend())
        return _FitPlan(
            model=self.getModel(),
            optimizer=self.getOptimizer(),
            learning_rate=self.getLearningRate(),
            loss=loss,
            task=task,
            features_col=features_col,
            label_col=label_col,
            batch_size=self.getBatchSize(),
            epochs=self.getEpochs(),
            num_workers=self.getNumWorkers(),
            seed=self.getSeed(),
            checkpoint_every=self.getCheckpointEvery(),
            validation_fraction=self.getValidationFraction(),
        )


# --------------------------------------------------------------------------------------------
# fit, driver side: the plan, the checks, the probe
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _FitPlan:
    """Everything a rank needs to train: plain values and the user's callables, never a session."""

    model: Any
    optimizer: Any
    learning_rate: float
    loss: Any
    task: str
    features_col: str
    label_col: str
    batch_size: int
    epochs: int
    num_workers: int
    seed: int
    checkpoint_every: int
    validation_fraction: float

    @property
    def loss_name(self) -> str:
        return self.loss if isinstance(self.loss, str) else getattr(self.loss, "__name__", "a callable")


@dataclass(frozen=True)
class _Facts:
    """What the checks learned about the data and the model."""

    num_rows: int
    num_features: int
    label_length: int | None  # None: one number per row; L: an array or vector of length L
    label_max: float | None  # the largest label, for one number per row


def _numeric_types() -> tuple[type, ...]:
    from pyspark.sql import types as T

    return (T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.FloatType, T.DoubleType, T.DecimalType)


def _is_vector(t: DataType) -> bool:
    from pyspark.ml.linalg import VectorUDT
    from pyspark.mllib.linalg import VectorUDT as OldVectorUDT

    return isinstance(t, (VectorUDT, OldVectorUDT))


def _is_numeric_array(t: DataType) -> bool:
    from pyspark.sql import types as T

    return isinstance(t, T.ArrayType) and isinstance(t.elementType, (*_numeric_types(), T.BooleanType))


def _column_type(df: DataFrame, name: str, role: str) -> DataType:
    if name not in df.columns:
        raise ConfigError(
            f"{role}={name!r} is not a column of the DataFrame; its columns are {df.columns}. Set {role} "
            "to an existing column"
        )
    return df.schema[name].dataType


def _features_type_check(df: DataFrame, col: str) -> None:
    t = _column_type(df, col, "featuresCol")
    if not (_is_vector(t) or _is_numeric_array(t)):
        raise ConfigError(
            f"featuresCol={col!r} has type {t.simpleString()}; expected a Spark ML vector (e.g. the "
            "output of VectorAssembler) or an array of numbers, every row of the same length"
        )


def _features_expr(df: DataFrame, col: str) -> Column:
    """The features as ``array<float>``, whatever their column type (already checked)."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    if _is_vector(df.schema[col].dataType):
        return vector_to_array(F.col(col), "float32")
    return F.col(col).cast("array<float>")


def _label_expr(df: DataFrame, plan: _FitPlan) -> Column:
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    t = df.schema[plan.label_col].dataType
    col = F.col(plan.label_col)
    if _is_vector(t):
        return vector_to_array(col, "float32")
    if _is_numeric_array(t):
        return col.cast("array<float>")
    if plan.task == CLASSIFICATION and plan.loss not in _BINARY_LOSSES:
        return col.cast("long")
    return col.cast("float")


def _inspect(df: DataFrame, plan: _FitPlan) -> _Facts:
    """Checks the columns' types (no job), then their values in one aggregation job."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    _features_type_check(df, plan.features_col)
    lt = _column_type(df, plan.label_col, "labelCol")
    label_is_array = _is_vector(lt) or _is_numeric_array(lt)
    scalar_ok = isinstance(lt, (*_numeric_types(), T.BooleanType))
    lc = plan.label_col
    if plan.task == CLASSIFICATION and not scalar_ok:
        raise ConfigError(
            f"labelCol={lc!r} has type {lt.simpleString()}; loss {plan.loss_name!r} ({plan.task}) expects one "
            "number per row: a class index 0..C-1 (index string labels with StringIndexer)"
        )
    if not (scalar_ok or label_is_array):
        raise ConfigError(
            f"labelCol={lc!r} has type {lt.simpleString()}; loss {plan.loss_name!r} expects a number per row, "
            "or an array or vector of numbers of one length"
        )

    x = _features_expr(df, plan.features_col)
    bad_value = F.exists(x, lambda v: v.isNull() | F.isnan(v))
    aggs = [
        F.count(F.lit(1)).alias("n"),
        F.sum(F.when(F.col(plan.features_col).isNull(), 1).otherwise(0)).alias("x_null"),
        F.min(F.when(x.isNotNull(), F.size(x))).alias("x_min"),
        F.max(F.when(x.isNotNull(), F.size(x))).alias("x_max"),
        F.sum(F.when(bad_value, 1).otherwise(0)).alias("x_bad"),
        F.sum(F.when(F.col(lc).isNull(), 1).otherwise(0)).alias("y_null"),
    ]
    if label_is_array:
        y = _label_expr(df, plan)
        aggs += [
            F.min(F.when(y.isNotNull(), F.size(y))).alias("y_min"),
            F.max(F.when(y.isNotNull(), F.size(y))).alias("y_max"),
            F.sum(F.when(F.exists(y, lambda v: v.isNull() | F.isnan(v)), 1).otherwise(0)).alias("y_bad"),
        ]
    else:
        y = F.col(lc).cast("double")
        aggs += [
            F.min(y).alias("y_min"),
            F.max(y).alias("y_max"),
            F.sum(F.when(F.isnan(y), 1).otherwise(0)).alias("y_bad"),
            F.sum(F.when(y != F.floor(y), 1).otherwise(0)).alias("y_frac"),
        ]
    s = df.agg(*aggs).first()
    assert s is not None  # an aggregation without grouping always has one row
    n = int(s["n"])
    fc = plan.features_col
    if n == 0:
        raise ConfigError("the DataFrame passed to fit has no rows")
    if s["x_null"]:
        raise ConfigError(f"featuresCol={fc!r} is null in {s['x_null']} of {n} rows; drop or fill those rows first")
    if s["x_min"] != s["x_max"]:
        raise ConfigError(
            f"featuresCol={fc!r} holds rows of different lengths, from {s['x_min']} to {s['x_max']} values; "
            "every row must have the same number of features"
        )
    if s["x_min"] == 0:
        raise ConfigError(f"featuresCol={fc!r} holds empty vectors; every row needs at least one feature")
    if s["x_bad"]:
        raise ConfigError(f"featuresCol={fc!r} holds NaN or null values in {s['x_bad']} of {n} rows; clean them first")
    if s["y_null"] or s["y_bad"]:
        raise ConfigError(
            f"labelCol={lc!r} is null or NaN in {int(s['y_null'] or 0) + int(s['y_bad'] or 0)} of {n} rows; "
            "drop or fill those rows first"
        )
    label_length: int | None = None
    if label_is_array:
        if s["y_min"] != s["y_max"] or not s["y_min"]:
            raise ConfigError(
                f"labelCol={lc!r} holds arrays of lengths {s['y_min']} to {s['y_max']}; every row's label "
                "must have the same, non-zero length"
            )
        label_length = int(s["y_min"])
    elif plan.task == CLASSIFICATION:
        lo, hi = s["y_min"], s["y_max"]
        if plan.loss in _BINARY_LOSSES:
            if lo < 0 or hi > 1:
                raise ConfigError(
                    f"labelCol={lc!r} holds values from {lo:g} to {hi:g}; loss 'bce_with_logits' expects labels "
                    "in [0, 1]"
                )
        elif s["y_frac"] or lo < 0:
            raise ConfigError(
                f"labelCol={lc!r} holds values from {lo:g} to {hi:g}"
                + (f", {s['y_frac']} of them not whole numbers" if s["y_frac"] else "")
                + f"; loss {plan.loss_name!r} expects class indices 0, 1, ..., C-1 (index labels with StringIndexer)"
            )
    n_val = n * plan.validation_fraction
    if plan.validation_fraction > 0 and (n_val < 1 or n - n_val < plan.num_workers):
        raise ConfigError(
            f"validationFraction={plan.validation_fraction:g} of {n} rows leaves too few rows to train on "
            f"{plan.num_workers} workers or to validate on; lower it, or use more data"
        )
    return _Facts(
        num_rows=n,
        num_features=int(s["x_min"]),
        label_length=label_length,
        label_max=None if label_is_array else float(s["y_max"]),
    )


def _instantiate(model: Any, seed: int) -> torch.nn.Module:
    """A fresh module: the factory's product, or a copy of the given module (never the user's object)."""
    import cloudpickle
    import torch

    torch.manual_seed(seed)
    if isinstance(model, torch.nn.Module):
        return cast("torch.nn.Module", cloudpickle.loads(cloudpickle.dumps(model)))
    module = model()
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"the model factory returned {type(module).__name__}; it must return a torch.nn.Module")
    return module


def _input_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype the module computes in: that of its first floating parameter (float32 without one)."""
    import torch

    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _probe(df: DataFrame, plan: _FitPlan, facts: _Facts) -> tuple[torch.nn.Module, int]:
    """Runs the model on a few real rows on the driver; checks its output against labels and loss.

    Returns the driver's instance of the model (the trained weights are loaded into it later)
    and the number of outputs per row.
    """
    import torch

    rows = df.select(
        _features_expr(df, plan.features_col).alias("x"), _label_expr(df, plan).alias("y")
    ).limit(_PROBE_ROWS).collect()
    module = _instantiate(plan.model, plan.seed)
    dtype = _input_dtype(module)
    x = torch.tensor([r["x"] for r in rows], dtype=dtype)
    y = _label_tensor([r["y"] for r in rows], plan, dtype)
    fc, lc = plan.features_col, plan.label_col
    was_training = module.training
    module.eval()  # batch norm and dropout behave on a handful of rows
    try:
        with torch.no_grad():
            out = module(x)
    except Exception as exc:
        raise ConfigError(
            f"the model failed on {len(rows)} rows of featuresCol={fc!r} (input shape {tuple(x.shape)}, "
            f"{facts.num_features} features per row): {type(exc).__name__}: {exc}. Check the model's input size"
        ) from exc
    finally:
        module.train(was_training)
    if not isinstance(out, torch.Tensor):
        raise ConfigError(f"the model returned {type(out).__name__}; it must return one tensor")
    shape = tuple(out.shape)
    k = len(rows)
    width = 1 if len(shape) == 1 else (shape[1] if len(shape) == 2 else -1)
    label_desc = "one number per row" if facts.label_length is None else f"arrays of length {facts.label_length}"
    expected: str | None = None
    if width < 1 or shape[0] != k:
        expected = f"({k},) or ({k}, m): one value or one vector per row"
    elif plan.loss in _BINARY_LOSSES:
        if width != 1:
            expected = f"({k},) or ({k}, 1): one logit per row"
    elif plan.loss in _CLASS_LOSSES:
        if len(shape) != 2 or width < 2:
            expected = f"({k}, C) with C >= 2 class scores per row"
    elif (
        plan.task == REGRESSION
        and isinstance(plan.loss, str)
        and (width != (facts.label_length or 1) or (facts.label_length is not None and len(shape) != 2))
    ):
        expected = (
            f"({k},) or ({k}, 1): one value per row, like the label"
            if facts.label_length is None
            else f"({k}, {facts.label_length}): one vector per row, like the label"
        )
    if expected is not None:
        raise ConfigError(
            f"the model's output for {k} rows of featuresCol={fc!r} has shape {shape}, which does not match "
            f"labelCol={lc!r} ({label_desc}) for loss {plan.loss_name!r}: expected {expected}"
        )
    if plan.task == CLASSIFICATION and facts.label_max is not None:
        classes = max(width, 2)  # one logit scores two classes
        if facts.label_max >= classes:
            raise ConfigError(
                f"labelCol={lc!r} holds class indices up to {facts.label_max:g}, but the model outputs {width} "
                f"score(s) per row, so loss {plan.loss_name!r} accepts class indices 0..{classes - 1}. Give the "
                f"model's last layer {int(facts.label_max) + 1} outputs, or re-index the labels (StringIndexer)"
            )
    loss_fn = _loss_function(plan.loss)
    try:
        value = loss_fn(*_aligned(out, y, plan))
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise TypeError(f"the loss returned {type(value).__name__} {getattr(value, 'shape', '')}, not a scalar tensor")
    except Exception as exc:
        raise ConfigError(
            f"loss {plan.loss_name!r} failed on the model's output (shape {shape}) and labelCol={lc!r} "
            f"(shape {tuple(y.shape)}): {type(exc).__name__}: {exc}"
        ) from exc
    _check_optimizer(plan, module)
    return module, width


def _check_optimizer(plan: _FitPlan, module: torch.nn.Module) -> None:
    import torch

    try:
        opt = _make_optimizer(plan, module.parameters())
    except Exception as exc:
        raise ConfigError(f"the optimizer factory failed on the model's parameters: {type(exc).__name__}: {exc}") from exc
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(
            f"the optimizer factory returned {type(opt).__name__}; it must return a torch.optim.Optimizer, e.g. "
            "lambda params: torch.optim.Adam(params, lr=1e-3)"
        )


def _num_files(session: SparkSession, num_workers: int) -> int:
    # A multiple of the ranks keeps each rank on whole files.
    parallelism = max(1, int(session.sparkContext.defaultParallelism))
    return num_workers * max(1, -(-parallelism // num_workers))


# --------------------------------------------------------------------------------------------
# fit, rank side
# --------------------------------------------------------------------------------------------


def _loss_function(loss: Any) -> Callable[..., torch.Tensor]:
    import torch.nn.functional as F

    if not isinstance(loss, str):
        return cast("Callable[..., torch.Tensor]", loss)
    return cast(
        "Callable[..., torch.Tensor]",
        {
            "cross_entropy": F.cross_entropy,
            "nll": F.nll_loss,
            "bce_with_logits": F.binary_cross_entropy_with_logits,
            "mse": F.mse_loss,
            "l1": F.l1_loss,
            "smooth_l1": F.smooth_l1_loss,
            "huber": F.huber_loss,
        }[loss],
    )


def _label_tensor(values: Sequence[Any], plan: _FitPlan, dtype: torch.dtype) -> torch.Tensor:
    import torch

    if plan.task == CLASSIFICATION and plan.loss not in _BINARY_LOSSES:
        return torch.tensor(values, dtype=torch.int64)
    return torch.tensor(values, dtype=dtype)


def _aligned(out: torch.Tensor, y: torch.Tensor, plan: _FitPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and label as the loss takes them.

    A named loss on one value per row gets both as ``(N,)``: an ``(N, 1)`` output against an
    ``(N,)`` label would otherwise broadcast to ``(N, N)`` in mse and silently train on nonsense.
    A callable loss gets them as they are.
    """
    if isinstance(plan.loss, str) and y.dim() == 1 and out.dim() == 2 and out.shape[1] == 1:
        out = out.squeeze(1)
    return out, y


def _make_optimizer(plan: _FitPlan, params: Any) -> Any:
    import torch

    if not isinstance(plan.optimizer, str):
        return plan.optimizer(params)
    if plan.optimizer == "adam":
        return torch.optim.Adam(params, lr=plan.learning_rate)
    if plan.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=plan.learning_rate)
    return torch.optim.SGD(params, lr=plan.learning_rate, momentum=0.9)


def _correct(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """How many rows of a batch the model classifies right (for the accuracy metric)."""
    if out.dim() == 1 or out.shape[-1] == 1:
        return ((out.reshape(-1) > 0) == (y.reshape(-1) > 0.5)).sum()
    return (out.argmax(dim=-1) == y).sum()


def _train_on_rank(plan: _FitPlan, train_ds: Dataset, val_ds: Dataset | None) -> dict[str, Any] | None:
    """The function every rank runs: DDP over this rank's shard, resumable through TrainState."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sparkdl.checkpoint import TrainState
    from sparkdl.context import context

    ctx = context()
    device = ctx.device
    module = _instantiate(plan.model, plan.seed).to(device)
    dtype = _input_dtype(module)
    # DDP broadcasts rank 0's initial weights, so every replica starts alike even from a factory.
    net = DistributedDataParallel(module) if dist.is_initialized() else module
    optimizer = _make_optimizer(plan, net.parameters())
    loss_fn = _loss_function(plan.loss)
    # Full batches keep every step's gradient on the same number of rows. Only data smaller than
    # one batch per rank keeps its partial batch (the loader then repeats a few rows instead).
    drop_last = train_ds.num_rows >= ctx.world_size * plan.batch_size
    loader = train_ds.loader(plan.batch_size, seed=plan.seed, columns=["x", "y"], drop_last=drop_last, device=device)
    val_loader = (
        val_ds.loader(plan.batch_size, shuffle=False, columns=["x", "y"], device=device) if val_ds is not None else None
    )
    # The history lives in the checkpoint (TrainState.extra), so a rerun resumes it too.
    state = TrainState(module, optimizer, loader, extra={"history": []})
    # Loss sum and row count of this epoch on this rank; an epoch resumed mid-way counts the
    # batches run since the resume.
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    started = time.monotonic()
    for batch in state.batches(epochs=plan.epochs, save_every=plan.checkpoint_every or None):
        x = batch["x"].to(device=device, dtype=dtype)
        y = batch["y"]
        y = y.to(device=device, dtype=dtype) if y.is_floating_point() else y.to(device)
        out, target = _aligned(net(x), y, plan)
        loss = loss_fn(out, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        sums[0] += loss.detach().to(torch.float64) * len(y)
        sums[1] += len(y)
        if loader.step == len(loader):
            # The epoch's last batch: record its metrics now, so that the checkpoint TrainState
            # writes at the end of the epoch (before the next batch) holds them.
            record = _epoch_record(loader.epoch + 1, sums, module, val_loader, loss_fn, plan, device, dtype)
            record["seconds"] = round(time.monotonic() - started, 3)
            state.extra["history"].append(record)
            if ctx.rank == 0:
                print(_format_record(record, plan.epochs), flush=True)
            sums.zero_()
            started = time.monotonic()
    if ctx.rank != 0:
        return None
    return {
        "state_dict": {k: v.detach().cpu() for k, v in module.state_dict().items()},
        "history": list(state.extra["history"]),
    }


def _epoch_record(
    epoch: int,
    sums: torch.Tensor,
    module: torch.nn.Module,
    val_loader: Any,
    loss_fn: Callable[..., torch.Tensor],
    plan: _FitPlan,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """This epoch's metrics, reduced over all ranks (every rank calls it at the same step)."""
    import torch
    import torch.distributed as dist

    totals = torch.zeros(5, dtype=torch.float64, device=device)
    totals[:2] = sums
    if val_loader is not None:
        was_training = module.training
        module.eval()
        with torch.no_grad():
            for batch in val_loader:
                x = batch["x"].to(device=device, dtype=dtype)
                y = batch["y"]
                y = y.to(device=device, dtype=dtype) if y.is_floating_point() else y.to(device)
                out, target = _aligned(module(x), y, plan)
                n = float(len(y))
                totals[2] += float(loss_fn(out, target)) * n
                totals[3] += n
                if plan.task == CLASSIFICATION:
                    totals[4] += float(_correct(out, target))
        module.train(was_training)
    if dist.is_initialized():
        dist.all_reduce(totals)
    t = totals.tolist()
    record: dict[str, Any] = {"epoch": epoch, "train_loss": t[0] / max(t[1], 1.0), "train_rows": int(t[1])}
    if val_loader is not None:
        record["val_loss"] = t[2] / max(t[3], 1.0)
        if plan.task == CLASSIFICATION:
            record["val_accuracy"] = t[4] / max(t[3], 1.0)
    return record


def _format_record(record: Mapping[str, Any], epochs: int) -> str:
    parts = [f"epoch {record['epoch']}/{epochs}", f"train_loss {record['train_loss']:.4f}"]
    if "val_loss" in record:
        parts.append(f"val_loss {record['val_loss']:.4f}")
    if "val_accuracy" in record:
        parts.append(f"val_accuracy {record['val_accuracy']:.4f}")
    parts.append(f"{record.get('seconds', 0.0):.1f} s")
    return ", ".join(parts)


# --------------------------------------------------------------------------------------------
# TorchModel
# --------------------------------------------------------------------------------------------


class TorchModel(Model, _ScoringParams, _Persistable, MLWritable, MLReadable["TorchModel"]):
    """A trained PyTorch model as a Spark ML Model: ``transform`` scores DataFrames on the cluster.

    ``transform(df)`` adds ``predictionCol``:

    - ``task="classification"``: a ``double``, the class with the highest score (argmax of an
      ``(N, C)`` output), or ``1.0``/``0.0`` for a single-logit model (logit > 0);
    - ``task="regression"``: a ``double`` when the model outputs one value per row (``(N,)`` or
      ``(N, 1)``), else an ``array<float>`` of the model's outputs for the row (turn it into an
      ML vector with ``pyspark.ml.functions.array_to_vector`` when needed).

    ``featuresCol`` may hold Spark ML vectors (dense or sparse) or arrays of numbers; only that
    column goes to Python. Scoring runs in an iterator UDF over Arrow batches, up to
    ``inferenceBatchSize`` rows per model call, under ``torch.inference_mode()``. Each executor
    Python worker loads the model once (from a broadcast) and keeps it for later batches, tasks
    and jobs; with ``useGpu`` unset or True it runs on the GPU Spark assigned to the task, when
    there is one (address ``a`` means ``cuda:a``). A null features value, or one of another length
    than the model was trained on, fails the task with an error naming the column.

    A model made by :meth:`TorchEstimator.fit` carries its training history. One can also wrap
    a module trained elsewhere::

        model = sparkdl.TorchModel(model=net, featuresCol="features", task="classification")
        scored = model.transform(df)                 # adds "prediction"
        model.save("hdfs:///models/net")             # or inside a PipelineModel
        same = sparkdl.TorchModel.load("hdfs:///models/net")

    The module is kept cloudpickled (on the CPU); ``getModule()`` gives a copy. For a wrapped
    regression model, the first ``transform`` runs the module on one row on the driver (a
    ``limit(1)`` job) to learn whether the prediction is a number or an array.
    """

    @keyword_only
    def __init__(
        self,
        *,
        model: Any = None,
        featuresCol: str = "features",
        predictionCol: str = "prediction",
        task: str | None = None,
        inferenceBatchSize: int = 1024,
        useGpu: bool | None = None,
    ) -> None:
        super().__init__()
        kwargs = dict(self._input_kwargs)
        module = kwargs.pop("model", None)
        self._set(**kwargs)
        self._module_bytes: bytes | None = None
        self._model_id: str | None = None
        self._num_features: int | None = None
        self._num_outputs: int | None = None
        self._history: list[dict[str, Any]] = []
        self._broadcast: tuple[str, Any] | None = None
        self._lock = threading.Lock()
        if module is not None:
            self._set_module(module)

    def _set_module(self, module: Any) -> None:
        import cloudpickle
        import torch

        if not isinstance(module, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module; got {type(module).__name__}")
        # The module is kept as bytes: they are what the executors get, and their hash names the
        # model in each worker's cache.
        data = cloudpickle.dumps(module, protocol=5)
        self._module_bytes = data
        self._model_id = hashlib.sha256(data).hexdigest()[:24]
        self._broadcast = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_broadcast"] = None  # a driver-side handle of one SparkContext
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- what the model knows ----------------------------------------------------------------

    @property
    def history(self) -> list[dict[str, Any]]:
        """Metrics per epoch of the fit that made this model: a list of dicts, one per epoch.

        Keys: ``epoch`` (1, 2, ...), ``train_loss`` (mean over the epoch's training rows of all
        ranks), ``train_rows``, ``seconds``; with ``validationFraction`` also ``val_loss`` and,
        for classification, ``val_accuracy`` (over all held-out rows; with N ranks, up to N - 1
        of them count twice so that every rank takes the same steps). An epoch that a gang
        rerun resumed mid-way reports the loss of the batches run after the resume. Empty for a
        model wrapped with ``TorchModel(model=...)``.
        """
        return [dict(h) for h in self._history]

    def getHistory(self) -> list[dict[str, Any]]:
        """The same as :attr:`history`."""
        return self.history

    def getModule(self) -> torch.nn.Module:
        """A copy of the trained module, on the CPU, in eval mode."""
        import cloudpickle

        module = cloudpickle.loads(self._require_bytes())
        return cast("torch.nn.Module", module.eval())

    @property
    def numFeatures(self) -> int | None:
        """Features per row the model was trained on (None when unknown: transform then takes any one length)."""
        return self._num_features

    def _require_bytes(self) -> bytes:
        if self._module_bytes is None:
            raise ConfigError("this TorchModel has no module; create it with TorchModel(model=<torch.nn.Module>)")
        return self._module_bytes

    # -- persistence -------------------------------------------------------------------------

    def _extra_state(self) -> tuple[dict[str, Any], dict[str, bytes]]:
        meta = {
            "modelId": self._model_id,
            "numFeatures": self._num_features,
            "numOutputs": self._num_outputs,
            "history": self._history,
        }
        return meta, {"module": self._require_bytes()}

    def _set_extra_state(self, meta: Mapping[str, Any], blobs: Mapping[str, bytes]) -> None:
        self._module_bytes = blobs["module"]
        self._model_id = hashlib.sha256(self._module_bytes).hexdigest()[:24]
        self._num_features = meta.get("numFeatures")
        self._num_outputs = meta.get("numOutputs")
        self._history = [dict(h) for h in meta.get("history") or []]

    def write(self) -> MLWriter:
        """An MLWriter: params and history to ``metadata``, the pickled module to ``data/``."""
        return _Writer(self)

    @classmethod
    def read(cls) -> MLReader[TorchModel]:
        """An MLReader for models saved with :meth:`save` (alone or inside a PipelineModel)."""
        return _Reader(cls)

    # -- transform ---------------------------------------------------------------------------

    def _transform(self, dataset: DataFrame) -> DataFrame:
        from sparkdl.launch import _resolve_gpu

        self._require_bytes()
        features_col, prediction_col = self.getFeaturesCol(), self.getPredictionCol()
        _features_type_check(dataset, features_col)
        if prediction_col in dataset.columns:
            raise ConfigError(
                f"predictionCol={prediction_col!r} is already a column of the DataFrame; choose another "
                "name (setPredictionCol) or drop that column first"
            )
        task = self.getTask() or REGRESSION
        session = dataset.sparkSession
        classic = not type(session).__module__.startswith("pyspark.sql.connect")
        use_gpu = self.getUseGpu()
        if classic and use_gpu:
            _resolve_gpu(session.sparkContext.getConf(), use_gpu)  # ConfigError naming the confs
        num_outputs = self._num_outputs
        if task == REGRESSION and num_outputs is None:
            num_outputs = self._learn_outputs(dataset)
        vector_out = task == REGRESSION and (num_outputs or 1) > 1
        scorer = _Scorer(
            model_id=cast(str, self._model_id),
            source=self._model_source(session) if classic else self._require_bytes(),
            task=task,
            num_features=self._num_features,
            batch_rows=self.getInferenceBatchSize(),
            use_gpu=use_gpu,
            features_col=features_col,
            vector_out=vector_out,
        )
        return dataset.withColumn(prediction_col, _scoring_column(scorer, _features_expr(dataset, features_col)))

    def _model_source(self, session: SparkSession) -> Any:
        """The broadcast of the module's bytes in this SparkContext, made once per model and context."""
        sc = session.sparkContext
        key = f"{sc.applicationId}-{sc.startTime}"
        with self._lock:
            if self._broadcast is None or self._broadcast[0] != key:
                self._broadcast = (key, sc.broadcast(self._require_bytes()))
            return self._broadcast[1]

    def _learn_outputs(self, dataset: DataFrame) -> int:
        """Outputs per row of a wrapped regression model, from one row (a small job), remembered."""
        import torch

        row = dataset.select(_features_expr(dataset, self.getFeaturesCol()).alias("x")).limit(1).collect()
        if not row:
            return 1
        module = self.getModule()
        with torch.inference_mode():
            out = module(torch.tensor([row[0]["x"]], dtype=_input_dtype(module)))
        self._num_outputs = 1 if out.dim() == 1 else int(math.prod(out.shape[1:]))
        return self._num_outputs


# --------------------------------------------------------------------------------------------
# Scoring, executor side
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Scorer:
    """What the scoring UDF closes over: small and picklable; the module itself is in ``source``."""

    model_id: str
    source: Any  # a Broadcast of the pickled module (classic Spark), or the bytes (Spark Connect)
    task: str
    num_features: int | None
    batch_rows: int
    use_gpu: bool | None
    features_col: str
    vector_out: bool

    @property
    def return_type(self) -> str:
        return "array<float>" if self.vector_out else "double"

    def module_bytes(self) -> bytes:
        return self.source if isinstance(self.source, bytes) else cast(bytes, self.source.value)


# (model id, device) -> module, in each executor Python worker. Spark reuses its Python workers
# (spark.python.worker.reuse, on by default), so this outlives a task: a model is unpickled once
# per worker, not once per task or batch. Bounded, least recently used first out.
_WORKER_MODELS: OrderedDict[tuple[str, str], Any] = OrderedDict()
_WORKER_LOCK = threading.Lock()


def _task_device(use_gpu: bool | None) -> torch.device:
    """The GPU Spark assigned to this task (its first address), else the CPU."""
    import torch
    from pyspark import TaskContext

    if use_gpu is False:
        return torch.device("cpu")
    tc = TaskContext.get()
    gpus = tc.resources().get("gpu") if tc is not None else None
    addresses = list(gpus.addresses) if gpus is not None else []
    if addresses and torch.cuda.is_available():
        return torch.device("cuda", int(addresses[0]))
    if use_gpu:
        raise ConfigError(
            f"useGpu=True, but this task got GPU addresses {addresses} and torch.cuda.is_available() is "
            f"{torch.cuda.is_available()}; set spark.task.resource.gpu.amount and install a CUDA build of torch "
            "on the executors, or set useGpu=None"
        )
    return torch.device("cpu")


def _worker_model(scorer: _Scorer) -> tuple[Any, torch.device, torch.dtype]:
    import cloudpickle

    device = _task_device(scorer.use_gpu)
    key = (scorer.model_id, str(device))
    with _WORKER_LOCK:
        module = _WORKER_MODELS.get(key)
        if module is None:
            module = cloudpickle.loads(scorer.module_bytes()).to(device).eval()
            _WORKER_MODELS[key] = module
            while len(_WORKER_MODELS) > _WORKER_CACHE_SIZE:
                _WORKER_MODELS.popitem(last=False)
        else:
            _WORKER_MODELS.move_to_end(key)
    return module, device, _input_dtype(module)


def _features_matrix(arr: pa.Array, scorer: _Scorer) -> np.ndarray:
    """An ``array<float>`` Arrow column as an ``(N, d)`` float32 matrix, or a task error naming the column."""
    n = len(arr)
    col = scorer.features_col
    if arr.null_count:
        raise ConfigError(f"featuresCol={col!r} is null in {arr.null_count} of the {n} rows of a batch; drop or fill them before transform")
    if n == 0:
        return np.zeros((0, scorer.num_features or 0), dtype=np.float32)
    bounds = pc.min_max(pc.list_value_length(arr))
    lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
    d = scorer.num_features if scorer.num_features is not None else lo
    if lo != d or hi != d:
        raise ConfigError(f"featuresCol={col!r} holds rows of {lo} to {hi} values; the model takes {d} features per row")
    values = arr.flatten()  # respects the array's offset when Spark hands over a slice
    if values.null_count:
        raise ConfigError(f"featuresCol={col!r} holds null values inside {values.null_count} vectors; fill them before transform")
    return values.to_numpy(zero_copy_only=False).reshape(n, d)


def _score_array(arr: pa.Array, scorer: _Scorer, model: tuple[Any, torch.device, torch.dtype]) -> pa.Array:
    import torch

    module, device, dtype = model
    x = _features_matrix(arr, scorer)
    outs: list[np.ndarray] = []
    # Arrow's buffers are read-only and the model only reads its input: no copy, and no warning.
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for start in range(0, len(x), scorer.batch_rows):
            xb = torch.from_numpy(x[start : start + scorer.batch_rows]).to(device=device, dtype=dtype)
            outs.append(_postprocess(module(xb), scorer).cpu().numpy())
    if scorer.vector_out:
        flat = np.concatenate([o.reshape(len(o), -1) for o in outs]) if outs else np.zeros((0, 0), np.float32)
        width = flat.shape[1] if flat.ndim == 2 else 0
        offsets = pa.array(np.arange(len(x) + 1, dtype=np.int32) * width)
        return pa.ListArray.from_arrays(offsets, pa.array(flat.reshape(-1).astype(np.float32)))
    return pa.array(np.concatenate(outs) if outs else np.zeros(0, np.float64), type=pa.float64())


def _postprocess(out: torch.Tensor, scorer: _Scorer) -> torch.Tensor:
    import torch

    n = out.shape[0]
    if scorer.task == CLASSIFICATION:
        if out.dim() == 1 or out.shape[-1] == 1:
            return (out.reshape(n) > 0).to(torch.float64)
        return out.argmax(dim=-1).to(torch.float64)
    if scorer.vector_out:
        return out.reshape(n, -1).to(torch.float32)
    return out.reshape(n).to(torch.float64)


def _score_batches(scorer: _Scorer, batches: Iterator[pa.Array]) -> Iterator[pa.Array]:
    model = None
    for arr in batches:
        if model is None:  # an empty partition never loads the model
            model = _worker_model(scorer)
        yield _score_array(arr, scorer, model)


def _arrow_udf_available() -> bool:
    from pyspark.sql import functions as F

    return hasattr(F, "arrow_udf")


def _scoring_column(scorer: _Scorer, features: Column) -> Column:
    """The prediction column: an iterator UDF over Arrow batches of the features."""
    from pyspark.sql import functions as F

    if _arrow_udf_available():  # pyspark >= 4.1: Arrow arrays in and out, no pandas in between

        def score_arrow(batches: Any) -> Any:
            return _score_batches(scorer, batches)

        # Spark picks the UDF kind from the type hints; set as objects, they need no name lookup.
        score_arrow.__annotations__ = {"batches": Iterator[pa.Array], "return": Iterator[pa.Array]}
        make_udf: Any = F.arrow_udf  # its overloads want a literal functionType; the hints decide it
        return cast("Column", make_udf(score_arrow, scorer.return_type)(features))

    import pandas as pd

    in_type = pa.list_(pa.float32())

    def score_pandas(batches: Any) -> Any:  # pyspark 3.5: pandas Series, converted to Arrow here
        arrays = (pa.array(s, type=in_type) for s in batches)
        for out in _score_batches(scorer, arrays):
            yield out.to_pandas()

    score_pandas.__annotations__ = {"batches": Iterator[pd.Series], "return": Iterator[pd.Series]}
    make_pandas_udf: Any = F.pandas_udf
    return cast("Column", make_pandas_udf(score_pandas, scorer.return_type)(features))
