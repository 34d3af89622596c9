"""Stores compiled bytecode beside the sources in pyspark's ``python/lib/pyspark.zip``: the copy of
pyspark that Spark puts first on its Python workers' path.

Python caches no bytecode for modules it imports from a zip, so without this every Python worker
compiles the pyspark modules it imports from source. pyspark 4's daemon imports ``pyspark.worker``
in each worker after the fork, not before it: with the modules a pandas or Arrow UDF needs, 0.6-0.9 s
of CPU per worker here, against 0.36-0.38 s with the bytecode in the zip.

The entries are checked hash-based .pyc files (PEP 552): zipimport loads one only while the hash
of the source beside it still matches, and a worker on another Python version (another magic
number) compiles the source as before. The zip is replaced atomically, so a worker starting
meanwhile reads either the old zip or the new one. tools/bootstrap.sh runs this after pip; it does
nothing when the zip already holds this Python's bytecode.

    python tools/pyspark_bytecode.py [ZIP]   # default: the running interpreter's pyspark
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
import zipfile
from importlib._bootstrap_external import _code_to_hash_pyc  # type: ignore[attr-defined]
from pathlib import Path


def pyspark_zip() -> Path:
    """The running interpreter's pyspark's ``python/lib/pyspark.zip`` (pyspark is not imported)."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pyspark is not installed for this interpreter")
    return Path(next(iter(spec.submodule_search_locations))) / "python" / "lib" / "pyspark.zip"


def has_bytecode(path: Path) -> bool:
    """Whether the zip holds this Python's bytecode (pyspark/__init__.pyc, with its magic number)."""
    with zipfile.ZipFile(path) as zf:
        try:
            with zf.open("pyspark/__init__.pyc") as pyc:
                return pyc.read(4) == importlib.util.MAGIC_NUMBER
        except KeyError:
            return False


def add_bytecode(path: Path) -> int:
    """Rewrites the zip at ``path`` with a .pyc beside each .py (none for its tests); returns how
    many it compiled. .pyc entries already there (another Python's) are dropped."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    compiled = 0
    try:
        with zipfile.ZipFile(path) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
            for info in zin.infolist():
                if info.filename.endswith(".pyc"):
                    continue
                data = zin.read(info)
                zout.writestr(info, data)
                if not info.filename.endswith(".py") or "/tests/" in info.filename:
                    continue
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # pyspark's own SyntaxWarnings, shown when compiled as before
                    # The file name a worker's traceback shows, as when zipimport compiles the source.
                    code = compile(data, f"{path}/{info.filename}", "exec", dont_inherit=True)
                pyc = zipfile.ZipInfo(info.filename + "c", info.date_time)
                pyc.compress_type = zipfile.ZIP_DEFLATED
                zout.writestr(pyc, bytes(_code_to_hash_pyc(code, importlib.util.source_hash(data), checked=True)))
                compiled += 1
        os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return compiled


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else pyspark_zip()
    if not path.is_file():
        print(f"[pyspark-bytecode] {path} does not exist: nothing to compile", file=sys.stderr)
        return 0  # bootstrap goes on: the bytecode only saves CPU
    if has_bytecode(path):
        return 0
    try:
        count = add_bytecode(path)
    except OSError as exc:  # a pyspark this user may not write: its workers compile as before
        print(f"[pyspark-bytecode] left {path} as it is ({exc}): Spark's Python workers compile "
              "pyspark's modules from source, as without this", file=sys.stderr)
        return 0
    print(f"[pyspark-bytecode] compiled {count} modules into {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
