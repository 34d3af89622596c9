"""NVIDIA DALI as the engine of :class:`sparkdl.ImageDecoder` (``engine="dali"``): a batch of
encoded images decoded, cropped, resized and flipped by one DALI pipeline, on the CPU (DALI's
CPU operators, no GPU needed) or on a GPU (``device="cuda"``: nvJPEG through DALI's ``mixed``
decoder, the rest on the GPU).

The crops are not DALI's own random ones: each sample's region and flip are drawn by
:meth:`ImageDecoder.region` from the sample's generator, the draws of every other engine, and
handed to the pipeline per sample (an external source). So the DALI engine keeps what the loader
promises: the same crops for the same seed whatever the workers, and a resumed epoch sees the
crops it would have seen. The pixels are DALI's resampling of those crops (its antialiased
linear filter), within a few levels of the CPU engine's.

One pipeline per decoder, output size, device and decode thread (DALI pipelines are not shared
between threads), built on first use; DALI's ``max_batch_size`` grows to the largest batch seen.
A batch DALI refuses (a corrupt file) is decoded again one image at a time, to name the sample.

A pipeline lives as long as the thread that built it: when the thread ends, the pipeline is let go
and DALI shuts its threads down. A forked child (pyspark starting its JVM, the loader's decode
processes) inherits the pipelines without their threads, and DALI's shutdown of one there hangs
or segfaults the child: so a child keeps every DALI pipeline it inherited for its whole life, and
the cyclic garbage collector (which could free one) stays off from the fork until they are kept.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sparkdl._internal.common.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["check_dali", "dali_decode_batch"]

_LOCAL = threading.local()
_LOCK = threading.Lock()
_BUILT: dict[int, dict[tuple[Any, ...], tuple[Any, int]]] = {}
"""Each live thread's pipelines (by thread id): held here too, not only by the thread, so that a
forked child, whose copies of the other threads are cleared, frees none of them."""
_KEPT_IN_CHILD: list[Any] = []
_FORK = {"hooked": False, "gc": False}
_INSTALL = "pip install nvidia-dali-cuda120 (CPU operators need no GPU; the GPU path needs CUDA 12)"


def check_dali() -> None:
    """ConfigError unless DALI imports, saying what to install."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"ImageDecoder(engine='dali') needs NVIDIA DALI ({exc}): {_INSTALL}") from None


class _ThreadEnd:
    """Kept in a thread's local storage, so freed when the thread ends: its pipelines are then let
    go (DALI shuts them down), in the process that built them, never in a forked child."""

    def __init__(self) -> None:
        self.ident, self.pid = threading.get_ident(), os.getpid()
        self.pipes: dict[tuple[Any, ...], tuple[Any, int]] = {}

    def __del__(self) -> None:
        if os.getpid() == self.pid:
            with _LOCK:
                if _BUILT.get(self.ident) is self.pipes:
                    del _BUILT[self.ident]


def _before_fork() -> None:
    _FORK["gc"] = gc.isenabled()
    gc.disable()


def _after_fork_in_parent() -> None:
    if _FORK["gc"]:
        gc.enable()


def _after_fork_in_child() -> None:
    """Keeps every DALI pipeline the child inherited (sparkdl's, anyone else's, and those only the
    cyclic collector would free) referenced until the child ends, before the collector runs again."""
    try:
        from nvidia.dali.pipeline import Pipeline

        refs = list(getattr(Pipeline, "_pipes", ()))  # DALI's registry of its live pipelines (weak)
        _KEPT_IN_CHILD.extend(p for p in (ref() for ref in refs) if p is not None)
    finally:
        if _FORK["gc"]:
            gc.enable()


def _pipes_of_this_thread() -> dict[tuple[Any, ...], tuple[Any, int]]:
    end = getattr(_LOCAL, "end", None)
    if end is None:
        end = _LOCAL.end = _ThreadEnd()
        with _LOCK:
            _BUILT[end.ident] = end.pipes
            if not _FORK["hooked"]:
                os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                                    after_in_child=_after_fork_in_child)
                _FORK["hooked"] = True
    return end.pipes


