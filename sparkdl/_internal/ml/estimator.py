""":class:`TorchEstimator`: trains a PyTorch model with DDP as one stage of a Spark ML Pipeline.

The path of ``fit(df)``:

1. **Validate** on the driver, before anything is written or trained: the columns exist and have
   usable types (one schema pass, no job); the features have one length and no null or NaN, and
   the labels suit the loss (one aggregation job, :mod:`sparkdl._internal.ml.columns`); the model accepts a
   few real rows and its output matches the labels and the loss (one ``limit`` job, the model run
   on the driver, :mod:`sparkdl._internal.ml.probe`).
2. **Write** the features (``array<float>``) and labels with :func:`sparkdl.write_dataset`,
   holding out ``validationFraction`` of the rows (``randomSplit`` with the seed).
3. **Train** with :func:`sparkdl.run`: DDP on ``numWorkers`` gang-scheduled ranks, each running
   :func:`sparkdl._internal.ml.training.train_on_rank`, so a failed rank reruns the gang and training
   resumes from the last checkpoint, history included.
4. **Return** a :class:`TorchModel` holding the trained module (cloudpickled, CPU) and the history.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from pyspark import keyword_only
from pyspark.ml.base import Estimator
from pyspark.ml.util import MLReadable, MLReader, MLWritable, MLWriter

from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import ConfigError, SparkDLError
from sparkdl._internal.ml.columns import features_expr, inspect_columns, label_expr
from sparkdl._internal.ml.decoding import eval_decoder
from sparkdl._internal.ml.fit_dir import fit_dir
from sparkdl._internal.ml.fit_plan import CLASSIFICATION, REGRESSION, REGRESSION_LOSSES, FitPlan
from sparkdl._internal.ml.model import TorchModel
from sparkdl._internal.ml.params import EstimatorParams, check_backend
from sparkdl._internal.ml.persistence import (
    ParamsReader,
    ParamsWriter,
    Persistable,
    check_connect_client,
)
from sparkdl._internal.ml.probe import probe
from sparkdl._internal.ml.training import train_on_rank
from sparkdl._internal.spark import spark_api

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from sparkdl._internal.data.dataset import Dataset

__all__ = ["TorchEstimator"]


class TorchEstimator(Estimator["TorchModel"], EstimatorParams, Persistable, MLWritable, MLReadable["TorchEstimator"]):
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

    Each param below also has a getter and a setter (``getBatchSize``, ``setBatchSize``, ...).

    Params:
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
        featuresCol: the features column (default ``"features"``): a Spark ML vector or an array
            of numbers; or images (``binaryFile``'s ``content``, the ``image`` source's struct)
            with ``featuresDecoder``.
        featuresDecoder: a per-sample function ``fn(value, rng) -> array`` that decodes and
            augments featuresCol on the ranks' decode workers, such as
            ``sparkdl.ImageDecoder(224)``; ``uint8`` arrays reach the model as floats in [0, 1].
        evalDecoder: the decoder of validation rows and of the fitted model's ``transform``;
            ``None`` (default): featuresDecoder without random draws (``ImageDecoder.for_eval()``).
        labelCol: the label column (default ``"label"``).
        predictionCol: the column ``transform`` adds (default ``"prediction"``).
        batchSize: rows per batch on each worker (default 32). The last partial batch of each
            epoch is dropped, unless the data is smaller than one batch per worker.
        epochs: passes over the data (default 10).
        numWorkers: ranks, one Spark task each (default 1).
        seed: seeds the model's initialisation, the shuffle and the split (default 0).
        backend: ``"torch"`` (default) or ``"horovod"``.
        useGpu: one GPU per rank; ``None`` (default): when ``spark.task.resource.gpu.amount`` is set.
        runConfig: a :class:`sparkdl.RunConfig`, the run's bounds (default: ``RunConfig()``).
        checkpointDir: where checkpoints go, in a subdirectory per fit named by its parameters and
            data (``fit-<digest>``); ``None`` (default): a new directory per fit under ``spark.sparkdl.runDir``.
        checkpointEvery: ``0`` (default): checkpoint at the end of each epoch only; N: also every
            N steps.
        validationFraction: rows held out (default 0.0); with it, every epoch records
            ``val_loss`` (and ``val_accuracy`` for classification).
        inferenceBatchSize: rows per model call in ``transform`` (default 1024).
    """

    # Saved estimators name their class in their metadata, and Spark ML loads a stage by that
    # name: the public module keeps estimators saved by every sparkdl version loadable by every other.
    __module__ = "sparkdl.ml"

    @keyword_only
    def __init__(
        self,
        *,
        model: Any = None,
        featuresCol: str = "features",
        labelCol: str = "label",
        featuresDecoder: Any = None,
        evalDecoder: Any = None,
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
        featuresDecoder: Any = None,
        evalDecoder: Any = None,
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

    # -- getters and setters, Spark ML style (the class docstring describes each param) ---------

    def getModel(self) -> Any:
        """The module or factory to train."""
        return self.getOrDefault(self.model)

    def setModel(self, value: Any) -> TorchEstimator:
        """Sets the module or factory to train."""
        return self._set(model=value)

    def getOptimizer(self) -> Any:
        """The optimizer name or factory."""
        return self.getOrDefault(self.optimizer)

    def setOptimizer(self, value: Any) -> TorchEstimator:
        """Sets the optimizer name or factory."""
        return self._set(optimizer=value)

    def getLearningRate(self) -> float:
        """The learning rate of a named optimizer."""
        return self.getOrDefault(self.learningRate)

    def setLearningRate(self, value: float) -> TorchEstimator:
        """Sets the learning rate of a named optimizer."""
        return self._set(learningRate=value)

    def getLoss(self) -> Any:
        """The loss name or callable."""
        return self.getOrDefault(self.loss)

    def setLoss(self, value: Any) -> TorchEstimator:
        """Sets the loss name or callable."""
        return self._set(loss=value)

    def getBatchSize(self) -> int:
        """Rows per batch on each worker."""
        return self.getOrDefault(self.batchSize)

    def setBatchSize(self, value: int) -> TorchEstimator:
        """Sets the rows per batch on each worker."""
        return self._set(batchSize=value)

    def getEpochs(self) -> int:
        """Passes over the training rows."""
        return self.getOrDefault(self.epochs)

    def setEpochs(self, value: int) -> TorchEstimator:
        """Sets the passes over the training rows."""
        return self._set(epochs=value)

    def getNumWorkers(self) -> int:
        """Ranks (Spark task slots) to train on."""
        return self.getOrDefault(self.numWorkers)

    def setNumWorkers(self, value: int) -> TorchEstimator:
        """Sets the ranks (Spark task slots) to train on."""
        return self._set(numWorkers=value)

    def getBackend(self) -> str:
        """The distributed backend (``'torch'``)."""
        return self.getOrDefault(self.backend)

    def setBackend(self, value: str) -> TorchEstimator:
        """Sets the distributed backend (only ``'torch'`` is accepted)."""
        return self._set(backend=value)

    def getCheckpointDir(self) -> str | None:
        """Where checkpoints go (None: a new directory per fit)."""
        return cast("str | None", self.getOrDefault(self.checkpointDir))

    def setCheckpointDir(self, value: str | None) -> TorchEstimator:
        """Sets where checkpoints go."""
        return self._set(checkpointDir=value)

    def getCheckpointEvery(self) -> int:
        """Steps between extra checkpoints (0: only at the end of each epoch)."""
        return self.getOrDefault(self.checkpointEvery)

    def setCheckpointEvery(self, value: int) -> TorchEstimator:
        """Sets the steps between extra checkpoints."""
        return self._set(checkpointEvery=value)

    def getValidationFraction(self) -> float:
        """The fraction of rows held out for validation."""
        return self.getOrDefault(self.validationFraction)

    def setValidationFraction(self, value: float) -> TorchEstimator:
        """Sets the fraction of rows held out for validation."""
        return self._set(validationFraction=value)

    def getRunConfig(self) -> RunConfig | None:
        """The bounds of the training run."""
        return cast("RunConfig | None", self.getOrDefault(self.runConfig))

    def setRunConfig(self, value: RunConfig | None) -> TorchEstimator:
        """Sets the bounds of the training run."""
        return self._set(runConfig=value)

    def setLabelCol(self, value: str) -> TorchEstimator:
        """Sets the label column."""
        return self._set(labelCol=value)

    def setSeed(self, value: int) -> TorchEstimator:
        """Sets the seed of model initialisation, the shuffle and the split."""
        return self._set(seed=value)

    # -- persistence -------------------------------------------------------------------------

    def write(self) -> MLWriter:
        """An MLWriter: JSON params to ``metadata``; model, optimizer and loss callables pickled to ``data/``."""
        return ParamsWriter(self)

    @classmethod
    def read(cls) -> MLReader[TorchEstimator]:
        """An MLReader for estimators saved with :meth:`save`."""
        return ParamsReader(cls)

    # -- fit ---------------------------------------------------------------------------------

    def _fit(self, dataset: DataFrame) -> TorchModel:
        import torch
        from pyspark.sql import functions as F

        from sparkdl._internal.data.writing.write import write_dataset
        from sparkdl._internal.driver.run import run

        if not self.isDefined(self.model):
            raise ConfigError(
                "TorchEstimator needs a model: pass model=<torch.nn.Module or zero-argument factory>"
            )
        check_connect_client(dataset.sparkSession, "TorchEstimator.fit")
        plan = self._plan()
        facts = inspect_columns(dataset, plan)
        driver_module, num_outputs = probe(dataset, plan, facts)

        x = F.col(plan.features_col) if plan.decoder is not None else features_expr(dataset, plan.features_col)
        prepared = dataset.select(x.alias("x"), label_expr(dataset, plan).alias("y"))
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
            train_on_rank,
            plan,
            train_ds,
            val_ds,
            num_workers=plan.num_workers,
            backend=self.getBackend(),
            use_gpu=self.getUseGpu(),
            config=self.getRunConfig(),
            spark=session,
            checkpoint_dir=None if (ckpt := self.getCheckpointDir()) is None else fit_dir(ckpt, self, dataset),
        )
        if not isinstance(result, dict):
            raise SparkDLError("rank 0 returned no trained weights (internal error)")
        driver_module.load_state_dict(result["state_dict"])
        driver_module.to(torch.device("cpu")).eval()
        model = TorchModel._trained(
            driver_module,
            num_features=facts.num_features,
            num_outputs=num_outputs,
            history=result["history"],
            featuresCol=plan.features_col,
            featuresDecoder=plan.eval_decoder,
            predictionCol=self.getPredictionCol(),
            task=plan.task,
            inferenceBatchSize=self.getInferenceBatchSize(),
            useGpu=self.getUseGpu(),
        )
        # Like Spark's own models, the model takes the uid of the estimator that made it.
        return model._resetUid(self.uid)

    def _plan(self) -> FitPlan:
        loss = self.getLoss()
        task = self.getTask()
        if task is None:
            if isinstance(loss, str):
                task = REGRESSION if loss in REGRESSION_LOSSES else CLASSIFICATION
            else:
                task = REGRESSION
        elif isinstance(loss, str) and (task == CLASSIFICATION) != (loss not in REGRESSION_LOSSES):
            raise ConfigError(
                f"task={task!r} does not fit loss={loss!r}; leave task unset to infer it from the loss, "
                "or choose a loss for that task"
            )
        features_col, label_col = self.getFeaturesCol(), self.getLabelCol()
        if features_col == label_col:
            raise ConfigError(f"featuresCol and labelCol are both {features_col!r}; they must be different columns")
        check_backend(self.getBackend())
        return FitPlan(
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
            decoder=self.getFeaturesDecoder(),
            eval_decoder=eval_decoder(self.getFeaturesDecoder(), self.getEvalDecoder()),
        )


def _num_files(session: SparkSession, num_workers: int) -> int:
    # A multiple of the ranks keeps each rank on whole files.
    parallelism = spark_api.of(session).default_parallelism()
    return num_workers * max(1, -(-parallelism // num_workers))
