"""The Spark ML params of :class:`TorchEstimator` and :class:`TorchModel`, and their converters.

Every param has a converter that normalizes a value and refuses a bad one with a ConfigError
naming the param, so a mistake surfaces at ``TorchEstimator(...)`` or ``setX``, not mid-fit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, cast

from pyspark.ml.param import Param, Params
from pyspark.ml.param.shared import HasFeaturesCol, HasLabelCol, HasPredictionCol, HasSeed

from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.common.validate import int_at_least, is_number, positive_number
from sparkdl._internal.ml.decoding import check_decoder
from sparkdl._internal.ml.fit_plan import LOSSES, OPTIMIZERS, TASKS

__all__ = ["EstimatorParams", "ScoringParams", "check_backend"]


# --------------------------------------------------------------------------------------------
# Converters
# --------------------------------------------------------------------------------------------


def _int_at_least(name: str, minimum: int) -> Callable[[Any], int]:
    # Spark ML params may hold whole floats (2.0), so those count as integers.
    def convert(value: Any) -> int:
        return cast(int, int_at_least(name, value, minimum, integral_floats=True))

    return convert


def _fraction(value: Any) -> float:
    if not is_number(value) or not 0.0 <= value < 1.0:
        raise ConfigError(f"validationFraction must be a number in [0, 1); got {value!r}")
    return float(value)


def _learning_rate(value: Any) -> float:
    return positive_number("learningRate", value)


def _optional_bool(value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise ConfigError(f"useGpu must be True, False or None (use the task's GPU when Spark assigns one); got {value!r}")


def _features_col(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        sizes = ", ".join(f"<values in {v!r}>" for v in value)
        raise ConfigError(
            f"featuresCol takes one column; got {list(value)!r}. For a model with several inputs (as "
            f"predict_batch_udf(...)({', '.join(map(repr, value))}) calls it), put them in one column, "
            f"VectorAssembler(inputCols={list(value)!r}, outputCol='features').transform(df) (numbers "
            "and vectors; or F.concat of array columns), and give the model a forward(x) that splits it: "
            f"return net(*torch.split(x, [{sizes}], dim=1))"
        )
    raise ConfigError(f"featuresCol must be the name of a column (a string); got {value!r}")


def _optional_str(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if not isinstance(value, str):
        raise ConfigError(f"expected a string (a path or URL) or None; got {value!r}")
    return value


def _task(value: Any) -> str | None:
    if value is None or value in TASKS:
        return cast("str | None", value)
    raise ConfigError(f"task must be 'classification', 'regression' or None (inferred from the loss); got {value!r}")


def _loss(value: Any) -> Any:
    if isinstance(value, str):
        if value not in LOSSES:
            raise ConfigError(
                f"loss={value!r} is not a known loss name; choose one of {', '.join(map(repr, LOSSES))}, "
                "or pass a callable (output, label) -> scalar tensor"
            )
        return value
    if callable(value):
        return value
    raise ConfigError(f"loss must be a loss name or a callable (output, label) -> scalar tensor; got {value!r}")


def _optimizer(value: Any) -> Any:
    if isinstance(value, str):
        if value not in OPTIMIZERS:
            raise ConfigError(
                f"optimizer={value!r} is not a known optimizer name; choose one of "
                f"{', '.join(map(repr, OPTIMIZERS))} (with learningRate), or pass a factory such as "
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


def check_backend(value: Any) -> str:
    """``'torch'``, the one backend TorchEstimator trains with, or a ConfigError that says why."""
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


class ScoringParams(HasFeaturesCol, HasPredictionCol):
    """Params shared by the estimator and the model: what scoring needs."""

    _input_kwargs: dict[str, Any]  # set by pyspark's keyword_only

    # Spark ML's, with a converter that says what to do with several input columns.
    featuresCol: Param[str] = Param(
        Params._dummy(), "featuresCol",
        "features column name (one column: a Spark ML vector, an array of numbers, or images with featuresDecoder)",
        typeConverter=_features_col,
    )
    featuresDecoder: Param[Any] = Param(
        Params._dummy(),
        "featuresDecoder",
        "a per-sample function fn(value, rng) -> array that decodes featuresCol (image bytes or Spark image "
        "structs), such as sparkdl.ImageDecoder(224); None: featuresCol holds numbers",
        typeConverter=check_decoder("featuresDecoder"),
    )

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
            featuresCol="features", featuresDecoder=None, predictionCol="prediction", task=None,
            inferenceBatchSize=1024, useGpu=None,
        )

    def getFeaturesDecoder(self) -> Any:
        """The per-sample function that decodes featuresCol, or None."""
        return self.getOrDefault(self.featuresDecoder)

    def setFeaturesDecoder(self, value: Any) -> Any:
        """Sets the per-sample function that decodes featuresCol (None: it holds numbers)."""
        return self._set(featuresDecoder=value)

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


class EstimatorParams(ScoringParams, HasLabelCol, HasSeed):
    """The scoring params plus what training needs: model, optimizer, loss, data and run bounds."""

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
        Params._dummy(), "learningRate", "learning rate of a named optimizer", typeConverter=_learning_rate
    )
    loss: Param[Any] = Param(
        Params._dummy(),
        "loss",
        f"one of {', '.join(LOSSES)}, or a function (output, label) -> scalar tensor",
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
    backend: Param[str] = Param(Params._dummy(), "backend", "distributed backend: 'torch'", typeConverter=check_backend)
    checkpointDir: Param[Any] = Param(
        Params._dummy(),
        "checkpointDir",
        "where checkpoints go (shared by all executors), in a subdirectory per fit named by its "
        "parameters and data: the same fit made again resumes (with more epochs too), and "
        "CrossValidator's fits never share one. None: a new directory per fit",
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
    evalDecoder: Param[Any] = Param(
        Params._dummy(),
        "evalDecoder",
        "the featuresDecoder of validation rows and of the fitted model's transform; None: featuresDecoder "
        "without its random draws (an ImageDecoder's random crop becomes the center crop)",
        typeConverter=check_decoder("evalDecoder"),
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
            evalDecoder=None,
        )

    def getEvalDecoder(self) -> Any:
        """The decoder of validation rows and of the fitted model, or None (derived from featuresDecoder)."""
        return self.getOrDefault(self.evalDecoder)

    def setEvalDecoder(self, value: Any) -> Any:
        """Sets the decoder of validation rows and of the fitted model (None: derived from featuresDecoder)."""
        return self._set(evalDecoder=value)
