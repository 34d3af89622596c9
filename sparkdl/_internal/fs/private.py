"""Per-user private directories: where sparkdl writes when nobody said where.

On a shared host, a fixed name under the world-writable temp directory belongs to whoever
creates it first. Every default location of sparkdl (run directories, checkpoints, metrics, the
dataset cache, the jobs' data and models, the zygote's key) is therefore under
``<temp dir>/sparkdl-<uid>/``, created mode 0700. A directory on that path that exists but is not
a directory of this user's, or that others may write to, is refused with a :class:`ConfigError`
naming it and the setting that chooses another place; sparkdl never writes into it.

A leaf: it imports nothing of sparkdl but its errors.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import tempfile
from pathlib import Path

from sparkdl._internal.common.errors import ConfigError


def user_root() -> Path:
    """``<temp dir>/sparkdl-<uid>``: the root of this user's defaults (not created here)."""
    return Path(tempfile.gettempdir()) / f"sparkdl-{os.getuid()}"


def user_dir(*parts: str, setting: str) -> Path:
    """``<temp dir>/sparkdl-<uid>/<parts...>``, each level created 0700 and checked to be private.

    ``setting`` names what the user changes to write elsewhere; it goes into the error.
    """
    path = user_root()
    ensure_private(path, setting)
    for part in parts:
        path = path / part
        ensure_private(path, setting)
    return path


def ensure_private(path: Path, setting: str) -> Path:
    """Creates ``path`` (mode 0700) unless it exists, then checks that it is this user's own
    directory, not a symlink, and not writable by group or others."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot create sparkdl's directory {path}: {exc}; set {setting} to a directory you can write") from exc
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a directory"
        raise ConfigError(
            f"{path} is {kind}: sparkdl keeps its files in a private directory there and will not "
            f"follow it; remove it, or set {setting} to a directory of your own"
        )
    if info.st_uid != os.getuid():
        raise ConfigError(
            f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()}): sparkdl will "
            f"not write into a directory another user controls; remove it, or set {setting} to a "
            "directory of your own"
        )
    if info.st_mode & 0o022:
        raise ConfigError(
            f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}): sparkdl keeps "
            f"runs, checkpoints and caches there only when it is private; chmod 700 {path}, or set "
            f"{setting} to a directory of your own"
        )
    return path


def secret_file(path: Path, size: int = 32) -> bytes:
    """The random secret in ``path``, created (0600, ``size`` bytes) if there is none yet; two
    processes that race to create it read the same one. A file that is not this user's, that
    others may read, or of another size is refused with a :class:`ConfigError`."""
    if not path.exists():
        tmp = path.with_name(f".{secrets.token_hex(8)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(size))
            with contextlib.suppress(FileExistsError):  # another process was first: use its secret
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        secret = f.read()
    if info.st_uid != os.getuid() or info.st_mode & 0o077 or len(secret) != size:
        raise ConfigError(f"{path} is not a private {size}-byte secret of this user: remove it")
    return secret
