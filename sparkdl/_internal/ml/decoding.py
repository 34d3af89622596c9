"""Features that the model cannot take as they are stored: an image column (encoded bytes from
Spark's ``binaryFile`` source, or the struct of its ``image`` source) with a per-sample function
``fn(value, rng) -> array`` that decodes it, such as :class:`sparkdl.ImageDecoder`.

In ``fit``, the ranks' loaders run ``featuresDecoder`` (with its augmentation, each sample's draws
from its row) on their decode workers, and the validation rows go through ``evalDecoder``; the fitted
model scores with ``evalDecoder``, on the executors, a batch of rows at a time. An ``ImageDecoder``
that crops at random is evaluated with the same decoder cropping at the center, unless
``evalDecoder`` says otherwise. Decoded ``uint8`` arrays reach the model as floats in ``[0, 1]``.

In ``transform``, each task decodes its rows on as many threads as the cores Spark gives it
(:func:`decode_threads`): ``spark.task.cpus``, or, on GPU executors, the executor's cores shared
among the tasks its GPUs let run at once, since there the GPUs, not the cores, bound how many tasks
run and the other cores would idle while one thread decodes. ``spark.sparkdl.ml.decodeThreads``
sets the number.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.common.validate import invalid
from sparkdl._internal.data.decoding.images import ImageDecoder
from sparkdl._internal.data.decoding.samples import one_torch_thread
from sparkdl._internal.spark.confs import DECODE_THREADS

if TYPE_CHECKING:
    import numpy as np
    import torch
    from pyspark.sql.types import DataType

    from sparkdl._internal.spark.spark_api import Confs

__all__ = [
    "check_decoder",
    "decode_batch_values",
    "decode_threads",
    "decode_values",
    "eval_decoder",
    "holds_images",
    "scoring_decoder",
]


def check_decoder(name: str) -> Any:
    """The converter of the param ``name``: None, or a callable taking ``(value, rng)``."""

    def convert(value: Any) -> Any:
        if value is None or callable(value):
            return value
        raise ConfigError(
            f"{name} must be a per-sample function fn(value, rng) -> array, such as sparkdl.ImageDecoder(224), "
            f"or None; got {type(value).__name__}"
        )

    return convert


def eval_decoder(train: Any, explicit: Any) -> Any:
    """The decoder of validation and scoring: ``explicit``, else ``train``'s deterministic form."""
    if explicit is not None or train is None:
        return explicit
    for_eval = getattr(train, "for_eval", None)
    return for_eval() if callable(for_eval) else train


def holds_images(t: DataType) -> bool:
    """Whether a column of type ``t`` holds images: encoded bytes, or Spark's image struct."""
    from pyspark.sql import types as T

    if isinstance(t, T.BinaryType):
        return True
    return isinstance(t, T.StructType) and {"data", "nChannels", "height", "width"} <= set(t.fieldNames())


