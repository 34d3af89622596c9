"""The rank's working directory is a contract between two processes: its files are named in
sparkdl/_internal/wire/workdir_files.py alone, each with one writer and one reader there."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO

from sparkdl._internal.wire import workdir_files as wf

NAMES = (wf.PAYLOAD, wf.RESULT, wf.ERROR, wf.STACKS)


def test_the_file_names_are_spelled_in_the_contract_alone() -> None:
    spelled = re.compile("|".join(re.escape(f'"{n}"') for n in NAMES))
    found = [f"{p.relative_to(REPO)}:{i}" for p in sorted((REPO / "sparkdl").rglob("*.py"))
             if p.name != "workdir_files.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if spelled.search(line)]
    assert not found, f"use sparkdl._internal.wire.workdir_files instead: {found}"


def test_an_error_round_trips_and_a_torn_one_reads_as_none(tmp_path: Path) -> None:
    assert wf.read_error(tmp_path) == (None, None, None)  # the rank recorded nothing
    wf.write_error(tmp_path, "ValueError: bad", "Traceback ...", 1700000000.5)
    assert wf.read_error(tmp_path) == ("ValueError: bad", "Traceback ...", 1700000000.5)
    (tmp_path / wf.ERROR).write_text('{"error": "Value')  # a rank killed mid-write, had it written in place
    assert wf.read_error(tmp_path) == (None, None, None)


def test_the_result_is_written_under_a_temporary_name_first(tmp_path: Path) -> None:
    wf.write_result(tmp_path, b"value")
    assert wf.result_path(tmp_path).read_bytes() == b"value"
    assert sorted(p.name for p in tmp_path.iterdir()) == [wf.RESULT]
