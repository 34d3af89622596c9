"""A batch of images at once, on a device: nvJPEG decoding and one sampling pass that crops,
resizes and flips every image of the batch (:meth:`sparkdl.ImageDecoder.decode_batch`)."""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MAX_SUPERSAMPLING = 4
"""Without torchvision, the batched path averages at most 4 x 4 samples per output pixel: crops
shrunk more than 4 times alias a little, where the per-sample path's filter would not."""


def crop_batch(images: list[torch.Tensor], regions: list[tuple[int, int, int, int, bool]],
                size: tuple[int, int]) -> torch.Tensor:
    """The regions ``(x, y, w, h, flip)`` of ``images`` (``uint8 [3, h, w]`` each, one device),
    resized to ``size`` and flipped, as one ``uint8 [n, 3, H, W]`` tensor, in a few kernels for
    the whole batch: the images are laid on one canvas (each with a copy of its last row and
    column beside it, so that no sample reaches the padding), and each output pixel averages
    bilinear samples spread over its area: torchvision's ``roi_align`` (as many samples per
    pixel as the region is larger than the output), or, without torchvision, ``grid_sample``
    at ``k x k`` samples per pixel and an average. Measured on an H200, 128 photos: 0.6 ms for
    ``roi_align``, 5.7 ms for one ``interpolate`` per image, 8 ms for ``grid_sample``."""
    import torch

    n, (out_h, out_w) = len(images), size
    device = images[0].device
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    heights = [int(img.shape[1]) for img in images]
    widths = [int(img.shape[2]) for img in images]
    H, W = max(heights) + 1, max(widths) + 1
    canvas = torch.empty((n, 3, H, W), dtype=dtype, device=device)
    for i, img in enumerate(images):
        h, w = heights[i], widths[i]
        canvas[i, :, :h, :w].copy_(img)
        canvas[i, :, :h, w].copy_(img[:, :, -1])
        canvas[i, :, h, : w + 1].copy_(canvas[i, :, h - 1, : w + 1])
    try:
        from torchvision.ops import roi_align
    except ImportError:
        out = _grid_sampled(canvas, regions, size)
    else:
        boxes = torch.tensor([[i, x, y, x + w, y + h] for i, (x, y, w, h, _) in enumerate(regions)], dtype=dtype)
        out = roi_align(canvas, boxes.to(device), output_size=(out_h, out_w), spatial_scale=1.0,
                        sampling_ratio=-1, aligned=True)
        flips = [i for i, r in enumerate(regions) if r[4]]
        if flips:
            at = torch.tensor(flips, device=device)
            out[at] = out[at].flip(-1)
    return out.round_().clamp_(0, 255).to(torch.uint8)


def _grid_sampled(canvas: torch.Tensor, regions: list[tuple[int, int, int, int, bool]],
                  size: tuple[int, int]) -> torch.Tensor:
    import torch
    import torch.nn.functional as F

    n, H, W = canvas.shape[0], canvas.shape[2], canvas.shape[3]
    out_h, out_w = size
    k = max(1, min(MAX_SUPERSAMPLING, math.ceil(max(max(w / out_w, h / out_h) for _, _, w, h, _ in regions))))
    # Coordinates in [-1, 1] of the canvas (align_corners=False: -1 is the left edge of pixel 0):
    # output coordinate t in [-1, 1] maps to x + (t + 1) / 2 * w pixels, mirrored when flipped.
    theta = torch.zeros((n, 2, 3), dtype=torch.float32)
    for i, (x, y, w, h, flip) in enumerate(regions):
        theta[i, 0, 0] = (-w if flip else w) / W
        theta[i, 0, 2] = (2 * x + w) / W - 1
        theta[i, 1, 1] = h / H
        theta[i, 1, 2] = (2 * y + h) / H - 1
    grid = F.affine_grid(theta.to(canvas.device), [n, 3, out_h * k, out_w * k], align_corners=False)
    out = F.grid_sample(canvas, grid.to(canvas.dtype), mode="bilinear", padding_mode="border", align_corners=False)
    return F.avg_pool2d(out, k) if k > 1 else out


def nvjpeg(data: list[Any], device: torch.device) -> list[Any]:
    """JPEGs decoded together on ``device`` (``uint8 [3, h, w]`` each); when the batch fails, each
    is decoded alone, and one that still fails is given as its exception."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data]
    with contextlib.suppress(Exception):
        return list(decode_jpeg(tensors, mode=ImageReadMode.RGB, device=device))
    out: list[Any] = []
    for t in tensors:
        try:
            out.append(decode_jpeg(t, mode=ImageReadMode.RGB, device=device))
        except Exception as e:
            out.append(e)
    return out


__all__ = ["MAX_SUPERSAMPLING", "crop_batch", "nvjpeg"]
