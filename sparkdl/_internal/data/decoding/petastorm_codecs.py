"""Petastorm's codecs decoded by sparkdl: the default decoders of a Petastorm dataset's columns.

A dataset written by Petastorm's ``materialize_dataset`` stores ndarrays and images as bytes,
and its ``Unischema`` (:mod:`sparkdl._internal.data.format.petastorm_schema`) says how each column was
encoded. ``ds.loader(...)`` then decodes each such column on its decode workers (threads by
default; ``decode_in="processes"``), as if ``decode={column: PetastormDecoder(field)}`` had been
given, and the outputs come out as Petastorm's reader gives them, stacked into a batch tensor:

- ``NdarrayCodec`` (``np.save`` bytes) and ``CompressedNdarrayCodec`` (``np.savez_compressed``,
  array ``arr``): the array, of the declared dtype and shape. Read without pickles
  (``allow_pickle=False``), and the header is checked against the declared shape and the bytes at
  hand before anything is allocated.
- ``CompressedImageCodec``: ``uint8`` (or ``uint16`` for 16-bit PNGs) ``[H, W, 3]`` in RGB, or
  ``[H, W]`` for gray images. Petastorm encodes with OpenCV after swapping RGB to BGR, which
  OpenCV writes back as RGB: the stored file is an ordinary RGB image, and Petastorm's reader
  swaps OpenCV's BGR back, so a reader gets the array that was written. sparkdl decodes with
  simplejpeg (JPEGs; libjpeg-turbo, the same decoder and settings as OpenCV's: the same values)
  and Pillow, on the decode workers.
- ``ScalarCodec``: no decoder; the loader reads the plain Parquet values.

A value of another dtype or shape than its field declares, or one that does not decode, is a bad
sample: ``on_bad_sample`` decides, and the message names the field. ``decode={column: fn}``
given for a column replaces its default; ``decode={ROW: fn}`` (a ``TransformSpec``) sees each
row's decoded values, as Petastorm's ``TransformSpec`` does.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparkdl._internal.data.decoding.image_files import BadImage, open_encoded
from sparkdl._internal.data.decoding.images import PILLOW_MAX_PIXELS
from sparkdl._internal.data.decoding.row_transform import outcome
from sparkdl._internal.data.decoding.samples import ROW, SampleFn
from sparkdl._internal.data.format.manifest import IMAGE_CODECS, FieldSpec, Manifest

if TYPE_CHECKING:
    import numpy as np

_HEADER_BYTES = 65_536
"""Room for an ``.npy`` header beside its data, when bounding an array by the bytes it came in."""


@dataclass(frozen=True)
class PetastormDecoder:
    """Decodes one value of a Petastorm-encoded field as Petastorm's reader would (a ``decode=`` function).

    Example::

        field = ds.manifest.field("image")                 # from the dataset's Unischema
        image = PetastormDecoder(field)(raw_bytes, None)   # uint8 [H, W, 3]
    """

    field: FieldSpec

    def __call__(self, value: Any, rng: Any) -> np.ndarray | None:
        f = self.field
        if value is None:
            if f.nullable:
                return None
            raise ValueError(f"field {f.name!r} is null, and its Unischema declares it not nullable")
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise ValueError(f"field {f.name!r} holds a {type(value).__name__}, not the bytes its codec writes")
        if f.codec == "ndarray":
            return _native(_npy(f, io.BytesIO(value), len(value)))
        if f.codec == "compressed_ndarray":
            return _native(_npz(f, bytes(value)))
        if f.codec in IMAGE_CODECS:
            return _checked(f, _image(f, bytes(value)))
        raise ValueError(f"field {f.name!r} has the codec {f.codec!r}, which sparkdl does not decode")


class DecodedRow:
    """``decode={ROW: fn}`` over a Petastorm dataset: ``fn`` sees the row with its fields decoded."""

    def __init__(self, fn: SampleFn, decoders: Mapping[str, PetastormDecoder]) -> None:
        self.fn = fn
        self.decoders = dict(decoders)

    def __call__(self, row: dict[str, Any], rng: Any) -> Any:
        return self.fn(self._decoded(row, rng), rng)

    def _decoded(self, row: dict[str, Any], rng: Any) -> dict[str, Any]:
        return {k: self.decoders[k](v, rng) if k in self.decoders else v for k, v in row.items()}

    def run_chunk(self, rows: list[dict[str, Any]], rngs: list[Any]) -> list[Any]:
        """Consecutive rows (see :meth:`RowTransform.run_chunk`): each decoded alone, a value that
        does not decode that row's exception, then the good ones through ``fn`` together when it
        takes chunks; each generator is drawn from in the order a row alone draws (fields, fn)."""
        results: list[Any] = [None] * len(rows)
        good: list[tuple[int, dict[str, Any]]] = []
        for i, (row, rng) in enumerate(zip(rows, rngs, strict=True)):
            decoded = outcome(self._decoded, row, rng)
            if isinstance(decoded, Exception):
                results[i] = decoded
            else:
                good.append((i, decoded))
        chunked = getattr(self.fn, "run_chunk", None)
        if chunked is not None:
            done = chunked([d for _, d in good], [rngs[i] for i, _ in good]) if good else []
        else:
            done = [outcome(self.fn, d, rngs[i]) for i, d in good]
        for (i, _), out in zip(good, done, strict=True):
            results[i] = out
        return results


def with_codecs(manifest: Manifest, fns: Mapping[str, SampleFn], columns: Sequence[str] | str | None,
                reader: str) -> dict[str, SampleFn]:
    """``fns`` (a loader's ``decode``) with a :class:`PetastormDecoder` for each encoded column of
    ``columns`` (all when None) that ``fns`` leaves to the default; with ``reader="petastorm"``,
    or without a Unischema, ``fns`` as they are."""
    out = dict(fns)
    if reader != "arrow" or not manifest.fields:
        return out
    selected = {columns} if isinstance(columns, str) else set(columns) if columns is not None else None
    decoders = {f.name: PetastormDecoder(f) for f in manifest.fields
                if f.encoded and (selected is None or f.name in selected)}
    if ROW in out:
        out[ROW] = DecodedRow(out[ROW], decoders)
        return out
    for name, decoder in decoders.items():
        out.setdefault(name, decoder)
    return out


# -- ndarrays ------------------------------------------------------------------------------------


def _npy(f: FieldSpec, stream: Any, available: int) -> np.ndarray:
    """An ``.npy`` array read from ``stream`` once its header fits the field and ``available`` bytes."""
    from numpy.lib import format as npf

    start = stream.tell()
    try:
        version = npf.read_magic(stream)
        if version == (1, 0):
            shape, _, dtype = npf.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, _, dtype = npf.read_array_header_2_0(stream)
        else:
            raise ValueError(f"the .npy format version {version}, which sparkdl does not read")
    except ValueError as e:
        raise ValueError(f"field {f.name!r}: not the np.save bytes its {_codec_name(f)} writes ({e})") from None
    if dtype.hasobject:
        raise ValueError(f"field {f.name!r} holds an array of Python objects (dtype {dtype}), which sparkdl "
                         "does not unpickle; write numeric arrays")
    _check_shape(f, dtype, tuple(shape))
    size = math.prod(shape) * dtype.itemsize
    if size > available:
        raise ValueError(f"field {f.name!r}: the array's header claims {tuple(shape)} of {dtype} ({size} bytes) "
                         f"in {available} bytes; the value is damaged")
    stream.seek(start)
    return npf.read_array(stream, allow_pickle=False)


def _npz(f: FieldSpec, value: bytes) -> np.ndarray:
    """The array ``arr`` of ``np.savez_compressed`` bytes, bounded by its uncompressed size."""
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(value)) as z:
            info = z.getinfo("arr.npy")
            declared = _known_size(f)
            if declared is not None and info.file_size > declared + _HEADER_BYTES:
                raise ValueError(f"it unpacks to {info.file_size} bytes, more than {f.shape} of {f.dtype} takes")
            with z.open(info) as member:
                return _npy(f, member, info.file_size)  # a zip member seeks (decompressing again)
    except (zipfile.BadZipFile, KeyError, ValueError, EOFError) as e:
        if isinstance(e, ValueError) and str(e).startswith("field "):
            raise
        raise ValueError(f"field {f.name!r}: not the np.savez_compressed bytes (an array 'arr') its "
                         f"CompressedNdarrayCodec writes ({type(e).__name__}: {e})") from None


def _known_size(f: FieldSpec) -> int | None:
    """The bytes of an array of the field's declared shape, when every dimension is declared."""
    import numpy as np

    if any(d is None for d in f.shape) or f.dtype in ("str", "bytes", "object", "decimal"):
        return None
    return math.prod(f.shape) * np.dtype(f.dtype).itemsize  # type: ignore[arg-type]


def _check_shape(f: FieldSpec, dtype: np.dtype[Any], shape: tuple[int, ...]) -> None:
    fits = len(shape) == len(f.shape) and all(d is None or d == s for d, s in zip(f.shape, shape, strict=True))
    if dtype.name != f.dtype or not fits:
        raise ValueError(
            f"field {f.name!r} declares {f.dtype} {_shape(f.shape)} in its Unischema, and this value is "
            f"{dtype.name} {_shape(shape)}: the column was written with another Unischema than the dataset's "
            f"_common_metadata holds; rewrite the dataset, or decode the column yourself with decode={{{f.name!r}: fn}}"
        )


def _checked(f: FieldSpec, arr: np.ndarray) -> np.ndarray:
    _check_shape(f, arr.dtype, tuple(arr.shape))
    return arr


def _native(arr: np.ndarray) -> np.ndarray:
    """The array in this machine's byte order (torch takes no other)."""
    return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))