def _pipeline(size: tuple[int, int], device: str, batch: int, threads: int) -> Any:
    """This thread's pipeline for ``size`` on ``device``, for batches of up to ``batch`` (one for
    smaller batches is replaced, and shut down by DALI as it is let go)."""
    key = (size, device)
    pipes = _pipes_of_this_thread()
    built = pipes.get(key)
    if built is not None and built[1] >= batch:
        return built[0]
    import importlib

    # DALI's own annotations are narrower than its API (scalar types, argument inputs): untyped here.
    dali: Any = importlib.import_module("nvidia.dali")
    fn, types = dali.fn, dali.types

    on_gpu = device.startswith("cuda")
    device_id = (int(device.split(":")[1]) if ":" in device else 0) if on_gpu else None
    out_h, out_w = size

    @dali.pipeline_def(batch_size=batch, num_threads=threads, device_id=device_id, prefetch_queue_depth=1)
    def crops() -> Any:
        encoded = fn.external_source(name="encoded", dtype=types.UINT8)
        anchor = fn.external_source(name="anchor", dtype=types.FLOAT)  # (x, y) of each region, pixels
        shape = fn.external_source(name="shape", dtype=types.FLOAT)  # (w, h)
        flip = fn.external_source(name="flip", dtype=types.INT32)
        # adjust_orientation=False: the stored pixels, as every engine gives them; the regions
        # were drawn on the stored width and height (docs/guides/images.md, EXIF orientation).
        images = fn.decoders.image_slice(
            encoded, anchor, shape, device="mixed" if on_gpu else "cpu", output_type=types.RGB,
            axis_names="WH", normalized_anchor=False, normalized_shape=False, adjust_orientation=False,
        )
        images = fn.resize(images, resize_x=out_w, resize_y=out_h, antialias=True, dtype=types.UINT8)
        images = fn.flip(images, horizontal=flip)
        return fn.transpose(images, perm=[2, 0, 1])

    pipe = crops()
    pipe.build()
    pipes[key] = (pipe, batch)
    return pipe


def _run(pipe: Any, values: Sequence[Any], regions: Sequence[tuple[int, int, int, int, bool]],
         device: str) -> list[torch.Tensor]:
    import numpy as np
    import torch

    pipe.feed_input("encoded", [np.frombuffer(bytes(v), dtype=np.uint8) for v in values])
    pipe.feed_input("anchor", [np.array(r[:2], dtype=np.float32) for r in regions])
    pipe.feed_input("shape", [np.array(r[2:4], dtype=np.float32) for r in regions])
    pipe.feed_input("flip", [np.array(int(r[4]), dtype=np.int32) for r in regions])
    (out,) = pipe.run()
    if device.startswith("cuda"):
        from nvidia.dali.plugin.pytorch import feed_ndarray

        tensor = out.as_tensor()  # one output size: a dense [n, 3, H, W] on the GPU
        batch = torch.empty(tuple(tensor.shape()), dtype=torch.uint8, device=device)
        feed_ndarray(tensor, batch, cuda_stream=torch.cuda.current_stream(batch.device))
        return list(batch.unbind(0))
    return [torch.from_numpy(np.array(out.at(i))) for i in range(len(values))]


def _regions(decoder: Any, values: Sequence[Any], rngs: Sequence[np.random.Generator], bad_image: type[Exception]
             ) -> tuple[list[int], list[tuple[int, int, int, int, bool]], dict[int, Exception]]:
    """Which samples have a readable header, their regions, and the failures of the others. A
    function of its own: a failure kept with its traceback refers to this frame, and so keeps its
    locals until the cyclic collector runs; the pipeline is not among them."""
    good: list[int] = []
    regions = []
    bad: dict[int, Exception] = {}
    for i, value in enumerate(values):
        try:
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise bad_image(f"engine='dali' takes encoded images (a binary column), got {type(value).__name__}")
            width, height = decoder.size_of(value)
            regions.append(decoder.region(width, height, rngs[i]))
            good.append(i)
        except Exception as e:
            bad[i] = e
    return good, regions, bad


def dali_decode_batch(decoder: Any, values: Sequence[Any], rngs: Sequence[np.random.Generator], threads: int,
                      bad_image: type[Exception]) -> tuple[list[torch.Tensor | None], dict[int, Exception]]:
    """``decoder``'s batch through DALI: each sample's ``uint8 [3, H, W]`` (``None`` where it
    failed) and the failures by position, as ``bad_image`` errors. The region of every sample is
    drawn first, from its size (read from its header, without decoding) and its generator."""
    device = str(decoder.device or "cpu")
    out: list[torch.Tensor | None] = [None] * len(values)
    good, regions, bad = _regions(decoder, values, rngs, bad_image)
    if not good:
        return out, bad
    pipe = _pipeline(decoder.out_size, device, max(len(good), 1), threads)
    try:
        for i, img in zip(good, _run(pipe, [values[i] for i in good], regions, device), strict=True):
            out[i] = img
    except Exception:
        # One image DALI refuses fails the whole batch: decode them one by one to name it.
        for i, region in zip(good, regions, strict=True):
            try:
                out[i] = _run(pipe, [values[i]], [region], device)[0]
            except Exception as e:
                bad[i] = bad_image(f"DALI cannot decode the image ({type(e).__name__}: {str(e).splitlines()[0]})")
    return out, bad
