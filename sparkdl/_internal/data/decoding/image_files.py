"""Images as files: the formats sparkdl opens (and the ones it refuses by name), Pillow's modes
made RGB, and Spark's ``image`` struct; for :mod:`sparkdl._internal.data.decoding.images`."""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any


class BadImage(ValueError):
    """An image that cannot be decoded; the loader names its row and column."""


FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
"""The formats sparkdl decodes (Pillow's names; a camera's MPO, a JPEG with extra frames, opens
as JPEG and its first frame is decoded). Anything else Pillow could open (EPS, which runs
Ghostscript; PDF; PSD; ICO; ...) is refused by name: a column of photos holds no such files by
accident."""
# Leading bytes of formats that are refused, to name them in the error.
_KNOWN = ((b"%!PS", "PostScript/EPS"), (b"\xc5\xd0\xd3\xc6", "EPS"), (b"%PDF", "PDF"), (b"8BPS", "PSD"),
          (b"\x00\x00\x01\x00", "ICO"), (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"), (b"\xffO\xffQ", "JPEG 2000"),
          (b"P1", "PBM"), (b"P2", "PGM"), (b"P3", "PPM"), (b"P4", "PBM"), (b"P5", "PGM"), (b"P6", "PPM"))


def open_encoded(value: Any) -> Any:
    """``value``'s bytes opened by Pillow (not yet decoded), in one of :data:`FORMATS`, or a
    :class:`BadImage` naming what it is instead."""
    from PIL import Image

    try:
        return Image.open(io.BytesIO(value), formats=FORMATS)
    except Image.DecompressionBombError as e:
        raise BadImage(f"{e}; raise ImageDecoder(max_pixels=...) if such images are expected") from None
    except Exception as e:
        head = bytes(value[:12])
        kind = next((name for magic, name in _KNOWN if head.startswith(magic)), None)
        if kind is not None:
            raise BadImage(f"a {kind} file, which sparkdl does not decode (only {', '.join(FORMATS)}): "
                           "convert such files to one of those first") from None
        raise BadImage(f"not an image in a format sparkdl decodes ({', '.join(FORMATS)}; "
                       f"{type(e).__name__}: {e})") from None


def rgb(im: Any) -> Any:
    """The image as RGB (decodes it): alpha is dropped, grayscale and CMYK converted, 16-bit gray
    mapped to 8 bits by its top byte; 32-bit integer and float images, whose range no header
    states, are refused by name."""
    im.load()
    if im.mode == "RGB":
        return im
    # 16-bit gray: Pillow's "I;16*" modes, and "I" for a PNG (whose gray is at most 16 bits;
    # Pillow before 10 opened 16-bit PNGs as "I").
    if im.mode.startswith("I;16") or (im.mode == "I" and im.format == "PNG"):
        import numpy as np
        from PIL import Image

        wide = np.asarray(im).astype(np.int64)
        im = Image.fromarray(np.clip(wide >> 8, 0, 255).astype(np.uint8))
    elif im.mode in ("I", "F"):
        kind = "32-bit integer" if im.mode == "I" else "32-bit float"
        raise BadImage(
            f"a {kind} {im.format or ''} image (Pillow mode {im.mode}): its values have no range sparkdl "
            "could map to 8 bits without guessing (the black or white images this used to give); write it "
            "as 8 or 16 bits, or decode it with a function of your own that knows its range"
        )
    return im.convert("RGB")


def spark_image(value: Mapping[str, Any], max_pixels: int) -> Any:
    """A row of Spark's ``image`` source (``height``, ``width``, ``nChannels``, ``mode``, ``data``:
    raw pixels, BGR or BGRA, 8 bits) as a Pillow RGB image."""
    from PIL import Image

    try:
        h, w, c, data = int(value["height"]), int(value["width"]), int(value["nChannels"]), value["data"]
    except (KeyError, TypeError, ValueError) as e:
        raise BadImage(f"not a Spark image struct (height, width, nChannels, data): {e}") from None
    if h < 1 or w < 1 or data is None:
        raise BadImage(f"Spark could not read this image (height={h}, width={w}); its origin is {value.get('origin')!r}")
    if w * h > max_pixels:
        raise BadImage(f"{w} x {h} pixels is more than max_pixels={max_pixels}")
    if c not in (1, 3, 4) or len(data) != h * w * c:
        raise BadImage(f"a Spark image of {w} x {h} x {c} channels holds {len(data)} bytes, not {h * w * c}")
    if c == 1:
        return Image.frombytes("L", (w, h), bytes(data))
    raw = Image.frombytes("RGBA" if c == 4 else "RGB", (w, h), bytes(data))
    # Spark stores OpenCV's order, BGR(A): swap the first and third bands.
    bands = raw.split()
    return Image.merge("RGB", (bands[2], bands[1], bands[0]))
