"""The ``Unischema`` of a dataset Petastorm wrote, read without Petastorm, and without running code.

Petastorm's ``materialize_dataset`` pickles the ``Unischema`` into the key-value metadata of the
dataset's ``_common_metadata`` file (key ``dataset-toolkit.unischema.v1``). Unpickling a file
found in a data lake would run whatever code it names, so the pickle is read by an unpickler
that knows the few globals a Unischema pickle holds (Petastorm's ``Unischema``,
``UnischemaField`` and four codecs, numpy's scalar types and dtypes, pyspark's atomic types,
``collections.OrderedDict``) and builds sparkdl's own inert stand-ins for them: neither
Petastorm, nor pyspark, nor any class the file names is imported or called. Any other global is
refused by name with :class:`~sparkdl.DatasetError`.

What the stand-ins held becomes :class:`~sparkdl._internal.data.format.manifest.FieldSpec` s in the
manifest, which the loader turns into each column's default decoder
(:mod:`sparkdl._internal.data.decoding.petastorm_codecs`).

Decisions: no ``_common_metadata``, or one without the Unischema key, is plain Parquet (Spark and
pyarrow datasets, Petastorm's converter caches). A Unischema key that cannot be read, or that
names a global no Unischema holds, is an error naming the file: the dataset then cannot be
decoded as its writer meant. A field without a column in the files (a partition column) is left
out; a codec on a column of the wrong Parquet type is an error naming the field.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
import posixpath
from typing import TYPE_CHECKING, Any

from sparkdl._internal.common.errors import DatasetError
from sparkdl._internal.data.format.manifest import BINARY, IMAGE_CODECS, SCALAR, FieldSpec, Manifest
from sparkdl._internal.fs.storage import redact, unreachable

if TYPE_CHECKING:
    import pyarrow.fs as pafs

log = logging.getLogger("sparkdl.data")

METADATA_FILE = "_common_metadata"
UNISCHEMA_KEY = b"dataset-toolkit.unischema.v1"
_FIX = (f"regenerate the metadata with Petastorm (petastorm-generate-metadata.py), or delete {METADATA_FILE} "
        "to read the files as plain Parquet (encoded columns as bytes, decoded with decode={column: fn})")


# -- the stand-ins: plain objects that only hold what the pickle gives them --------------------------


class _Unischema:
    """Stands in for ``petastorm.unischema.Unischema``: its name and its fields."""

    name: Any = None
    fields: Any = None

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise pickle.UnpicklingError("a Unischema's state is not a dict")
        self.name, self.fields = state.get("_name"), state.get("_fields")


class _Field(tuple[Any, ...]):
    """Stands in for ``petastorm.unischema.UnischemaField``, a named tuple."""

    def __new__(cls, *args: Any) -> _Field:
        if not 3 <= len(args) <= 5:
            raise pickle.UnpicklingError(f"a UnischemaField of {len(args)} values")
        return super().__new__(cls, args)


class _Codec:
    """Stands in for a Petastorm codec: which one, and the state that matters."""

    kind = ""

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"a {type(self).__name__}'s state is not a dict")
        self.state = state


class _Ndarray(_Codec):
    kind = "ndarray"


class _CompressedNdarray(_Codec):
    kind = "compressed_ndarray"


class _Image(_Codec):
    kind = "image"


class _Scalar(_Codec):
    kind = "scalar"


class _SparkType:
    """Stands in for one of pyspark's atomic types (its state, e.g. a decimal's precision, is kept aside)."""

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _NumpyType:
    """Stands in for a numpy scalar type or dtype: its name (``"float32"``, ``"str"``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __setstate__(self, state: Any) -> None:
        pass  # a dtype's (version, byte order, ...): the name is what the field declares


def _dtype(spec: Any, align: bool = False, copy: bool = True) -> _NumpyType:
    """Stands in for ``numpy.dtype(spec, align, copy)`` as pickled: a type code such as ``"f4"``."""
    import numpy as np

    if not isinstance(spec, str):
        raise pickle.UnpicklingError(f"a numpy dtype from {type(spec).__name__}, not a type code")
    dtype = np.dtype(spec)
    return _NumpyType("str" if dtype.kind == "U" else "bytes" if dtype.kind == "S" else dtype.name)


def _scalar(dtype: Any, data: Any) -> Any:
    """Stands in for numpy's scalar reconstruction (a shape's ``np.int64(3)``): numbers only."""
    import numpy as np

    if not isinstance(dtype, _NumpyType) or not isinstance(data, bytes):
        raise pickle.UnpicklingError("a numpy scalar of another kind than a number")
    np_type = np.dtype(dtype.name)
    if np_type.kind not in "biuf" or len(data) != np_type.itemsize:
        raise pickle.UnpicklingError(f"a numpy scalar of type {dtype.name}")
    return np.frombuffer(data, np_type)[0].item()


_NUMPY_NAMES = {n: n for n in ("bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                                "uint64", "float16", "float32", "float64")}
_NUMPY_NAMES.update({"bool_": "bool", "str_": "str", "unicode_": "str", "string_": "bytes", "bytes_": "bytes",
                     "object_": "object"})
_BUILTIN_TYPES = {"str": "str", "bytes": "bytes", "int": "int64", "float": "float64", "bool": "bool"}
_SPARK_NAMES = ("ByteType", "ShortType", "IntegerType", "LongType", "FloatType", "DoubleType", "BooleanType",
                "StringType", "BinaryType", "DecimalType", "DateType", "TimestampType", "TimestampNTZType")
_SPARK_TYPES = {n: type(n, (_SparkType,), {"__module__": __name__}) for n in _SPARK_NAMES}
_CODECS: dict[str, type[_Codec]] = {"NdarrayCodec": _Ndarray, "CompressedNdarrayCodec": _CompressedNdarray,
                                    "CompressedImageCodec": _Image, "ScalarCodec": _Scalar}
# Petastorm's package had these names before it was published; its own reader renames them too.
_PETASTORM_PACKAGES = ("petastorm", "av.experimental.deepdrive.dataset_toolkit", "av.ml.dataset_toolkit")


class Refused(pickle.UnpicklingError):
    """A global that no Unischema pickle holds."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.qualname = f"{module}.{name}"


class _UnischemaUnpickler(pickle.Unpickler):
    """Builds the stand-ins above for the globals of a Unischema pickle, and refuses every other."""

    def find_class(self, module: str, name: str) -> Any:
        package, _, last = module.rpartition(".")
        if package in _PETASTORM_PACKAGES:
            if last == "unischema" and name in ("Unischema", "UnischemaField"):
                return _Unischema if name == "Unischema" else _Field
            if last == "codecs" and name in _CODECS:
                return _CODECS[name]
        elif module == "numpy" and name in _NUMPY_NAMES:
            return _NumpyType(_NUMPY_NAMES[name])
        elif module == "numpy" and name == "dtype":
            return _dtype
        elif module in ("numpy.core.multiarray", "numpy._core.multiarray") and name == "scalar":
            return _scalar
        elif module == "pyspark.sql.types" and name in _SPARK_TYPES:
            return _SPARK_TYPES[name]
        elif module == "collections" and name == "OrderedDict":
            return dict  # ordered as it is built
        elif module == "builtins" and name in _BUILTIN_TYPES:
            return _NumpyType(_BUILTIN_TYPES[name])
        elif module == "decimal" and name == "Decimal":
            return _NumpyType("decimal")
        raise Refused(module, name)


def unpickle_unischema(raw: bytes, where: str) -> tuple[FieldSpec, ...]:
    """The fields of a pickled Unischema, read with the restricted unpickler.

    Raises:
        DatasetError: the pickle names a global no Unischema holds (naming it and ``where``), or
            is not a readable Unischema.
    """
    try:
        schema = _UnischemaUnpickler(io.BytesIO(raw), encoding="latin1").load()
    except Refused as exc:
        raise DatasetError(
            f"{where}: the Petastorm Unischema pickled under {UNISCHEMA_KEY.decode()!r} names {exc.qualname}, which "
            "no Unischema holds (sparkdl reads Petastorm's Unischema, UnischemaField, NdarrayCodec, "
            "CompressedNdarrayCodec, CompressedImageCodec, ScalarCodec, numpy and pyspark types); sparkdl refused it "
            "and ran nothing from the file. A planted or foreign file? Check who can write the dataset's directory; "
            + _FIX
        ) from None
    except Exception as exc:  # a damaged pickle: truncated, wrong opcodes, wrong arguments
        raise DatasetError(f"{where}: the Petastorm Unischema pickled under {UNISCHEMA_KEY.decode()!r} cannot be "
                           f"read ({type(exc).__name__}: {exc}); " + _FIX) from None
    fields = schema.fields if isinstance(schema, _Unischema) else None
    if not isinstance(fields, dict):
        raise DatasetError(f"{where}: {UNISCHEMA_KEY.decode()!r} holds a {type(schema).__name__}, not a Petastorm "
                           "Unischema; " + _FIX)
    return tuple(_field_spec(f, where) for f in fields.values())


def _field_spec(field: Any, where: str) -> FieldSpec:
    """A stand-in field as a FieldSpec, each of its values checked."""
    if not isinstance(field, _Field):
        raise DatasetError(f"{where}: the Unischema holds a {type(field).__name__} among its fields; " + _FIX)
    name, dtype, shape, codec, nullable = (*field, None, None)[:5]
    if not isinstance(name, str) or not isinstance(dtype, _NumpyType):
        raise DatasetError(f"{where}: the Unischema's field {name!r} has no name or no numpy type ({dtype!r}); " + _FIX)
    if shape is None:
        shape = ()
    if not isinstance(shape, tuple) or not all(d is None or (type(d) is int and d >= 0) for d in shape):
        raise DatasetError(f"{where}: the Unischema's field {name!r} has the shape {shape!r}, not a tuple of "
                           "sizes and None; " + _FIX)
    if codec is None:
        kind = None
    elif isinstance(codec, _Image):
        kind = str(codec.state.get("_image_codec", "")).lstrip(".").lower()
        kind = {"jpg": "jpeg", "tif": "tiff"}.get(kind, kind)
        if kind not in IMAGE_CODECS:
            raise DatasetError(f"{where}: the Unischema's field {name!r} is CompressedImageCodec({kind!r}); sparkdl "
                               f"decodes {', '.join(IMAGE_CODECS)}: read the column as bytes with decode={{{name!r}: fn}}")
    elif isinstance(codec, _Codec):
        kind = codec.kind
    else:
        raise DatasetError(f"{where}: the Unischema's field {name!r} has the codec {codec!r}; " + _FIX)
    return FieldSpec(name, dtype.name, shape, kind, bool(nullable))


def with_unischema(manifest: Manifest, fs: pafs.FileSystem, root: str, url: str) -> Manifest:
    """``manifest`` with the fields of the Unischema in ``root``'s ``_common_metadata``, if it has one.

    Scalar columns whose field declares another numeric type are read as that type (as
    Petastorm's reader gives them).

    Raises:
        DatasetError: the metadata file or its Unischema cannot be read, or a field's codec does
            not fit its column's Parquet type.
    """
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    path = posixpath.join(root, METADATA_FILE)
    where = f"{redact(url)}/{METADATA_FILE}"
    try:
        if fs.get_file_info(path).type != pafs.FileType.File:
            return manifest
        with fs.open_input_file(path) as handle:
            metadata = pq.read_metadata(handle).metadata or {}
    except OSError as exc:
        raise unreachable(url, exc) from exc
    except Exception as exc:
        raise DatasetError(f"{where} is not readable Parquet metadata ({type(exc).__name__}: {exc}); " + _FIX) from None
    raw = metadata.get(UNISCHEMA_KEY)
    if raw is None:
        return manifest
    fields = unpickle_unischema(raw, where)
    by_name = {c.name: c for c in manifest.columns}
    absent = [f.name for f in fields if f.name not in by_name]
    if absent:
        log.info("sparkdl: %s: the Unischema's fields %s have no column in the files (partition columns?); "
                 "they are left out", where, absent)
    kept = tuple(f for f in fields if f.name in by_name)
    columns = []
    for col in manifest.columns:
        field = next((f for f in kept if f.name == col.name), None)
        if field is not None and field.encoded and col.kind != BINARY:
            raise DatasetError(
                f"{where}: the Unischema's field {col.name!r} is encoded ({field.describe()}), but its column holds "
                f"{col.describe()}, not bytes: the metadata belongs to other files; " + _FIX
            )
        if field is not None and col.kind == SCALAR and field.dtype != col.dtype and _numeric(field.dtype):
            col = dataclasses.replace(col, dtype=field.dtype)
        columns.append(col)
    return dataclasses.replace(manifest, columns=tuple(columns), fields=kept)


def _numeric(dtype: str) -> bool:
    return dtype == "bool" or dtype.startswith(("int", "uint", "float"))


__all__ = ["METADATA_FILE", "UNISCHEMA_KEY", "Refused", "unpickle_unischema", "with_unischema"]
