"""How TorchModel.transform decodes an image column, without a JVM: the threads each task decodes
on (from Spark's confs, or ``spark.sparkdl.ml.decodeThreads``); decoding on several threads giving
what one thread gives, with the first bad row named; the scoring path itself (an Arrow column of
real JPEGs through the decoder and the model, a chunk decoded while the model runs on the one
before) with sparkdl's decoder, the batched decoder and NVIDIA DALI, each decoding on the device
the task scores on. Scoring on the executors with several threads is in
tests/integration/test_ml_images.py."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from resources.photos import photos

from sparkdl import ConfigError, ImageDecoder
from sparkdl._internal.ml.decoding import decode_threads, decode_values, scoring_decoder
from sparkdl._internal.ml.scoring import Scorer, _score_array

GPU_EXECUTOR = {"spark.executor.cores": "8", "spark.executor.resource.gpu.amount": "1",
                "spark.task.resource.gpu.amount": "1"}


def test_a_task_decodes_on_the_cores_spark_gives_it() -> None:
    assert decode_threads({}, {}) == 1  # local[N]: one core per task
    assert decode_threads({}, {"spark.task.cpus": "4", "spark.executor.cores": "8"}) == 4
    # One GPU per executor and per task: one task at a time, and the other 7 cores would idle.
    assert decode_threads({}, GPU_EXECUTOR) == 8
    assert decode_threads({}, {**GPU_EXECUTOR, "spark.executor.resource.gpu.amount": "2"}) == 4
    # A quarter of a GPU per task: four tasks share the executor's 8 cores.
    assert decode_threads({}, {**GPU_EXECUTOR, "spark.task.resource.gpu.amount": "0.25"}) == 2
    # Cores, not GPUs, bound the tasks: spark.task.cpus.
    assert decode_threads({}, {**GPU_EXECUTOR, "spark.task.resource.gpu.amount": "0.01", "spark.task.cpus": "2"}) == 2
    # The setting wins, read from the session.
    assert decode_threads({"spark.sparkdl.ml.decodeThreads": "3"}, GPU_EXECUTOR) == 3
    for bad in ("0", "two", "-1"):
        with pytest.raises(ConfigError, match=rf"spark.sparkdl.ml.decodeThreads must be a whole number of threads.*; got '{bad}'"):
            decode_threads({"spark.sparkdl.ml.decodeThreads": bad}, {})


def test_several_threads_decode_in_row_order_and_name_the_first_bad_row() -> None:
    seen: set[int] = set()
    both = threading.Barrier(2)

    def decoder(value: Any, rng: Any) -> np.ndarray:
        seen.add(threading.get_ident())
        if value == 0:
            both.wait(timeout=20)  # passes only when another row is decoded at the same time
        if value in (13, 17):
            raise ValueError(f"bad image {value}")
        return np.full((2, 3), value, np.uint8)

    values = [*range(12), 0]  # the last row meets the first row's wait, on another thread
    one = decode_values(lambda v, rng: np.full((2, 3), v, np.uint8), values, "content")
    assert np.array_equal(decode_values(decoder, values, "content", threads=2), one)
    assert len(seen) == 2
    with pytest.raises(ConfigError, match=r"featuresDecoder failed on row 13 of a batch of featuresCol='content': "
                                          r"ValueError: bad image 13"):
        decode_values(decoder, [*range(1, 13), 1, 13, 17], "content", threads=2)


def test_a_decoder_of_whole_batches_decodes_on_the_device_the_task_scores_on() -> None:
    per_sample = ImageDecoder(32)
    assert scoring_decoder(per_sample, torch.device("cuda", 1)) is per_sample
    nvjpeg = ImageDecoder(32, device="cuda")
    assert scoring_decoder(nvjpeg, torch.device("cuda", 1)).device == "cuda:1"  # the task's GPU, not GPU 0
    # A task without a GPU: sparkdl's CPU decoder, one image at a time, the same crops.
    assert scoring_decoder(nvjpeg, torch.device("cpu")) == ImageDecoder(32)
    assert scoring_decoder(ImageDecoder(32, engine="dali", device="cuda"), torch.device("cpu")).device == "cpu"
    cpu_batches = ImageDecoder(32, device="cpu")
    assert scoring_decoder(cpu_batches, torch.device("cuda", 0)) is cpu_batches  # asked for the CPU


class MeanPixel(torch.nn.Module):
    """Each image's mean (the model's input, as floats in [0, 1]): what the decoder gave, seen by the model."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(1, 2, 3))


def _score(decoder: Any, values: list[Any], threads: int = 1) -> np.ndarray:
    scorer = Scorer(model_id="test", source=b"", task="regression", num_features=None, batch_rows=4, use_gpu=False,
                    features_col="content", vector_out=False, decoder=decoder, decode_threads=threads)
    out = _score_array(pa.array(values, pa.binary()), scorer, (MeanPixel(), torch.device("cpu"), torch.float32))
    return np.asarray(out.to_pylist())


@pytest.mark.parametrize("engine", ["sparkdl", "nvjpeg-on-a-cpu-task", "cpu-batches", "dali"])
def test_scoring_decodes_each_chunk_ahead_on_the_tasks_device_and_names_bad_rows(engine: str) -> None:
    images = list(photos(10, seed=2))
    center = ImageDecoder(24, crop="center")
    # What the model must see: each image decoded alone by sparkdl's decoder, in row order.
    expected = decode_values(center, images, "content").astype(np.float64).mean(axis=(1, 2, 3)) / 255
    if engine == "dali":
        pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed (SPARKDL_WITH_DALI=1)")
    decoder = {"sparkdl": center, "nvjpeg-on-a-cpu-task": ImageDecoder(24, crop="center", device="cuda"),
               "cpu-batches": ImageDecoder(24, crop="center", device="cpu"),
               "dali": ImageDecoder(24, crop="center", engine="dali")}[engine]
    got = _score(decoder, images, threads=2)
    assert got.shape == (10,)  # three chunks of 4, 4 and 2 rows
    if engine in ("dali", "cpu-batches"):  # another decoder's resampling of the same crops: a few levels away
        assert np.abs(got - expected).max() < 4 / 255
        assert np.abs(got - expected).max() > 0  # and not sparkdl's per-image decoder
    else:  # on this CPU-only task, nvJPEG's decoder is sparkdl's: the same pixels
        assert np.allclose(got, expected, rtol=0, atol=1e-6)
    bad = [*images[:5], images[5][:200], *images[6:]]  # row 5, the second row of the second chunk, truncated
    with pytest.raises(ConfigError, match=r"featuresDecoder failed on row 1 of a batch of featuresCol='content'"):
        _score(decoder, bad, threads=2)
