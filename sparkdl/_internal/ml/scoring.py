"""Scoring on the executors: Arrow batches of features in, the model on whole batches, predictions out.

``TorchModel.transform`` adds one column computed by an iterator UDF over Arrow batches
(``arrow_udf`` on pyspark >= 4.1, ``pandas_udf`` before): the model runs on up to
``inferenceBatchSize`` rows at once, never on one row at a time. Only the features column travels
to Python and only the prediction comes back. The model's bytes reach the executors once, as a
Spark broadcast (classic session) or as a file shipped with the Spark Connect session (read with
``SparkFiles``); each Python worker checks them against the model's content hash, unpickles them
the first time it scores with that model on a device and keeps the module in a small per-process
cache keyed by that hash and the device, so later batches, tasks and jobs served by the same
(reused) worker skip the load.

Each task scores on the GPU Spark gave it (``TaskContext.resources()``), looked up per task: with
``spark.task.resource.gpu.amount`` below 1, several tasks share one GPU, and a reused worker may
serve tasks of different GPUs one after the other.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkdl._internal.common.errors import ConfigError, SparkDLError
from sparkdl._internal.data.decoding.samples import one_torch_thread
from sparkdl._internal.ml.decoding import decode_batch_values, decode_values, scoring_decoder
from sparkdl._internal.ml.fit_plan import CLASSIFICATION
from sparkdl._internal.ml.modules import load_module
from sparkdl._internal.ml.training import input_dtype, model_input

if TYPE_CHECKING:
    import torch
    from pyspark.sql import Column

__all__ = ["Scorer", "scoring_column"]

# Modules kept per Python worker; more than one model is rare, and each may be large.
_WORKER_CACHE_SIZE = 2


def model_id_of(data: bytes) -> str:
    """A pickled module's id: the key of the workers' cache, checked against the bytes they get."""
    return hashlib.sha256(data).hexdigest()[:24]


@dataclass(frozen=True)
class Scorer:
    """What the scoring UDF closes over: small and picklable; the module itself is in ``source``."""

    model_id: str
    # The pickled module: a Broadcast of it (classic Spark), the name of a file shipped with the
    # Spark Connect session (SparkFiles), or the bytes themselves (a server that takes no files).
    source: Any
    task: str
    num_features: int | None
    batch_rows: int
    use_gpu: bool | None
    features_col: str
    vector_out: bool
    decoder: Any = None  # decodes each row's features (images) before the model
    decode_threads: int = 1  # the threads each task decodes on (decoding.decode_threads)

    @property
    def return_type(self) -> str:
        """The prediction column's Spark type: ``array<float>`` for vector outputs, else ``double``."""
        return "array<float>" if self.vector_out else "double"

    def module_bytes(self) -> bytes:
        """The pickled module, from its source; SparkDLError unless its hash is ``model_id``."""
        if isinstance(self.source, bytes):
            data = self.source
        elif isinstance(self.source, str):
            from pyspark import SparkFiles

            with open(SparkFiles.get(self.source), "rb") as f:
                data = f.read()
        else:
            data = cast(bytes, self.source.value)
        if model_id_of(data) != self.model_id:
            raise SparkDLError(
                f"the model's bytes that reached this Python worker (pid {os.getpid()}) do not match the "
                f"model (id {self.model_id}), so they are not unpickled: the file or broadcast was damaged or "
                "replaced. Run the transform again; if this recurs, check the executors' Spark files directory"
            )
        return data


