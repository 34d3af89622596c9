"""The contributor pages name modules that exist: every ``path.py`` that docs/architecture.md and
docs/contributing.md put in backticks is a file of this checkout (a path as the pages write it:
from the repository, from ``sparkdl/_internal`` or ``tests``, or a bare name found in the package, the tools,
the tests, the jobs or the benchmarks). A module moved or renamed without its page fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO

PAGES = [REPO / "docs" / "architecture.md", REPO / "docs" / "contributing.md"]
ROOTS = [REPO, REPO / "sparkdl" / "_internal", REPO / "sparkdl", REPO / "tests"]
WHERE = ["sparkdl", "tools", "tests", "jobs", "benchmarks", "docs", "deploy"]
NAMED = re.compile(r"`([A-Za-z0-9_./-]+\.py)`")


def _exists(name: str) -> bool:
    if "/" in name:
        return any((root / name).is_file() for root in ROOTS)
    return any(next((REPO / where).rglob(name), None) is not None for where in WHERE)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_module_a_page_names_exists(page: Path) -> None:
    named = sorted(set(NAMED.findall(page.read_text())))
    assert len(named) > 10, f"{page.name} names almost no module: is the pattern still right?"
    missing = [name for name in named if not _exists(name)]
    assert not missing, f"{page.relative_to(REPO)} names modules that are not in the tree: {missing}"


def test_a_moved_module_is_caught(tmp_path: Path) -> None:
    assert _exists("backends/horovod/mpi.py") and _exists("driver/local.py") and _exists("check_packed.py")
    assert not _exists("task/mpi.py") and not _exists("backends/horovod_gloo.py")
