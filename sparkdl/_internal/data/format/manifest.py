"""The manifest: what the loader plans every epoch from, without reading any data.

A dataset is a directory of Parquet files. Next to them sparkdl writes ``_sparkdl_manifest.json``:
the columns (kind, element type, array length), the files, the rows of every row group and the
row counts. Directories written by plain Spark, by pyarrow or by Petastorm have no manifest;
:mod:`sparkdl._internal.data.format.scan` builds the same manifest from their Parquet footers. The leading
underscore keeps Spark and pyarrow from taking the manifest for data.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sparkdl._internal.common.errors import DatasetError

if TYPE_CHECKING:
    import pyarrow as pa

MANIFEST_NAME = "_sparkdl_manifest.json"
MANIFEST_VERSION = 1
"""The manifest format's version; a cache entry written under another version is a miss."""
_MANIFEST_FORMAT = "sparkdl.dataset"

# Column kinds, as the loader sees them.
SCALAR = "scalar"
ARRAY = "array"
BINARY = "binary"
STRING = "string"
UNSUPPORTED = "unsupported"


@dataclass(frozen=True)
class ColumnSpec:
    """One column as the loader feeds it.

    Attributes:
        name: column name.
        kind: ``"scalar"`` (a number per row), ``"array"`` (a numeric list per row), ``"binary"``,
            ``"string"``, or ``"unsupported"`` (present in the files, but not feedable).
        dtype: numpy name of the value type (of the elements, for arrays); for an unsupported
            column, its Arrow type.
        length: for arrays whose every row has the same length, that length; ``None`` for
            variable-length arrays and for other kinds.
    """

    name: str
    kind: str
    dtype: str
    length: int | None = None

    def describe(self) -> str:
        """The column's type as ``Dataset.schema`` shows it, e.g. ``"array<float32>[32]"``."""
        if self.kind == ARRAY:
            return f"array<{self.dtype}>[{self.length if self.length is not None else 'variable'}]"
        if self.kind == SCALAR:
            return self.dtype
        return self.kind if self.kind != UNSUPPORTED else f"unsupported ({self.dtype})"


IMAGE_CODECS = ("png", "jpeg", "webp", "bmp", "tiff")
"""The image formats of Petastorm's ``CompressedImageCodec`` that sparkdl decodes."""


@dataclass(frozen=True)
class FieldSpec:
    """A column's field in the Petastorm ``Unischema`` stored with the dataset: how its values decode.

    Attributes:
        name: the field's (and its column's) name.
        dtype: numpy name of the decoded values' type (``"float32"``, ``"uint8"``, ``"str"``).
        shape: the declared shape, ``None`` for a dimension of any length; ``()`` for a scalar.
        codec: ``"ndarray"`` (``NdarrayCodec``: ``np.save`` bytes), ``"compressed_ndarray"``
            (``CompressedNdarrayCodec``: ``np.savez_compressed``), an image format of
            :data:`IMAGE_CODECS` (``CompressedImageCodec``), ``"scalar"`` (``ScalarCodec``) or
            ``None`` (no codec: a plain Parquet value).
        nullable: whether the field may hold nulls.
    """

    name: str
    dtype: str
    shape: tuple[int | None, ...]
    codec: str | None
    nullable: bool = False

    @property
    def encoded(self) -> bool:
        """Whether the column holds encoded bytes that decode to an array (ndarrays, images)."""
        return self.codec in ("ndarray", "compressed_ndarray") or self.codec in IMAGE_CODECS

    def describe(self) -> str:
        """The field as ``Dataset.schema`` shows it, e.g. ``"ndarray<float32>[3, 4]"``, ``"image<uint8>[?, ?, 3] (png)"``."""
        if not self.encoded:
            return self.dtype
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        kind = f"image<{self.dtype}>[{dims}] ({self.codec})" if self.codec in IMAGE_CODECS else f"ndarray<{self.dtype}>[{dims}]"
        return kind + (" (compressed)" if self.codec == "compressed_ndarray" else "")


@dataclass(frozen=True)
class FileSpec:
    """One Parquet file: its path relative to the dataset root and the rows of its row groups."""

    path: str
    row_groups: tuple[int, ...]
    uncompressed_bytes: int

    @property
    def num_rows(self) -> int:
        """Rows in the file."""
        return sum(self.row_groups)


