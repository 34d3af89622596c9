"""Arrow arrays as numpy, for the readers: numbers and list layouts, read from the buffers.

pyarrow's own ``Array.to_numpy`` imports pandas on its first call (about 50 MiB of memory in a
process that may never need it). The loader's numbers are fixed-width primitives, whose
buffers numpy reads as they are, so these helpers read them directly and fall back to
``to_numpy`` only for the types they do not know.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def to_numpy(arr: pa.Array) -> np.ndarray:
    """An array with no nulls as numpy: a read-only zero-copy view for integers and floats,
    a new array for booleans (Arrow packs them in bits) and for anything else."""
    t = arr.type
    n = len(arr)
    dtype = _primitive_dtype(t)
    if dtype is not None:
        data = arr.buffers()[1]
        if n == 0 or data is None:
            return np.empty(0, dtype=dtype)
        return np.frombuffer(data, dtype=dtype, count=n, offset=arr.offset * dtype.itemsize)
    if pa.types.is_boolean(t):
        data = arr.buffers()[1]
        if n == 0 or data is None:
            return np.empty(0, dtype=np.bool_)
        bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
        return bits[arr.offset : arr.offset + n].astype(np.bool_)
    return arr.to_numpy(zero_copy_only=False)


def list_lengths(chunk: pa.Array) -> np.ndarray:
    """The lengths of the rows of a list chunk (0 for a null row), from its offsets."""
    if pa.types.is_fixed_size_list(chunk.type):
        lengths = np.full(len(chunk), chunk.type.list_size, dtype=np.int64)
    else:
        lengths = np.diff(to_numpy(chunk.offsets)).astype(np.int64, copy=False)
    if chunk.null_count:
        lengths[to_numpy(chunk.is_null())] = 0
    return lengths


def list_values(chunk: pa.Array) -> pa.Array:
    """The elements of a list chunk with no null rows, in order: what ``flatten()`` gives, as a
    zero-copy slice of the chunk's values."""
    if pa.types.is_fixed_size_list(chunk.type):
        size = chunk.type.list_size
        return chunk.values.slice(chunk.offset * size, len(chunk) * size)
    if not len(chunk):
        return chunk.values.slice(0, 0)
    offsets = chunk.offsets
    start = offsets[0].as_py()
    return chunk.values.slice(start, offsets[-1].as_py() - start)


def numpy_dtype(t: pa.DataType) -> np.dtype:
    """The numpy dtype of an Arrow integer, float or boolean type (``to_pandas_dtype`` imports
    pandas on some pyarrow versions)."""
    if pa.types.is_boolean(t):
        return np.dtype(np.bool_)
    dtype = _primitive_dtype(t)
    if dtype is None:
        raise TypeError(f"{t} is not an integer, float or boolean type")
    return dtype


_FLOATS = {16: np.float16, 32: np.float32, 64: np.float64}


def _primitive_dtype(t: pa.DataType) -> np.dtype | None:
    if pa.types.is_integer(t):
        return np.dtype(f"{'i' if pa.types.is_signed_integer(t) else 'u'}{t.bit_width // 8}")
    if pa.types.is_floating(t):
        return np.dtype(_FLOATS[t.bit_width])
    return None
