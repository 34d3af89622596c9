"""tools/pyspark_bytecode.py: the bytecode it stores in pyspark.zip is what a Python worker loads,
instead of compiling the source; a changed source or another Python's bytecode is never used.

Each import runs in a fresh interpreter whose ``compile`` builtin records what it compiles, with
the zip first on ``PYTHONPATH`` as Spark puts pyspark.zip first on its workers' path.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pyspark_bytecode as tool

PROBE = """
import builtins, json, sys
seen = []
real = builtins.compile
def compile(source, filename, *args, **kwargs):
    seen.append(str(filename))
    return real(source, filename, *args, **kwargs)
builtins.compile = compile
import pyspark.worker
print(json.dumps({"value": pyspark.worker.VALUE, "compiled": seen}))
"""


def _zip(path: Path, value: int) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("pyspark/__init__.py", "")
        zf.writestr("pyspark/worker.py", f"VALUE = {value}\n")
        zf.writestr("pyspark/sql/tests/test_x.py", "import nothing_here\n")


def _import_from(path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env={"PYTHONPATH": str(path), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60, cwd=path.parent)
    assert out.returncode == 0, out.stderr
    result: dict = json.loads(out.stdout)
    return result


def test_a_worker_loads_the_stored_bytecode_and_compiles_nothing(tmp_path: Path) -> None:
    path = tmp_path / "pyspark.zip"
    _zip(path, 1)
    before = _import_from(path)
    assert before["value"] == 1 and any(f.endswith("pyspark/worker.py") for f in before["compiled"]), before

    assert not tool.has_bytecode(path)
    assert tool.main([str(path)]) == 0
    assert tool.has_bytecode(path)
    names = zipfile.ZipFile(path).namelist()
    assert "pyspark/worker.pyc" in names and "pyspark/sql/tests/test_x.pyc" not in names  # tests stay source
    assert _import_from(path) == {"value": 1, "compiled": []}

    # Run again: the zip is left as it is.
    stamp = path.stat().st_mtime_ns
    assert tool.main([str(path)]) == 0 and path.stat().st_mtime_ns == stamp


def test_a_source_changed_after_compiling_is_compiled_again_not_the_stale_bytecode(tmp_path: Path) -> None:
    path = tmp_path / "pyspark.zip"
    _zip(path, 1)
    tool.add_bytecode(path)
    pyc = zipfile.ZipFile(path).read("pyspark/worker.pyc")
    _zip(path, 2)  # the source changes (a reinstall), the old bytecode put back beside it
    with zipfile.ZipFile(path, "a") as zf:
        zf.writestr("pyspark/worker.pyc", pyc)
    got = _import_from(path)
    assert got["value"] == 2 and any(f.endswith("pyspark/worker.py") for f in got["compiled"]), got


def test_another_pythons_bytecode_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "pyspark.zip"
    _zip(path, 1)
    with zipfile.ZipFile(path, "a") as zf:
        zf.writestr("pyspark/__init__.pyc", b"\x00\x00\r\n" + bytes(12))  # another magic number
    assert not tool.has_bytecode(path)
    assert tool.add_bytecode(path) == 2  # __init__ and worker
    names = zipfile.ZipFile(path).namelist()
    assert names.count("pyspark/__init__.pyc") == 1 and tool.has_bytecode(path)
    assert _import_from(path) == {"value": 1, "compiled": []}
