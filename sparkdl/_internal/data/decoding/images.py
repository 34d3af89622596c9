"""Images: decode and augment an image column, sample by sample, deterministically.

:class:`ImageDecoder` is a per-sample function for ``ds.loader(..., decode={column: ...})``: it
takes one image's encoded bytes (JPEG, PNG, anything Pillow reads; or a row of Spark's ``image``
source, whose struct holds raw BGR pixels) and the sample's own random generator, and returns a
``uint8`` array ``[3, height, width]`` (RGB). The loader stacks a batch of them into one
``uint8`` tensor ``[batch, 3, height, width]``: bytes stay bytes until the GPU, where the model's
first step converts and normalizes them.

Augmentation (``crop="random"``) is the usual one for training image classifiers: a random
region of ``scale`` of the image's area and ``ratio`` aspect is cut out and resized to ``size``,
then flipped left-right with probability 1/2 (``flip``). ``crop="center"`` (evaluation) takes
the central region of ``center_fraction`` of the shorter side, with the output's aspect;
``crop="full"`` resizes the whole image. Resizing is bilinear with antialiasing (torch's uint8
kernel, which gives Pillow's result to within a level in a third of Pillow's time).

Where the time goes, and what is done about it: JPEG decoding. A JPEG is decoded at 1/2, 1/4 or
1/8 of its size (libjpeg's scaling in the DCT domain, Pillow's ``draft``) whenever the region to
be cut out still has at least the output's pixels at that scale, so a 4 MP photo cropped to 224
is never decoded at full size. Pillow lets go of the GIL while it decodes and resizes, so the
loader's decode threads run on every core.

On a GPU (``device="cuda"``), a batch of JPEGs is decoded at once with nvJPEG
(``torchvision.io.decode_jpeg(..., device="cuda")``) and cropped, resized and flipped there, with
the same random draws; other formats are decoded on the CPU and moved.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparkdl._internal.common.validate import invalid
from sparkdl._internal.data.decoding.image_files import BadImage, open_encoded, rgb, spark_image

if TYPE_CHECKING:
    import numpy as np
    import torch

CROPS = ("random", "center", "full")
PILLOW_MAX_PIXELS = 89_478_485
"""Pillow's own limit (``Image.MAX_IMAGE_PIXELS``), this decoder's default ``max_pixels``."""


@dataclass(frozen=True)
class ImageDecoder:
    """Decodes an image column to ``uint8 [3, H, W]`` RGB, with random crops and flips per sample.

    Example::

        loader = ds.loader(64, decode={"content": sparkdl.ImageDecoder(224)}, seed=3)
        for batch in loader:
            x = batch["content"].to(device).float().div_(255)   # [64, 3, 224, 224]

    Args:
        size: the output's side, or ``(height, width)``.
        crop: ``"random"`` (train), ``"center"`` (evaluate) or ``"full"`` (no crop).
        scale: with ``"random"``, the crop's share of the image's area, ``(low, high)``.
        ratio: with ``"random"``, the crop's aspect ratio (width / height), ``(low, high)``.
        flip: with ``"random"``, flip left-right with probability 1/2.
        center_fraction: with ``"center"``, the crop's share of the image's shorter side.
        max_pixels: images of more pixels than this are refused (decompression bombs).
        device: ``"cuda"`` (or ``"cuda:N"``) to decode JPEGs with nvJPEG on that GPU and crop
            them there, a batch at a time; ``"cpu"``: the same batched path on the CPU (Pillow
            decodes); ``None`` (the default): one image at a time on the loader's decode workers.
        engine: ``None`` (the default): sparkdl's decoders above; ``"dali"``: NVIDIA DALI decodes,
            crops and resizes each batch (on the CPU, or on ``device="cuda"`` with nvJPEG), with
            the regions and flips drawn as every engine draws them. In ``TorchModel.transform``
            a decoder with ``device="cuda"`` decodes on the task's GPU, and on a task without
            one, DALI on the CPU and nvJPEG's decoder as sparkdl's CPU decoder.

    Raises:
        ConfigError: a setting is out of range.
    """

    size: int | tuple[int, int] = 224
    crop: str = "random"
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = True
    center_fraction: float = 0.875
    max_pixels: int = PILLOW_MAX_PIXELS
    device: str | None = None
    engine: str | None = None

    def __post_init__(self) -> None:
        h, w = self.out_size
        if h < 1 or w < 1:
            raise invalid("ImageDecoder.size", self.size, "a positive side, or (height, width)")
        if self.crop not in CROPS:
            raise invalid("ImageDecoder.crop", self.crop, f"one of {', '.join(map(repr, CROPS))}")
        lo, hi = self.scale
        if not 0 < lo <= hi <= 1:
            raise invalid("ImageDecoder.scale", self.scale, "(low, high) with 0 < low <= high <= 1")
        lo, hi = self.ratio
        if not 0 < lo <= hi:
            raise invalid("ImageDecoder.ratio", self.ratio, "(low, high) with 0 < low <= high")
        if not 0 < self.center_fraction <= 1:
            raise invalid("ImageDecoder.center_fraction", self.center_fraction, "a fraction in (0, 1]")
        if self.max_pixels < 1:
            raise invalid("ImageDecoder.max_pixels", self.max_pixels, "a positive pixel count")
        if self.device is not None and not str(self.device).startswith(("cuda", "cpu")):
            raise invalid("ImageDecoder.device", self.device, "'cuda', 'cuda:N', 'cpu' or None")
        if self.engine not in (None, "dali"):
            raise invalid("ImageDecoder.engine", self.engine, "None (sparkdl's own) or 'dali'")
        if self.engine == "dali" and self.device is None:
            object.__setattr__(self, "device", "cpu")  # DALI decodes batches: on the CPU unless told

    @property
    def out_size(self) -> tuple[int, int]:
        """``(height, width)`` of every output."""
        s = self.size
        return (int(s), int(s)) if isinstance(s, int) else (int(s[0]), int(s[1]))

    def for_eval(self) -> ImageDecoder:
        """This decoder without random draws, for validation and scoring: a random crop becomes
        the center crop (of ``center_fraction``), at the same size; other crops are kept."""
        return dataclasses.replace(self, crop="center") if self.crop == "random" else self

    @property
    def batched(self) -> bool:
        """Whether whole batches are decoded at once, on ``device`` (in the loader's reader thread)."""
        return self.device is not None

    # -- the random draws, the same on every engine ------------------------------------------------

    def region(self, width: int, height: int, rng: np.random.Generator) -> tuple[int, int, int, int, bool]:
        """The region ``(x, y, w, h)`` of a ``width`` x ``height`` image to cut out, and whether to
        flip it: drawn from ``rng`` (always the same draws for the same generator)."""
        out_h, out_w = self.out_size
        if self.crop == "full":
            return 0, 0, width, height, False
        if self.crop == "center":
            side = self.center_fraction * min(width, height)
            w = max(1, min(width, round(side * min(1.0, out_w / out_h))))
            h = max(1, min(height, round(side * min(1.0, out_h / out_w))))
            return (width - w) // 2, (height - h) // 2, w, h, False
        area = width * height
        lo, hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        draws = rng.random((10, 4))
        for a, r, px, py in draws:
            target = area * (self.scale[0] + a * (self.scale[1] - self.scale[0]))
            aspect = math.exp(lo + r * (hi - lo))
            w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                x, y = int(px * (width - w + 1)), int(py * (height - h + 1))
                return x, y, w, h, self._flip(rng)
        # Ten misses (an image far from the ratios): the central region of the nearest ratio.
        aspect = min(max(width / height, self.ratio[0]), self.ratio[1])
        w, h = (width, round(width / aspect)) if width / height < aspect else (round(height * aspect), height)
        w, h = max(1, min(w, width)), max(1, min(h, height))
        return (width - w) // 2, (height - h) // 2, w, h, self._flip(rng)

    def _flip(self, rng: np.random.Generator) -> bool:
        return bool(self.flip and rng.random() < 0.5)

    # -- the CPU engine: simplejpeg (libjpeg-turbo) for JPEGs, Pillow for the rest ------------------

    def __call__(self, value: Any, rng: np.random.Generator) -> np.ndarray:
        """One image (encoded bytes, or a Spark ``image`` struct as a dict) as ``uint8 [3, H, W]``."""
        header = _jpeg_header(value)
        if header is not None:
            height, width = header
            self._check_pixels(width, height)
            x, y, w, h, flip = self.region(width, height, rng)
            pixels = _decode_jpeg(value, width, height, self._dct_scale(w, h))
        else:
            im = self._open(value)
            width, height = im.size
            x, y, w, h, flip = self.region(width, height, rng)
            s = self._dct_scale(w, h)
            if im.format == "JPEG" and s > 1:  # a JPEG simplejpeg cannot take (CMYK), or no simplejpeg
                im.draft("RGB", (max(1, width // s), max(1, height // s)))
            pixels = self._pixels(im)  # [h, w, 3], at the draft's scale
        fx, fy = width / pixels.shape[1], height / pixels.shape[0]
        x0, y0 = int(x / fx), int(y / fy)
        x1 = max(x0 + 1, min(pixels.shape[1], round((x + w) / fx)))
        y1 = max(y0 + 1, min(pixels.shape[0], round((y + h) / fy)))
        return _resized(pixels[y0:y1, x0:x1], self.out_size, flip)

    def _dct_scale(self, w: int, h: int) -> int:
        """1, 2, 4 or 8: the most a JPEG can be shrunk while decoding (in the DCT domain) while
        the region still has at least the output's pixels."""
        out_h, out_w = self.out_size
        s = 1
        while s < 8 and w >= 2 * s * out_w and h >= 2 * s * out_h:
            s *= 2
        return s

    def _check_pixels(self, width: int, height: int) -> None:
        if width * height > self.max_pixels:
            raise BadImage(
                f"{width} x {height} = {width * height} pixels is more than max_pixels={self.max_pixels} "
                "(a decompression bomb?); raise ImageDecoder(max_pixels=...) if such images are expected"
            )

    def _pixels(self, im: Any) -> np.ndarray:
        import numpy as np

        try:
            return np.array(rgb(im))  # a writable copy: torch refuses to wrap read-only memory quietly
        except Exception as e:
            raise BadImage(f"cannot decode the image ({type(e).__name__}: {e})") from e

    def size_of(self, value: Any) -> tuple[int, int]:
        """``(width, height)`` of an encoded image, read from its header without decoding it.

        Raises:
            ValueError: the value is not an image, or has more than ``max_pixels`` pixels.
        """
        header = _jpeg_header(value)
        if header is not None:
            self._check_pixels(header[1], header[0])
            return header[1], header[0]
        width, height = self._open(value).size
        return int(width), int(height)

    def _open(self, value: Any) -> Any:
        if isinstance(value, Mapping):
            return spark_image(value, self.max_pixels)
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise BadImage(f"expected the image's bytes (a binary column), got {type(value).__name__}")
        if len(value) == 0:
            raise BadImage("the image is empty (0 bytes)")
        im = open_encoded(value)
        self._check_pixels(*im.size)
        return im

    # -- the GPU engine: nvJPEG through torchvision --------------------------------------------------

    def decode_batch(
        self, values: Sequence[Any], rngs: Sequence[np.random.Generator]
    ) -> tuple[list[torch.Tensor | None], dict[int, Exception]]:
        """A batch decoded on ``device``: each sample's ``uint8 [3, H, W]`` tensor there (``None``
        where it failed) and the failures by position. On CUDA, JPEGs go through nvJPEG together;
        other images (and every image on the CPU) through Pillow, then to the device. The crops,
        resizes and flips of the whole batch are a few sampling passes over canvases of bounded size
        (:func:`sparkdl._internal.data.decoding.image_batches.crop_batch`)."""
        import torch

        from sparkdl._internal.data.decoding.image_batches import crop_batch, nvjpeg

        if self.engine == "dali":
            from sparkdl._internal.data.decoding.dali_engine import check_dali, dali_decode_batch
            from sparkdl._internal.data.decoding.samples import default_workers

            check_dali()
            return dali_decode_batch(self, values, rngs, default_workers(), BadImage)
        device = torch.device(self.device or "cuda")
        images: list[torch.Tensor | None] = [None] * len(values)
        bad: dict[int, Exception] = {}
        jpegs = []
        for i, v in enumerate(values):
            try:
                header = _jpeg_header(v) if device.type == "cuda" else None
                if header is not None:
                    self._check_pixels(header[1], header[0])
                    jpegs.append(i)
                else:
                    images[i] = torch.from_numpy(self._decoded(self._open(v))).to(device)
            except Exception as e:
                bad[i] = e
        if jpegs:
            for i, img in zip(jpegs, nvjpeg([values[i] for i in jpegs], device), strict=True):
                if isinstance(img, Exception):
                    bad[i] = BadImage(f"nvJPEG cannot decode the image ({type(img).__name__}: {img})")
                else:
                    images[i] = img
        done = [i for i, img in enumerate(images) if img is not None]
        out: list[torch.Tensor | None] = [None] * len(values)
        if done:
            regions = [self.region(int(images[i].shape[2]), int(images[i].shape[1]), rngs[i])  # type: ignore[union-attr]
                       for i in done]
            cropped = crop_batch([images[i] for i in done], regions, self.out_size)  # type: ignore[misc]
            for i, img in zip(done, cropped, strict=True):
                if isinstance(img, Exception):
                    bad[i] = BadImage(str(img))
                else:
                    out[i] = img
        return out, bad

    def _decoded(self, im: Any) -> np.ndarray:
        import numpy as np

        return np.ascontiguousarray(self._pixels(im).transpose(2, 0, 1))


@functools.cache  # asked once per JPEG: a missing module would be searched for on every image
def _simplejpeg() -> Any:
    try:
        import simplejpeg
    except ImportError:  # sparkdl[images] brings it; without it Pillow decodes JPEGs too
        return None
    return simplejpeg


def _jpeg_header(value: Any) -> tuple[int, int] | None:
    """``(height, width)`` of a JPEG that simplejpeg decodes (YCbCr or gray), else None."""
    if not isinstance(value, (bytes, bytearray, memoryview)) or bytes(value[:2]) != b"\xff\xd8":
        return None
    simplejpeg = _simplejpeg()
    if simplejpeg is None:
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(value)
    except Exception:  # Pillow then reads it, or names what is wrong with it
        return None
    return (int(height), int(width)) if colorspace in ("YCbCr", "Gray") else None


def _decode_jpeg(value: Any, width: int, height: int, scale: int) -> np.ndarray:
    """A JPEG as ``uint8 [h, w, 3]``, shrunk ``scale`` times while decoding. simplejpeg lets go of
    the GIL for the whole decode and writes RGB numpy directly (Pillow holds the GIL while it
    turns its own 4-byte pixels into an array: on 16 cores that capped decoding at ~1,200
    images/s, against ~4,200 this way, measured)."""
    import simplejpeg

    try:
        if scale == 1:
            return simplejpeg.decode_jpeg(value, colorspace="RGB")
        return simplejpeg.decode_jpeg(value, colorspace="RGB", min_width=max(1, width // scale),
                                      min_height=max(1, height // scale))
    except Exception as e:
        raise BadImage(f"cannot decode the JPEG ({type(e).__name__}: {e})") from None


def _resized(hwc: np.ndarray, size: tuple[int, int], flip: bool) -> np.ndarray:
    """``hwc`` resized to ``size`` (bilinear, antialiased: torch's uint8 kernel, which matches
    Pillow's to within a level and takes a third of its time), flipped, as ``[3, H, W]``."""
    import torch
    import torch.nn.functional as F

    t = torch.from_numpy(hwc).permute(2, 0, 1)[None]  # channels-last memory, as torch's fast path wants
    if t.shape[-2:] != size:
        t = F.interpolate(t, size=size, mode="bilinear", antialias=True, align_corners=False)
    t = t[0]
    return (t.flip(-1) if flip else t).contiguous().numpy()


__all__ = ["PILLOW_MAX_PIXELS", "BadImage", "ImageDecoder"]
