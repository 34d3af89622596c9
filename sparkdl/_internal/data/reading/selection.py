"""What a loader reads: the columns it selects (checked against the manifest, with errors that
name the fix) and where a row of the dataset is, for messages."""

from __future__ import annotations

from collections.abc import Sequence

from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.data.format.manifest import ARRAY, UNSUPPORTED, ColumnSpec, Manifest
from sparkdl._internal.data.reading.read import LENGTHS_SUFFIX


def select_columns(manifest: Manifest, columns: Sequence[str] | None, decoded: set[str]) -> tuple[ColumnSpec, ...]:
    if isinstance(columns, str):
        columns = [columns]
    names = list(columns) if columns is not None else [c.name for c in manifest.columns]
    if not names:
        raise ConfigError("columns=[] selects nothing; name at least one column, or leave columns out for all")
    known = {c.name for c in manifest.columns}
    missing = [n for n in names if n not in known]
    if missing:
        raise ConfigError(f"columns {missing} are not in the dataset; its columns are {sorted(known)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"columns={names} names a column twice")
    specs = tuple(manifest.column(n) for n in names)
    undecoded = decoded - set(names)
    if undecoded:
        raise ConfigError(
            f"decode names {sorted(undecoded)}, which columns={names} leaves out; add them to columns, or leave columns out"
        )
    bad = [f"{c.name!r} ({c.dtype})" for c in specs if c.kind == UNSUPPORTED and c.name not in decoded]
    if bad:
        feedable = [c.name for c in manifest.columns if c.kind != UNSUPPORTED]
        raise ConfigError(
            f"the column(s) {', '.join(bad)} cannot be fed to torch (supported: numbers, numeric "
            f"arrays, binary, strings); pass columns=[...] without them, e.g. columns={feedable}"
        )
    for c in specs:
        if c.kind == ARRAY and c.length is None and c.name + LENGTHS_SUFFIX in names:
            raise ConfigError(
                f"the variable-length column {c.name!r} comes with a {c.name + LENGTHS_SUFFIX!r} tensor, "
                "and the dataset has a column of that name too; leave one of them out with columns=[...]"
            )
    return specs


def place(manifest: Manifest, row: int) -> str:
    """Where row ``row`` of the dataset is: its Parquet file and its row there."""
    for f in manifest.files:
        n = sum(f.row_groups)
        if row < n:
            return f"row {row} of {f.path or 'the file'}"
        row -= n
    return "past the last file"


__all__ = ["place", "select_columns"]
