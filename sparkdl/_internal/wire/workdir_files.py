"""The files a rank and the process that owns it (its Spark task, or the driver-local launcher)
exchange through the rank's working directory: one writer and one reader each, named here alone.

====================  ==========================  =====================================
file                  written by                  read by
====================  ==========================  =====================================
``payload.pkl``       the owner, before the start  the rank: the function and arguments
``result.pkl``        rank 0, when ``fn`` returns  the owner: rank 0's value, pickled
``error.json``        a rank that failed           the owner: the error for the report
``stacks.txt``        the rank's stack handler     the owner, when the driver asks
====================  ==========================  =====================================

A rank writes ``result.pkl`` and ``error.json`` under a temporary name first, so that the owner
never reads half a file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PAYLOAD = "payload.pkl"
RESULT = "result.pkl"
ERROR = "error.json"
STACKS = "stacks.txt"


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_payload(workdir: Path, fn_bytes: bytes) -> None:
    (workdir / PAYLOAD).write_bytes(fn_bytes)


def payload_path(workdir: Path) -> Path:
    return workdir / PAYLOAD


def write_result(workdir: Path, data: bytes) -> None:
    write_atomically(workdir / RESULT, data)


def result_path(workdir: Path) -> Path:
    """Where rank 0's pickled value is once it returned (the owner streams it back from here)."""
    return workdir / RESULT


def write_error(workdir: Path, error: str, traceback: str, at: float) -> None:
    """A failed rank's error line, traceback and ``time.time()`` of its host (the report orders by it)."""
    write_atomically(workdir / ERROR, json.dumps({"error": error, "traceback": traceback, "at": at}).encode())


def read_error(workdir: Path) -> tuple[str | None, str | None, float | None]:
    """The error, traceback and time a failed rank recorded in its workdir, if it could."""
    try:
        info = json.loads((workdir / ERROR).read_text())
        at = info.get("at")
        return info.get("error"), info.get("traceback"), float(at) if isinstance(at, int | float) else None
    except (OSError, ValueError, AttributeError):
        return None, None, None


def stacks_path(workdir: Path) -> Path:
    """Where the rank's stack handler appends its stacks (present once the handler is in place)."""
    return workdir / STACKS
