"""ImageDecoder(engine="dali"): NVIDIA DALI's CPU operators decode, crop and resize each batch, with
the regions and flips drawn as sparkdl's own decoder draws them, so the loader's promises hold
with DALI too: the same pixels for the same seed, the crops of the CPU engine, bad samples named
or skipped; and a child forked while DALI pipelines exist neither hangs nor crashes. Skipped, with the reason, where DALI is not installed (SPARKDL_WITH_DALI=0); its GPU
path is a check of tools/gpu-check."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO
from resources.photos import photos
from test_images import _bad_samples, _write

import sparkdl
from sparkdl import ConfigError, Dataset, DatasetError, ImageDecoder

pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed (tools/bootstrap.sh with SPARKDL_WITH_DALI=1)")

DALI = ImageDecoder(48, engine="dali")


@pytest.fixture(scope="module")
def photo_ds(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    return _write(tmp_path_factory.mktemp("photos"), list(photos(40, seed=4)))


def _images(loader: sparkdl._internal.data.loader.Loader) -> dict[int, torch.Tensor]:
    return {label: img for batch in loader for label, img in zip(batch["label"].tolist(), batch["content"], strict=True)}


def test_dali_batches_are_the_plain_loaders_with_the_cpu_engines_crops(photo_ds: Dataset) -> None:
    plain = [b["label"].tolist() for b in photo_ds.loader(10, seed=3)]
    runs = [list(photo_ds.loader(10, seed=3, decode={"content": DALI})) for _ in range(2)]
    assert [b["label"].tolist() for b in runs[0]] == plain
    for a, b in zip(*runs, strict=True):  # the same seed: the same pixels
        assert a["content"].dtype == torch.uint8 and a["content"].shape == (10, 3, 48, 48)
        assert torch.equal(a["content"], b["content"])
    # The same regions and flips as sparkdl's decoder: each image is close to the CPU engine's
    # (DALI resamples the crop its own way), and much closer than to its mirror image.
    cpu = _images(photo_ds.loader(10, seed=3, decode={"content": ImageDecoder(48)}))
    dali = {label: img for batch in runs[0] for label, img in zip(batch["label"].tolist(), batch["content"], strict=True)}
    for label, img in dali.items():
        ref = cpu[label].float()
        near = (img.float() - ref).abs().mean()
        assert near < 12, (label, float(near))
        if not torch.equal(ref, ref.flip(-1)):
            assert near < (img.float() - ref.flip(-1)).abs().mean()


def test_dali_names_bad_samples_or_skips_them(tmp_path: Path) -> None:
    contents: list[bytes | None] = list(photos(24, seed=2))
    for i, data in _bad_samples().items():
        contents[i] = data
    ds = _write(tmp_path / "bad", contents, files=1)
    with pytest.raises(DatasetError, match=r"row 20 \(row 20 of part-0.parquet, path=.*not an image in a format sparkdl decodes"):
        list(ds.loader(8, shuffle=False, decode={"content": DALI}, rank=1, world_size=2))
    # A file cut short (row 5) is named by DALI itself, decoding the batch again image by image.
    with pytest.raises(DatasetError, match=r"row 5 \(row 5 of part-0.parquet, path=.*DALI cannot decode the image"):
        list(ds.loader(8, shuffle=False, decode={"content": DALI}))
    loader = ds.loader(8, shuffle=False, decode={"content": DALI}, on_bad_sample="skip")
    labels = [label for b in loader for label in b["label"].tolist()]
    assert labels == [i for i in range(24) if i not in (5, 11, 20)] and len(loader) == 3 and loader.skipped == 3


def test_dali_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"ImageDecoder.engine must be None .*'dali'; got 'opencv'"):
        ImageDecoder(engine="opencv")
    # DALI decodes batches: on the CPU unless a GPU is named; a decoder with a GPU keeps it.
    assert DALI.batched and DALI.device == "cpu"
    assert ImageDecoder(engine="dali", device="cuda:1").device == "cuda:1"
    out, bad = DALI.decode_batch([{"data": b""}], [np.random.default_rng(0)])
    assert out == [None] and isinstance(bad[0], sparkdl._internal.data.decoding.images.BadImage)
    assert "engine='dali' takes encoded images (a binary column), got dict" in str(bad[0])


FORKS = r"""
import gc, multiprocessing, subprocess, sys, threading
import numpy as np
from nvidia.dali.pipeline import Pipeline
from resources.photos import photos
from sparkdl import ImageDecoder

decoder = ImageDecoder(32, engine="dali")
images, rngs = photos(4), [np.random.default_rng(i) for i in range(4)]
# A pipeline that only the cyclic collector would free (a thread that used it ended; a traceback
# kept a frame that referred to it), when a child is forked as pyspark starts its JVM: its
# preexec_fn runs Python in the child, where the collector may run.
gc.disable()
def used_then_kept_in_a_cycle():
    decoder.decode_batch(images, rngs)
    cycle = [[ref() for ref in Pipeline._pipes]]
    cycle.append(cycle)
thread = threading.Thread(target=used_then_kept_in_a_cycle)
thread.start(); thread.join()
assert any(ref() is not None for ref in Pipeline._pipes), "no pipeline awaits the collector"
child = subprocess.Popen([sys.executable, "-c", "pass"], preexec_fn=gc.collect)
print("preexec", child.wait(), flush=True)
gc.enable(); gc.collect()
# A pipeline in use by a live decode thread when a child is forked (the loader's decode
# processes): the child clears its copy of that thread, and collects.
ready, finish = threading.Event(), threading.Event()
def decoding():
    decoder.decode_batch(images, rngs); ready.set(); finish.wait()
thread = threading.Thread(target=decoding)
thread.start(); ready.wait()
worker = multiprocessing.get_context("fork").Process(target=gc.collect)
worker.start(); worker.join()
print("fork", worker.exitcode, flush=True)
finish.set(); thread.join()
# The thread that built it has ended: the pipeline is let go in the parent.
gc.collect()
print("left", sum(ref() is not None for ref in Pipeline._pipes), flush=True)
"""


def test_children_forked_while_dali_pipelines_exist_neither_hang_nor_crash() -> None:
    """A child that inherits a DALI pipeline must never shut it down: DALI's threads are not in the
    child, and its shutdown there hung or segfaulted (CI: pyspark's JVM launch died in its
    preexec_fn when the collector freed a pipeline left from a bad-sample test)."""
    proc = subprocess.Popen([sys.executable, "-c", FORKS], cwd=REPO / "tests", stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and the child it waits for
        out, _ = proc.communicate()
        pytest.fail(f"a forked child hung:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    lines = out.splitlines()
    assert "preexec 0" in lines and "fork 0" in lines and "left 0" in lines, out[-3000:]


def test_dali_keeps_the_stored_orientation_of_an_exif_rotated_photo_like_the_cpu_engine() -> None:
    """One rule for every engine: EXIF orientation is not applied (DALI applies it by default)."""
    from test_image_inputs import _rotated_jpeg

    data = _rotated_jpeg()  # 40 x 20 stored, red left and blue right, tagged to be shown turned
    decoder = ImageDecoder((10, 20), crop="full", flip=False, engine="dali")
    out, bad = decoder.decode_batch([data], [np.random.default_rng(0)])
    assert not bad and out[0] is not None and tuple(out[0].shape) == (3, 10, 20)
    cpu = ImageDecoder((10, 20), crop="full", flip=False)(data, np.random.default_rng(0))
    assert (out[0].float() - torch.from_numpy(cpu).float()).abs().mean() < 6
    assert out[0][0, :, :8].float().mean() > 180 and out[0][2, :, 12:].float().mean() > 180
