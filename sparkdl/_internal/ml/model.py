""":class:`TorchModel`: a trained PyTorch module as a Spark ML Model that scores DataFrames."""

from __future__ import annotations

import math
import os
import tempfile
import threading
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from pyspark import keyword_only
from pyspark.ml.base import Model
from pyspark.ml.util import MLReadable, MLReader, MLWritable, MLWriter

from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.ml.columns import check_features_type, features_expr
from sparkdl._internal.ml.decoding import decode_threads, decode_values
from sparkdl._internal.ml.fit_plan import REGRESSION
from sparkdl._internal.ml.modules import dump_module, load_module
from sparkdl._internal.ml.params import ScoringParams
from sparkdl._internal.ml.persistence import (
    ParamsReader,
    ParamsWriter,
    Persistable,
    check_connect_client,
)
from sparkdl._internal.ml.scoring import Scorer, model_id_of, scoring_column
from sparkdl._internal.ml.training import input_dtype, model_input
from sparkdl._internal.spark import spark_api

if TYPE_CHECKING:
    import torch
    from pyspark.sql import Column, DataFrame, SparkSession

__all__ = ["TorchModel"]


class TorchModel(Model, ScoringParams, Persistable, MLWritable, MLReadable["TorchModel"]):
    """A trained PyTorch model as a Spark ML Model: ``transform`` scores DataFrames on the cluster.

    ``transform(df)`` adds ``predictionCol``:

    - ``task="classification"``: a ``double``, the class with the highest score (argmax of an
      ``(N, C)`` output), or ``1.0``/``0.0`` for a single-logit model (logit > 0);
    - ``task="regression"``: a ``double`` when the model outputs one value per row (``(N,)`` or
      ``(N, 1)``), else an ``array<float>`` of the model's outputs for the row (turn it into an
      ML vector with ``pyspark.ml.functions.array_to_vector`` when needed).

    ``featuresCol`` may hold Spark ML vectors (dense or sparse) or arrays of numbers; or images
    (encoded bytes, Spark's image struct) with ``featuresDecoder``, such as
    ``sparkdl.ImageDecoder(224, crop="center")``, which the executors run on each row (a fitted
    model takes its estimator's ``evalDecoder``). Only that column goes to Python. Scoring runs in an iterator UDF over Arrow batches, up to
    ``inferenceBatchSize`` rows per model call, under ``torch.inference_mode()``. Each executor
    Python worker loads the model once and keeps it for later batches, tasks and jobs (its bytes
    reach the executors as a broadcast on a classic session; over Spark Connect, which has no
    broadcast, as a file added to the session with ``addArtifacts``, uploaded once per model and
    session). With ``useGpu`` unset or True it runs on the GPU Spark assigned to the task, when
    there is one (address ``a`` means ``cuda:a``). A null features value, or one of another length
    than the model was trained on, fails the task with an error naming the column.

    A model made by :meth:`TorchEstimator.fit` carries its training history. One can also wrap
    a module trained elsewhere::

        model = sparkdl.TorchModel(model=net, featuresCol="features", task="classification")
        scored = model.transform(df)                 # adds "prediction"
        model.save("hdfs:///models/net")             # or inside a PipelineModel
        same = sparkdl.TorchModel.load("hdfs:///models/net")

    ``model`` may also be a TorchScript module (``torch.jit.script``, ``torch.jit.trace`` or
    ``torch.jit.load`` of one), kept in TorchScript's own format. A model of several inputs takes
    them from one column: assemble them (``VectorAssembler``, or ``F.concat`` of arrays) and give
    it a ``forward(x)`` that calls the net on ``torch.split(x, sizes, dim=1)``.

    The module is kept cloudpickled (on the CPU); ``getModule()`` gives a copy. For a wrapped
    regression model, the first ``transform`` runs the module on one row on the driver (a
    ``limit(1)`` job) to learn whether the prediction is a number or an array.

    **Loading a saved TorchModel runs code from its files** (the module is unpickled on the
    driver and on every executor), so load only models from a trusted source. ``load`` refuses,
    with a :class:`~sparkdl.ConfigError` naming the path, a saved model on a local path of
    which any file or directory belongs to another user (root excepted) or is writable by group
    or others, as a model planted or altered by someone else would be. When you trust it anyway,
    opt in with ``TorchModel.load(path, trusted=True)``, or with the Spark conf
    ``spark.sparkdl.ml.trustSavedModels=true`` (which also reaches a TorchModel inside a
    ``PipelineModel``). Paths on other filesystems (HDFS, S3, ...) are not checked: their
    access control is the store's.
    """

    # Saved models name their class in their metadata, and Spark ML loads a stage by that name:
    # the public module keeps models saved by every sparkdl version loadable by every other.
    __module__ = "sparkdl.ml"

    @keyword_only
    def __init__(
        self,
        *,
        model: Any = None,
        featuresCol: str = "features",
        featuresDecoder: Any = None,
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
        self._shipped: set[str] = set()  # Connect sessions (ids) that have the module's file
        self._lock = threading.Lock()
        if module is not None:
            self._set_module(module)

    @classmethod
    def _trained(
        cls, module: Any, *, num_features: int | None, num_outputs: int, history: list[dict[str, Any]], **params: Any
    ) -> TorchModel:
        """A model made by a fit: the trained module, what the fit learned, and the scoring ``params``."""
        model = cls(model=module, **params)
        model._num_features = num_features
        model._num_outputs = num_outputs
        model._history = [dict(h) for h in history]
        return model

    def _set_module(self, module: Any) -> None:
        import torch

        if not isinstance(module, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module; got {type(module).__name__}")
        # The module is kept as bytes: they are what the executors get, and their hash names the
        # model in each worker's cache.
        try:
            data = dump_module(module)
        except Exception as exc:
            raise ConfigError(
                f"model={type(module).__name__} cannot be pickled to reach the executors: {type(exc).__name__}: "
                f"{exc}. Keep what cannot be pickled (open files, locks, clients) out of the module's "
                "attributes, or pass a TorchScript module (torch.jit.script or torch.jit.trace of it)"
            ) from exc
        self._module_bytes = data
        self._model_id = model_id_of(data)
        self._broadcast = None
        self._shipped = set()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_broadcast"] = None  # a driver-side handle of one SparkContext
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_shipped", set())
        self._lock = threading.Lock()

    # -- what the model knows ----------------------------------------------------------------

    @property
    def history(self) -> list[dict[str, Any]]:
        """Metrics per epoch of the fit that made this model, as a list of dicts, one per epoch.

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
        return load_module(self._require_bytes()).eval()

    @property
    def numFeatures(self) -> int | None:
        """Features per row the model was trained on, or None when unknown (transform then takes any one length)."""
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
        self._model_id = model_id_of(self._module_bytes)
        self._broadcast = None
        self._shipped = set()
        self._num_features = meta.get("numFeatures")
        self._num_outputs = meta.get("numOutputs")
        self._history = [dict(h) for h in meta.get("history") or []]

    def write(self) -> MLWriter:
        """An MLWriter: params and history to ``metadata``, the pickled module to ``data/``."""
        return ParamsWriter(self)

    @classmethod
    def read(cls) -> MLReader[TorchModel]:
        """An MLReader for models saved with :meth:`save` (alone or inside a PipelineModel)."""
        return ParamsReader(cls)

    # -- transform ---------------------------------------------------------------------------

    def _transform(self, dataset: DataFrame) -> DataFrame:
        from sparkdl._internal.driver.cluster import resolve_gpu

        self._require_bytes()
        session = dataset.sparkSession
        check_connect_client(session, "TorchModel.transform")
        features_col, prediction_col = self.getFeaturesCol(), self.getPredictionCol()
        decoder = self.getFeaturesDecoder()
        check_features_type(dataset, features_col, decoded=decoder is not None)
        if prediction_col in dataset.columns:
            raise ConfigError(
                f"predictionCol={prediction_col!r} is already a column of the DataFrame; choose another "
                "name (setPredictionCol) or drop that column first"
            )
        task = self.getTask() or REGRESSION
        use_gpu = self.getUseGpu()
        if use_gpu:
            resolve_gpu(spark_api.of(session).confs(), use_gpu)  # ConfigError naming the confs
        num_outputs = self._num_outputs
        if task == REGRESSION and num_outputs is None:
            num_outputs = self._learn_outputs(dataset)
        vector_out = task == REGRESSION and (num_outputs or 1) > 1
        scorer = Scorer(
            model_id=cast(str, self._model_id),
            source=self._model_source(session),
            task=task,
            num_features=self._num_features,
            batch_rows=self.getInferenceBatchSize(),
            use_gpu=use_gpu,
            features_col=features_col,
            vector_out=vector_out,
            decoder=decoder,
            decode_threads=decode_threads(session.conf, spark_api.of(session).confs()) if decoder is not None else 1,
        )
        return dataset.withColumn(prediction_col, scoring_column(scorer, self._features(dataset)))

    def _features(self, dataset: DataFrame) -> Column:
        from pyspark.sql import functions as F

        col = self.getFeaturesCol()
        return F.col(col) if self.getFeaturesDecoder() is not None else features_expr(dataset, col)

    def _model_source(self, session: SparkSession) -> Any:
        """Where the executors find the module's bytes: over Connect, the name of a file shipped
        with the session (once per model and session); on a classic session, the broadcast made
        once per model and SparkContext."""
        if spark_api.is_remote(session):
            return self._shipped_file(session)
        sc = session.sparkContext
        key = f"{sc.applicationId}-{sc.startTime}"
        with self._lock:
            if self._broadcast is None or self._broadcast[0] != key:
                self._broadcast = (key, sc.broadcast(self._require_bytes()))
            return self._broadcast[1]

    def _shipped_file(self, session: SparkSession) -> str | bytes:
        # Named by the content hash: the server refuses another content under a name it has, and
        # the same content under the same name again costs only the upload.
        name = f"sparkdl-model-{self._model_id}.pkl"
        session_id = str(session.session_id)  # type: ignore[attr-defined]  # a Connect session's
        with self._lock:
            if session_id in self._shipped:
                return name
            data = self._require_bytes()
            try:
                with tempfile.TemporaryDirectory(prefix="sparkdl-model-") as tmp:  # private to this user
                    path = os.path.join(tmp, name)
                    with open(path, "wb") as f:
                        f.write(data)
                    session.addArtifacts(path, file=True)
            except Exception as exc:  # a server that takes no files: the bytes go with the UDF
                warnings.warn(
                    f"TorchModel.transform could not add the model's file to the Spark Connect session "
                    f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); the model's "
                    f"{len(data)} bytes travel with every task instead (still loaded once per Python worker)",
                    RuntimeWarning,
                    stacklevel=4,
                )
                return data
            self._shipped.add(session_id)
            return name

    def _learn_outputs(self, dataset: DataFrame) -> int:
        """Outputs per row of a wrapped regression model, from one row (a small job), remembered."""
        import torch

        row = dataset.select(self._features(dataset).alias("x")).limit(1).collect()
        if not row:
            return 1
        module = self.getModule()
        decoder = self.getFeaturesDecoder()
        value = row[0]["x"]
        x = torch.from_numpy(decode_values(decoder, [value], self.getFeaturesCol())) if decoder else torch.tensor([value])
        with torch.inference_mode():
            out = module(model_input(x, "cpu", input_dtype(module)))
        self._num_outputs = 1 if out.dim() == 1 else int(math.prod(out.shape[1:]))
        return self._num_outputs