def _shape(shape: Sequence[int | None]) -> str:
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _codec_name(f: FieldSpec) -> str:
    return "NdarrayCodec" if f.codec == "ndarray" else "CompressedNdarrayCodec"


# -- images ----------------------------------------------------------------------------------------


@functools.cache
def _simplejpeg() -> Any:
    try:
        import simplejpeg
    except ImportError:  # Pillow decodes JPEGs too, to the same values
        return None
    return simplejpeg


def _image(f: FieldSpec, value: bytes) -> np.ndarray:
    """An image as OpenCV's ``IMREAD_UNCHANGED`` and Petastorm's swap back to RGB give it."""
    import numpy as np

    simplejpeg = _simplejpeg() if value[:2] == b"\xff\xd8" else None
    if simplejpeg is not None:
        try:
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(value)
        except ValueError:
            colorspace = None  # Pillow reads it, or names what is wrong with it
        if colorspace in ("YCbCr", "Gray"):
            _check_size(f, int(width), int(height))
            gray = colorspace == "Gray"
            try:
                pixels = simplejpeg.decode_jpeg(value, colorspace="GRAY" if gray else "RGB")
            except ValueError as e:
                raise BadImage(f"field {f.name!r}: cannot decode the JPEG ({e})") from None
            return pixels[:, :, 0] if gray else pixels
    im = open_encoded(value)
    _check_size(f, *im.size)
    try:
        im.load()
    except Exception as e:
        raise BadImage(f"field {f.name!r}: cannot decode the {im.format} image ({type(e).__name__}: {e})") from None
    if im.mode in ("RGB", "L"):
        return np.array(im)
    if im.mode.startswith("I;16") or (im.mode == "I" and im.format == "PNG"):  # 16-bit gray, as OpenCV keeps it
        return np.array(im).astype(np.uint16)
    if im.mode in ("P", "CMYK", "YCbCr", "1"):
        return np.array(im.convert("L" if im.mode == "1" else "RGB"))
    raise BadImage(f"field {f.name!r}: a {im.format} image of mode {im.mode}; Petastorm's CompressedImageCodec "
                   "stores (H, W) or (H, W, 3) images, without alpha")


def _check_size(f: FieldSpec, width: int, height: int) -> None:
    """Refuses an image whose header does not fit the field, before it is decoded."""
    declared_h, declared_w = (*f.shape, None, None)[:2]
    if (declared_h not in (None, height)) or (declared_w not in (None, width)):
        raise BadImage(f"field {f.name!r} declares {_shape(f.shape)} in its Unischema, and this image is "
                       f"{height} x {width}: the column was written with another Unischema; rewrite the dataset, "
                       f"or decode the column yourself with decode={{{f.name!r}: fn}}")
    if width * height > PILLOW_MAX_PIXELS:
        raise BadImage(f"field {f.name!r}: {width} x {height} pixels is more than {PILLOW_MAX_PIXELS} (a "
                       f"decompression bomb?); decode the column yourself with decode={{{f.name!r}: "
                       "sparkdl.ImageDecoder(max_pixels=...)}")


__all__ = ["DecodedRow", "PetastormDecoder", "with_codecs"]