@dataclass(frozen=True)
class Manifest:
    """What the loader plans from: columns, files, row groups and row counts."""

    columns: tuple[ColumnSpec, ...]
    files: tuple[FileSpec, ...]
    written_by_sparkdl: bool = False
    key: str | None = None
    fields: tuple[FieldSpec, ...] = ()
    """The Petastorm ``Unischema``'s fields of the columns, for a dataset Petastorm wrote."""

    @property
    def num_rows(self) -> int:
        """Rows in all files."""
        return sum(f.num_rows for f in self.files)

    @property
    def uncompressed_bytes(self) -> int:
        """The data's size once decoded, as the Parquet footers record it."""
        return sum(f.uncompressed_bytes for f in self.files)

    def column(self, name: str) -> ColumnSpec:
        """The column called ``name``; KeyError when there is none."""
        for col in self.columns:
            if col.name == name:
                return col
        raise KeyError(name)

    def field(self, name: str) -> FieldSpec | None:
        """The Petastorm field of column ``name``; None when the dataset has no Unischema for it."""
        return next((f for f in self.fields if f.name == name), None)

    def fingerprint(self) -> str:
        """A short hash of the layout: the same on every rank that sees the same files."""
        layout = [[f.path, list(f.row_groups)] for f in self.files]
        cols = [[c.name, c.kind, c.dtype, c.length] for c in self.columns]
        return hashlib.sha256(json.dumps([layout, cols]).encode()).hexdigest()[:16]

    def to_json(self) -> str:
        """The manifest file's text."""
        return json.dumps(
            {
                "format": _MANIFEST_FORMAT,
                "version": MANIFEST_VERSION,
                "written_by": "sparkdl" if self.written_by_sparkdl else None,
                "key": self.key,
                "num_rows": self.num_rows,
                "columns": [
                    {"name": c.name, "kind": c.kind, "dtype": c.dtype, "length": c.length}
                    for c in self.columns
                ],
                "files": [
                    {
                        "path": f.path,
                        "num_rows": f.num_rows,
                        "row_groups": list(f.row_groups),
                        "uncompressed_bytes": f.uncompressed_bytes,
                    }
                    for f in self.files
                ],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        """Parses a manifest file's text; DatasetError (naming ``where``) when it cannot."""
        try:
            raw = json.loads(text)
            if raw.get("format") != _MANIFEST_FORMAT or raw.get("version") != MANIFEST_VERSION:
                raise ValueError(f"format {raw.get('format')!r} version {raw.get('version')!r}")
            return cls(
                columns=tuple(
                    ColumnSpec(c["name"], c["kind"], c["dtype"], c.get("length")) for c in raw["columns"]
                ),
                files=tuple(
                    FileSpec(f["path"], tuple(int(n) for n in f["row_groups"]), int(f["uncompressed_bytes"]))
                    for f in raw["files"]
                ),
                written_by_sparkdl=raw.get("written_by") == "sparkdl",
                key=raw.get("key"),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise DatasetError(
                f"the manifest {where} cannot be read ({type(exc).__name__}: {exc}); it was written "
                f"by another version of sparkdl or damaged. Delete {MANIFEST_NAME} to open the "
                "directory as plain Parquet, or write the dataset again"
            ) from exc


def column_spec(field: pa.Field, length: int | None = None) -> ColumnSpec:
    """Maps an Arrow field to the loader's view of it; ``length`` is a known array length."""
    import pyarrow as pa

    from sparkdl._internal.data.format.arrow import numpy_dtype

    t = field.type

    def numeric(x: pa.DataType) -> bool:
        return bool(pa.types.is_integer(x) or pa.types.is_floating(x) or pa.types.is_boolean(x))

    if numeric(t):
        return ColumnSpec(field.name, SCALAR, numpy_dtype(t).name)
    if (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)) and numeric(
        t.value_type
    ):
        if pa.types.is_fixed_size_list(t):
            length = t.list_size
        return ColumnSpec(field.name, ARRAY, numpy_dtype(t.value_type).name, length)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return ColumnSpec(field.name, BINARY, "bytes")
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return ColumnSpec(field.name, STRING, "str")
    view_types = [getattr(pa.types, n, None) for n in ("is_binary_view", "is_string_view")]
    if view_types[0] is not None and view_types[0](t):
        return ColumnSpec(field.name, BINARY, "bytes")
    if view_types[1] is not None and view_types[1](t):
        return ColumnSpec(field.name, STRING, "str")
    return ColumnSpec(field.name, UNSUPPORTED, str(t))