class _WorkerModels:
    """(model id, device) -> module, least recently used out first, bounded to ``size`` modules.

    Spark reuses its Python workers (spark.python.worker.reuse, on by default), so the one
    instance below outlives a task: a model is unpickled once per worker, not once per task or
    batch. Loading happens under the lock, so two threads of a worker never load one model twice.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._modules: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str], load: Callable[[], Any]) -> Any:
        """The module cached under ``key``, made by ``load()`` on the first call."""
        with self._lock:
            module = self._modules.get(key)
            if module is None:
                module = load()
                self._modules[key] = module
                while len(self._modules) > self._size:
                    self._modules.popitem(last=False)
            else:
                self._modules.move_to_end(key)
            return module


_WORKER_MODELS = _WorkerModels(_WORKER_CACHE_SIZE)


def _task_gpu() -> str | None:
    """The GPU address Spark gave the running task (its first), or None.

    With a fractional amount (``spark.task.resource.gpu.amount=0.25``) several concurrent tasks
    get the same address, and each must score on that GPU, not on the one a previous task of the
    same (reused) Python worker had.
    """
    from pyspark import TaskContext

    tc = TaskContext.get()
    gpus = tc.resources().get("gpu") if tc is not None else None
    return str(gpus.addresses[0]) if gpus is not None and gpus.addresses else None


# (GPU address) already reported as unusable by this worker: once per worker and address.
_CPU_FALLBACK_TOLD: set[str] = set()


def _task_device(use_gpu: bool | None) -> torch.device:
    """The GPU Spark assigned to this task, else the CPU (useGpu=None), or a ConfigError (useGpu=True)."""
    import torch

    if use_gpu is False:
        return torch.device("cpu")
    address = _task_gpu()
    if address is not None and torch.cuda.is_available():
        return torch.device("cuda", int(address))
    if use_gpu:
        raise ConfigError(
            f"useGpu=True, but this task got GPU address {address} and torch.cuda.is_available() is "
            f"{torch.cuda.is_available()}; set spark.task.resource.gpu.amount and install a CUDA build of torch "
            "on the executors, or set useGpu=None"
        )
    if address is not None and address not in _CPU_FALLBACK_TOLD:
        _CPU_FALLBACK_TOLD.add(address)
        # One write, newline included: the executor's Python workers share one stderr pipe, and
        # print() writes the newline separately, so two workers' lines could run together.
        sys.stderr.write(
            f"sparkdl: Spark gave this task GPU {address}, but torch.cuda.is_available() is False in this Python "
            f"worker (pid {os.getpid()}): TorchModel scores on the CPU. Install a CUDA build of torch on the "
            "executors, or set useGpu=False to score on the CPU without this message.\n"
        )
        sys.stderr.flush()
    return torch.device("cpu")


def _worker_model(scorer: Scorer) -> tuple[Any, torch.device, torch.dtype]:
    device = _task_device(scorer.use_gpu)
    module = _WORKER_MODELS.get(
        (scorer.model_id, str(device)),
        lambda: load_module(scorer.module_bytes()).to(device).eval(),
    )
    return module, device, input_dtype(module)


def _features_matrix(arr: pa.Array, scorer: Scorer) -> np.ndarray:
    """An ``array<float>`` Arrow column as an ``(N, d)`` float32 matrix, or a task error naming the column."""
    n = len(arr)
    col = scorer.features_col
    if arr.null_count:
        raise ConfigError(
            f"featuresCol={col!r} is null in {arr.null_count} of the {n} rows of a batch; drop or fill them before transform"
        )
    if n == 0:
        return np.zeros((0, scorer.num_features or 0), dtype=np.float32)
    bounds = pc.min_max(pc.list_value_length(arr))
    lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
    d = scorer.num_features if scorer.num_features is not None else lo
    if lo != d or hi != d:
        raise ConfigError(
            f"featuresCol={col!r} holds rows of {lo} to {hi} values; the model takes {d} features per row"
        )
    values = arr.flatten()  # respects the array's offset when Spark hands over a slice
    if values.null_count:
        raise ConfigError(
            f"featuresCol={col!r} holds null values inside {values.null_count} vectors; fill them before transform"
        )
    return values.to_numpy(zero_copy_only=False).reshape(n, d)


def _score_array(
    arr: pa.Array, scorer: Scorer, model: tuple[Any, torch.device, torch.dtype]
) -> pa.Array:
    import torch

    module, device, dtype = model
    n = len(arr)
    starts = range(0, n, scorer.batch_rows)
    chunks: Generator[Any, None, None]
    if scorer.decoder is not None:  # decoded a model call's rows at a time: memory stays bounded
        chunks = _decoded_ahead(scorer, arr.to_pylist(), starts, device)
    else:
        x = _features_matrix(arr, scorer)
        chunks = (x[start : start + scorer.batch_rows] for start in starts)
    outs: list[np.ndarray] = []
    # Arrow's buffers are read-only and the model only reads its input: no copy, and no warning.
    with contextlib.closing(chunks), torch.inference_mode(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for chunk in chunks:
            xb = model_input(torch.from_numpy(chunk) if isinstance(chunk, np.ndarray) else chunk, device, dtype)
            outs.append(_postprocess(module(xb), scorer).cpu().numpy())
    if scorer.vector_out:
        flat = (
            np.concatenate([o.reshape(len(o), -1) for o in outs])
            if outs
            else np.zeros((0, 0), np.float32)
        )
        width = flat.shape[1] if flat.ndim == 2 else 0
        offsets = pa.array(np.arange(n + 1, dtype=np.int32) * width)
        return pa.ListArray.from_arrays(offsets, pa.array(flat.reshape(-1).astype(np.float32)))
    return pa.array(np.concatenate(outs) if outs else np.zeros(0, np.float64), type=pa.float64())


def _decoded_ahead(
    scorer: Scorer, values: list[Any], starts: range, device: torch.device
) -> Generator[Any, None, None]:
    """The decoded chunks of ``values``, each decoded while the model runs on the one before (two
    chunks in memory at most): one image at a time on ``scorer.decode_threads`` threads, or a chunk
    at once by a decoder of whole batches on the task's device (nvJPEG, DALI). The thread that runs
    ahead ends with the generator (closed by the caller), so no thread outlives a batch."""
    decoder = scoring_decoder(scorer.decoder, device)
    batched = bool(getattr(decoder, "batched", False))

    def decode(start: int) -> Any:
        chunk = values[start : start + scorer.batch_rows]
        if batched:
            return decode_batch_values(decoder, chunk, scorer.features_col)
        return decode_values(decoder, chunk, scorer.features_col, threads=scorer.decode_threads)

    ahead = ThreadPoolExecutor(1, thread_name_prefix="sparkdl-decode-ahead", initializer=one_torch_thread)
    try:
        pending = ahead.submit(decode, starts[0]) if starts else None
        for i in range(len(starts)):
            chunk = cast("Future[Any]", pending).result()
            pending = ahead.submit(decode, starts[i + 1]) if i + 1 < len(starts) else None
            yield chunk
    finally:
        ahead.shutdown(wait=True, cancel_futures=True)


def _postprocess(out: torch.Tensor, scorer: Scorer) -> torch.Tensor:
    import torch

    n = out.shape[0]
    if scorer.task == CLASSIFICATION:
        if out.dim() == 1 or out.shape[-1] == 1:
            return (out.reshape(n) > 0).to(torch.float64)
        return out.argmax(dim=-1).to(torch.float64)
    if scorer.vector_out:
        return out.reshape(n, -1).to(torch.float32)
    return out.reshape(n).to(torch.float64)


def _score_batches(scorer: Scorer, batches: Iterator[pa.Array]) -> Iterator[pa.Array]:
    model = None
    for arr in batches:
        if model is None:  # an empty partition never loads the model
            model = _worker_model(scorer)
        yield _score_array(arr, scorer, model)


def _arrow_udf_available() -> bool:
    from pyspark.sql import functions as F

    return hasattr(F, "arrow_udf")


def scoring_column(scorer: Scorer, features: Column) -> Column:
    """The prediction column: an iterator UDF over Arrow batches of the features (``array<float>``)."""
    from pyspark.sql import functions as F

    if _arrow_udf_available():  # pyspark >= 4.1: Arrow arrays in and out, no pandas in between

        def score_arrow(batches: Any) -> Any:
            return _score_batches(scorer, batches)

        # Spark picks the UDF kind from the type hints; set as objects, they need no name lookup.
        score_arrow.__annotations__ = {"batches": Iterator[pa.Array], "return": Iterator[pa.Array]}
        make_udf: Any = (
            F.arrow_udf
        )  # its overloads want a literal functionType; the hints decide it
        return cast("Column", make_udf(score_arrow, scorer.return_type)(features))

    import pandas as pd

    # Features to decode (image bytes, or Spark's image struct: a DataFrame here) keep their type.
    in_type = pa.list_(pa.float32()) if scorer.decoder is None else None

    def to_arrow(s: Any) -> pa.Array:
        if isinstance(s, pd.DataFrame):
            return pa.array(s.to_dict("records"))
        return pa.array(s, type=in_type)

    def score_pandas(batches: Any) -> Any:  # pyspark 3.5: pandas Series, converted to Arrow here
        arrays = (to_arrow(s) for s in batches)
        for out in _score_batches(scorer, arrays):
            yield out.to_pandas()

    score_pandas.__annotations__ = {"batches": Iterator[pd.Series], "return": Iterator[pd.Series]}
    make_pandas_udf: Any = F.pandas_udf
    return cast("Column", make_pandas_udf(score_pandas, scorer.return_type)(features))
