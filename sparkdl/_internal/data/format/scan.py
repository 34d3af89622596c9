"""Opening a path: its sparkdl manifest, or one built from the Parquet footers.

Directories written by plain Spark, by pyarrow or by Petastorm have no manifest; the footers say
the same (schema, row groups, rows), so the loader plans them alike. A Petastorm dataset's
``Unischema`` adds how its columns decode (:mod:`sparkdl._internal.data.format.petastorm_schema`).
Footers are read in parallel, except on fsspec filesystems, which may share one connection
between threads.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from sparkdl._internal.common.errors import ConfigError, DatasetError
from sparkdl._internal.data.format.manifest import (
    ARRAY,
    MANIFEST_NAME,
    FileSpec,
    Manifest,
    column_spec,
)
from sparkdl._internal.data.format.petastorm_schema import with_unischema
from sparkdl._internal.fs.storage import redact, unreachable

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs


def _is_hidden(rel_path: str) -> bool:
    # Spark, Hive and Petastorm keep metadata in _-prefixed and .-prefixed files and folders.
    return any(part.startswith(("_", ".")) for part in rel_path.split("/"))


def path_info(fs: pafs.FileSystem, path: str, url: str) -> pafs.FileInfo:
    """``fs.get_file_info(path)``; a failure is reported as ``url`` being unreachable."""
    try:
        return fs.get_file_info(path)
    except Exception as exc:
        raise unreachable(url, exc) from exc


def _list_data_files(fs: pafs.FileSystem, root: str, url: str) -> list[str]:
    """Relative paths of the data files under ``root``, sorted, metadata files left out."""
    import pyarrow.fs as pafs

    try:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    except Exception as exc:
        raise unreachable(url, exc) from exc
    prefix = root.rstrip("/") + "/"
    rel = []
    for info in infos:
        if info.type != pafs.FileType.File:
            continue
        # fsspec filesystems may drop a leading slash; compare without it.
        path = info.path
        if not path.startswith(prefix) and ("/" + path).startswith(prefix):
            path = "/" + path
        name = path[len(prefix):] if path.startswith(prefix) else posixpath.basename(path)
        if not _is_hidden(name) and info.size:
            rel.append(name)
    return sorted(rel)


def _read_footers(
    fs: pafs.FileSystem, root: str, rel_paths: Sequence[str], url: str
) -> list[tuple[pa.Schema, FileSpec]]:
    import pyarrow.parquet as pq

    def one(rel: str) -> tuple[pa.Schema, FileSpec]:
        full = posixpath.join(root, rel) if rel else root
        try:
            with fs.open_input_file(full) as handle:
                meta = pq.ParquetFile(handle).metadata
                schema = meta.schema.to_arrow_schema()
        except Exception as exc:
            raise DatasetError(
                f"{redact(url)}: the file {rel or full!r} is not readable Parquet "
                f"({type(exc).__name__}: {exc}); remove it from the directory or rewrite the data"
            ) from exc
        groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
        size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        return schema, FileSpec(rel, tuple(g for g in groups), int(size))

    # fsspec filesystems (wrapped as "py") may share one connection between threads, as ftp does:
    # read their footers one after another.
    if len(rel_paths) <= 1 or fs.type_name.startswith("py"):
        return [one(r) for r in rel_paths]
    with ThreadPoolExecutor(max_workers=min(16, len(rel_paths))) as pool:
        return list(pool.map(one, rel_paths))


def manifest_from_footers(
    fs: pafs.FileSystem,
    root: str,
    url: str,
    fixed_lengths: Mapping[str, int] | None,
    *,
    single_file: bool = False,
) -> Manifest:
    """The manifest of ``root``'s data files (or of the file ``root``), from their footers.

    Raises DatasetError for no files, unreadable ones or schemas that differ, and ConfigError for
    ``fixed_lengths`` that name missing or non-array columns.
    """
    rel_paths = [""] if single_file else _list_data_files(fs, root, url)
    if not rel_paths:
        raise DatasetError(
            f"{redact(url)} holds no Parquet files (only metadata files, or nothing); check the "
            "path, or write the data with sparkdl.write_dataset(df, path)"
        )
    footers = _read_footers(fs, root, rel_paths, url)
    schema = footers[0][0]
    for other, spec in footers[1:]:
        if not other.remove_metadata().equals(schema.remove_metadata()):
            raise DatasetError(
                f"{redact(url)}: the file {spec.path!r} has another schema than "
                f"{footers[0][1].path!r} ({other} vs {schema}); a dataset's files must share one "
                "schema: rewrite them with sparkdl.write_dataset"
            )
    fixed = dict(fixed_lengths or {})
    unknown = sorted(set(fixed) - set(schema.names))
    if unknown:
        raise ConfigError(
            f"fixed_lengths names columns that {redact(url)} does not have: {unknown}; its columns "
            f"are {schema.names}"
        )
    columns = tuple(column_spec(field, fixed.get(field.name)) for field in schema)
    for col in columns:
        if col.name in fixed and col.kind != ARRAY:
            raise ConfigError(
                f"fixed_lengths[{col.name!r}]: the column is {col.describe()}, not a numeric array"
            )
    files = tuple(spec for _, spec in footers if spec.num_rows > 0)
    return Manifest(columns=columns, files=files)


def open_manifest(
    fs: pafs.FileSystem, root: str, url: str, fixed_lengths: Mapping[str, int] | None
) -> tuple[Manifest, bool]:
    """Reads the sparkdl manifest, or builds one from the footers; returns it and whether ``root`` is a file."""
    import pyarrow.fs as pafs

    info = path_info(fs, root, url)
    if info.type == pafs.FileType.NotFound:
        raise DatasetError(
            f"{redact(url)} does not exist; check the path, or write the data first with "
            "sparkdl.write_dataset(df, path)"
        )
    if info.type == pafs.FileType.File:
        return manifest_from_footers(fs, root, url, fixed_lengths, single_file=True), True
    manifest_path = posixpath.join(root, MANIFEST_NAME)
    if path_info(fs, manifest_path, url).type == pafs.FileType.File:
        try:
            with fs.open_input_stream(manifest_path) as handle:
                text = handle.read().decode()
        except Exception as exc:
            raise unreachable(url, exc) from exc
        manifest = Manifest.from_json(text, f"{redact(url)}/{MANIFEST_NAME}")
        if fixed_lengths:
            raise ConfigError(
                f"fixed_lengths is for datasets without a sparkdl manifest; {redact(url)} has one, "
                "which already records the array lengths: leave fixed_lengths out"
            )
        return manifest, False
    # A dataset Petastorm wrote: its Unischema says how the columns decode.
    return with_unischema(manifest_from_footers(fs, root, url, fixed_lengths), fs, root, url), False
