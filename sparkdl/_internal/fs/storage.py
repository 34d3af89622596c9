"""Where sparkdl reads and writes: URLs and the pyarrow filesystem behind each.

A leaf shared by the data path (datasets, the dataset cache) and the training loop
(checkpoints). Local paths and ``file://`` URLs use pyarrow's local filesystem; ``s3://``,
``gs://``, ``hdfs://`` and ``abfs://`` use pyarrow's own filesystems; any other scheme
(``ftp://``, ``http://``, ``memory://``, ...) and any URL given ``storage_options`` goes
through fsspec.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from sparkdl._internal.common.errors import ConfigError, DatasetError

if TYPE_CHECKING:
    import pyarrow.fs as pafs

# Schemes that pyarrow reaches natively; s3a/s3n are Hadoop's names for the same store as s3.
_PYARROW_SCHEMES = {"s3": "s3", "s3a": "s3", "s3n": "s3", "gs": "gs", "gcs": "gs", "hdfs": "hdfs",
                    "viewfs": "viewfs", "abfs": "abfs", "abfss": "abfss"}


def normalize_url(path_or_url: str | os.PathLike[str]) -> str:
    """Absolute ``file://`` URL for local paths (executors have another working directory), else as given."""
    text = os.fspath(path_or_url)
    parts = urlsplit(text)
    if len(parts.scheme) <= 1:  # no scheme (or a Windows drive letter): a local path
        return "file://" + os.path.abspath(text)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(
                f"path {text!r}: a file:// URL names a host ({parts.netloc!r}); use file:///absolute/path"
            )
        return "file://" + os.path.abspath(parts.path or "/")
    return text.rstrip("/") if len(text) > len(parts.scheme) + 3 else text


def make_dirs(fs: pafs.FileSystem, path: str) -> None:
    """``path`` and its parents as directories; nothing to do where it is one already (some
    filesystems refuse to create an existing directory: FTP through fsspec answers "550 File
    exists"), and fine when another writer made it meanwhile."""
    import pyarrow.fs as pafs

    if fs.get_file_info(path).type == pafs.FileType.Directory:
        return
    try:
        fs.create_dir(path, recursive=True)
    except Exception:
        if fs.get_file_info(path).type != pafs.FileType.Directory:
            raise


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and the path inside it for a URL from :func:`normalize_url`."""
    import pyarrow.fs as pafs

    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme == "file":
        return pafs.LocalFileSystem(), parts.path
    if scheme in _PYARROW_SCHEMES and not storage_options:
        native = url.replace(f"{scheme}://", f"{_PYARROW_SCHEMES[scheme]}://", 1)
        try:
            fs, path = pafs.FileSystem.from_uri(native)
        except Exception as exc:
            raise unreachable(url, exc) from exc
        return fs, path
    try:
        from fsspec.core import url_to_fs
    except ImportError as exc:
        raise ConfigError(
            f"path {redact(url)!r} has the scheme {scheme!r}, which pyarrow does not reach by itself and "
            "fsspec is not installed; pip install fsspec (and the fsspec package for the scheme)"
        ) from exc
    try:
        fsspec_fs, path = url_to_fs(url, **dict(storage_options or {}))
    except (ImportError, ValueError) as exc:
        raise ConfigError(
            f"path {redact(url)!r}: no filesystem for the scheme {scheme!r} ({type(exc).__name__}: {exc}); "
            "install the fsspec implementation it names, or use a local, file://, s3://, gs:// or "
            "hdfs:// URL"
        ) from exc
    except Exception as exc:
        raise unreachable(url, exc) from exc
    return pafs.PyFileSystem(pafs.FSSpecHandler(fsspec_fs)), path


def unreachable(url: str, exc: BaseException) -> DatasetError:
    """The error for storage that cannot be reached, with the URL's password hidden."""
    return DatasetError(
        f"cannot reach {redact(url)}: {type(exc).__name__}: {exc}. Check the host, port and "
        "credentials of the URL (pass them with storage_options=... where the filesystem needs "
        "them), and that the storage is up and reachable from this machine"
    )


def redact(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***``: for messages and reprs."""
    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@", 1)
    return url