def decode_threads(session_conf: Any, spark_conf: Confs) -> int:
    """How many threads each scoring task decodes on: ``spark.sparkdl.ml.decodeThreads`` when set
    (read from the session, where ``spark.conf.set`` puts it), else the cores a task has.

    Those are ``spark.task.cpus``, unless the executors have GPUs that bound the tasks running at
    once: with ``spark.executor.cores=8``, one GPU per executor and one per task, one task runs per
    executor and gets all 8 cores. ``spark_conf`` is the application's (static) conf.
    """
    explicit = session_conf.get(DECODE_THREADS.name, None)
    if explicit not in (None, ""):
        try:
            n = int(str(explicit))
        except ValueError:
            n = 0
        if n < 1:
            raise invalid(DECODE_THREADS.name, explicit, "a whole number of threads, at least 1")
        return n

    def number(key: str) -> float:
        try:
            return float(spark_conf.get(key, None) or 0)
        except ValueError:
            return 0.0

    task_cpus = max(1, int(number("spark.task.cpus") or 1))
    cores = int(number("spark.executor.cores"))
    per_task, per_executor = number("spark.task.resource.gpu.amount"), number("spark.executor.resource.gpu.amount")
    if cores <= 0 or per_task <= 0 or per_executor <= 0:
        return task_cpus
    at_once = max(1, min(cores // task_cpus, int(per_executor / per_task + 1e-9)))
    return max(task_cpus, cores // at_once)


def decode_values(
    decoder: Any, values: Sequence[Any], col: str, what: str = "featuresDecoder", threads: int = 1
) -> np.ndarray:
    """``decoder`` applied to each value, stacked: ``[len(values), ...]``, or a ConfigError naming
    the column and the first value that failed. Each value gets a generator seeded alike, so a
    decoder without random draws (an evaluation crop) gives each image its one result. With
    ``threads`` above 1 the values are decoded on that many threads (a decoder that lets go of the
    GIL, as ``ImageDecoder`` does, then runs on that many cores); the result is the same."""
    import numpy as np

    def one(i: int, value: Any) -> np.ndarray:
        value = _as_decoded(value, col)
        try:
            return np.asarray(decoder(value, np.random.default_rng(0)))
        except ConfigError:
            raise
        except Exception as exc:
            raise _failed(what, i, col, exc) from exc

    if threads > 1 and len(values) > 1:
        # Threads of this call only: none is left running in the process afterwards (a thread
        # left behind in a driver or worker that forks later is a hazard). map hands the results
        # back in order and raises the first failure in row order.
        with ThreadPoolExecutor(threads, thread_name_prefix="sparkdl-decode", initializer=one_torch_thread) as pool:
            out = list(pool.map(one, range(len(values)), values))
    else:
        out = [one(i, value) for i, value in enumerate(values)]
    for arr in out:
        if arr.shape != out[0].shape:
            raise ConfigError(
                f"{what} gave arrays of shapes {out[0].shape} and {arr.shape} for rows of featuresCol={col!r}; "
                "it must give every row one shape (ImageDecoder(size=...) does)"
            )
    return np.stack(out) if out else np.zeros((0,), np.uint8)


def _as_decoded(value: Any, col: str) -> Any:
    """A row's value as a decoder takes it; a null is refused, naming the column."""
    if value is None:
        raise ConfigError(f"featuresCol={col!r} is null in a row to decode; drop or fill those rows first")
    if hasattr(value, "asDict"):  # a struct collected to the driver (a pyspark Row): as the loader gives it
        return value.asDict()
    return value


def _failed(what: str, i: int, col: str, exc: BaseException) -> ConfigError:
    return ConfigError(f"{what} failed on row {i} of a batch of featuresCol={col!r}: {type(exc).__name__}: {exc}")


def scoring_decoder(decoder: Any, device: torch.device) -> Any:
    """The decoder a scoring task on ``device`` runs. A decoder of whole batches on a GPU
    (``ImageDecoder(device="cuda")``: nvJPEG; or ``engine="dali"``) decodes on the task's GPU; on a
    task without one, DALI decodes on the CPU and nvJPEG's decoder one image at a time on the CPU
    (sparkdl's CPU decoder: the same crops). Other decoders are run as they are."""
    if not isinstance(decoder, ImageDecoder) or not decoder.batched:
        return decoder
    on_gpu = str(decoder.device).startswith("cuda")
    if device.type == "cuda" and on_gpu:
        return dataclasses.replace(decoder, device=str(device))
    if on_gpu:
        return dataclasses.replace(decoder, device="cpu" if decoder.engine == "dali" else None)
    return decoder


def decode_batch_values(decoder: Any, values: Sequence[Any], col: str, what: str = "featuresDecoder") -> torch.Tensor:
    """``values`` decoded together by a decoder of whole batches (``decoder.decode_batch``: nvJPEG,
    DALI), stacked on its device, or a ConfigError naming the column and the first row that failed."""
    import numpy as np
    import torch

    prepared = [_as_decoded(value, col) for value in values]
    images, bad = decoder.decode_batch(prepared, [np.random.default_rng(0) for _ in prepared])
    if bad:
        i = min(bad)
        raise _failed(what, i, col, bad[i]) from bad[i]
    return torch.stack(images) if images else torch.zeros((0,), dtype=torch.uint8)
