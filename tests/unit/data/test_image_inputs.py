"""Inputs that must not take a rank down (issue 54): image files in formats sparkdl does not
decode are refused by name before any decoder of theirs runs; integer and float pixels are mapped
or refused, never silently black; EXIF orientation follows one rule on every engine; and the
batched path's memory is bounded by its canvas budget, not by the tallest times the widest
photo of the batch."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from sparkdl import ImageDecoder
from sparkdl._internal.data.decoding.image_batches import CANVAS_BYTES, canvas_chunks, crop_batch
from sparkdl._internal.data.decoding.image_files import FORMATS, BadImage

FULL = ImageDecoder((8, 12), crop="full", flip=False)


def _saved(im: Image.Image, fmt: str, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"])
def test_the_listed_formats_decode(fmt: str) -> None:
    out = FULL(_saved(Image.new("RGB", (24, 16), (200, 30, 60)), fmt), np.random.default_rng(0))
    assert out.shape == (3, 8, 12) and fmt in FORMATS


@pytest.mark.parametrize(("fmt", "name"), [("EPS", "EPS"), ("PDF", "PDF"), ("ICO", "ICO"), ("PPM", "PPM")])
def test_other_formats_pillow_knows_are_refused_by_name_unopened(fmt: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from PIL import EpsImagePlugin

    data = _saved(Image.new("RGB", (24, 16), (1, 2, 3)), fmt)
    # Opening an EPS would parse it with Pillow's EPS plugin, and decoding it runs Ghostscript.
    def no_ghostscript(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Ghostscript was started")

    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", no_ghostscript)
    monkeypatch.setattr(EpsImagePlugin.EpsImageFile, "_open", no_ghostscript)
    with pytest.raises(BadImage, match=rf"a .*{name}.* file, which sparkdl does not decode \(only JPEG, PNG, WEBP"):
        FULL(data, np.random.default_rng(0))
    with pytest.raises(BadImage, match="does not decode"):
        FULL.size_of(data)


def test_sixteen_bit_gray_maps_by_its_top_byte_and_wider_integers_are_refused_by_name() -> None:
    ramp = (np.arange(16 * 24, dtype=np.uint32).reshape(16, 24) * 170).astype(np.uint16)  # 0 .. 65110
    out = FULL(_saved(Image.fromarray(ramp), "PNG"), np.random.default_rng(0))
    assert out.max() >= 230 and out.min() <= 20, "a 16-bit ramp must span the 8-bit range"
    # An 8-bit-valued image stored as 32-bit integers: dividing by 256 gave all black before.
    small = Image.fromarray(np.full((16, 24), 200, dtype=np.int32))
    with pytest.raises(BadImage, match=r"32-bit integer TIFF image \(Pillow mode I\).*no range"):
        FULL(_saved(small, "TIFF"), np.random.default_rng(0))
    with pytest.raises(BadImage, match=r"32-bit float TIFF image \(Pillow mode F\)"):
        FULL(_saved(Image.fromarray(np.full((16, 24), 0.5, dtype=np.float32)), "TIFF"), np.random.default_rng(0))


def _rotated_jpeg() -> bytes:
    """A 40 x 20 photo (left half red, right half blue) tagged EXIF orientation 6 (shown turned 90 degrees)."""
    pixels = np.zeros((20, 40, 3), np.uint8)
    pixels[:, :20] = (220, 20, 20)
    pixels[:, 20:] = (20, 20, 220)
    exif = Image.Exif()
    exif[0x0112] = 6
    return _saved(Image.fromarray(pixels), "JPEG", quality=100, exif=exif.tobytes())


def test_exif_orientation_is_not_applied_regions_and_pixels_are_the_stored_ones() -> None:
    data = _rotated_jpeg()
    dec = ImageDecoder((10, 20), crop="full", flip=False)
    assert dec.size_of(data) == (40, 20)  # the stored width and height, on which regions are drawn
    out = dec(data, np.random.default_rng(0)).astype(int)
    assert out.shape == (3, 10, 20)
    assert out[0, :, :8].mean() > 180 and out[2, :, :8].mean() < 60  # red stays on the left
    assert out[2, :, 12:].mean() > 180 and out[0, :, 12:].mean() < 60
    # The batched path (nvJPEG's on GPUs; here the same code on the CPU) gives the same.
    batched, bad = ImageDecoder((10, 20), crop="full", flip=False, device="cpu").decode_batch([data], [np.random.default_rng(0)])
    assert not bad and (batched[0].int() - torch.from_numpy(out)).abs().float().mean() < 3


def test_canvases_hold_at_most_the_budget_and_a_larger_region_goes_alone() -> None:
    assert canvas_chunks([(10, 10)] * 4, 4, 3 * 11 * 11 * 4 * 2) == [(0, 2), (2, 4)]
    assert canvas_chunks([(10, 10), (1000, 1000), (10, 10)], 4, 10**6) == [(0, 1), (1, 2), (2, 3)]
    assert canvas_chunks([(5, 5), (6, 4), (4, 6)], 2, 10**9) == [(0, 3)]
    assert canvas_chunks([], 4, 100) == []


def test_one_tall_and_one_wide_photo_never_make_a_tallest_by_widest_canvas() -> None:
    """Before, the canvas was n x 3 x (tallest + 1) x (widest + 1) for the whole batch: 16 photos
    with one 4000 x 300 and one 300 x 4000 among them asked for 16 x 3 x 4001 x 4001 floats (3 GB).
    Now each photo is cut to its region first, and canvases hold at most CANVAS_BYTES."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(300, 4000), (4000, 300)] + [(48, 64)] * 14
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=gen) for h, w in shapes]
    rng = np.random.default_rng(1)
    dec = ImageDecoder(32)
    regions = [dec.region(int(i.shape[2]), int(i.shape[1]), rng) for i in images]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = crop_batch(images, regions, (32, 32))
    largest = max((e.cpu_memory_usage for e in prof.events()), default=0)
    assert 0 < largest <= CANVAS_BYTES, f"an allocation of {largest / 2**20:.0f} MiB"
    assert largest < 16 * 3 * 4001 * 4001 * 4 / 50
    # The same pixels as from one canvas for the whole batch (a budget that holds it all).
    whole = crop_batch(images, regions, (32, 32), budget=2**40)
    for got, one in zip(out, whole, strict=True):
        assert isinstance(got, torch.Tensor) and isinstance(one, torch.Tensor) and got.shape == (3, 32, 32)
        assert (got.int() - one.int()).abs().max() <= 1


def test_a_region_the_device_cannot_hold_is_a_bad_sample_not_a_failed_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    import sparkdl._internal.data.decoding.image_batches as batches

    real = batches._crop_canvas

    def short_of_memory(images: list[torch.Tensor], regions: Any, size: Any, k: int) -> torch.Tensor:
        if any(int(i.shape[2]) > 1000 for i in images):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 34.00 GiB")
        return real(images, regions, size, k)

    monkeypatch.setattr(batches, "_crop_canvas", short_of_memory)
    big = _saved(Image.new("RGB", (3000, 20), (9, 9, 9)), "PNG")
    small = _saved(Image.new("RGB", (30, 20), (9, 9, 9)), "PNG")
    out, bad = ImageDecoder(16, crop="full", device="cpu").decode_batch([small, big, small], [np.random.default_rng(i) for i in range(3)])
    assert list(bad) == [1] and out[1] is None and out[0] is not None and out[2] is not None
    assert isinstance(bad[1], BadImage) and "lower ImageDecoder(max_pixels=...)" in str(bad[1])
