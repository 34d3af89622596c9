"""The suite's own rule for Spark sessions (tests/conftest.py): a session other than the shared
``local[2]`` is started by a fixture that says which with ``@needs_session``, so that collection
can run the tests of each session together and none is started twice. A fixture or a test that
calls ``spark_session(...)`` without it brings the restarts back (tens of seconds each)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import TESTS

# The factory itself, and the fixture that takes whatever session runs (no master of its own).
_EXEMPT = {("conftest.py", "spark_session"), ("conftest.py", "any_spark")}


def _calls_spark_session(func: ast.FunctionDef) -> bool:
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "spark_session"
               for node in ast.walk(func))


def _decorator_names(func: ast.FunctionDef) -> set[str]:
    names = set()
    for dec in func.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        names.add(ast.unparse(target))
    return names


def _offenders() -> list[str]:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef) or (path.name, func.name) in _EXEMPT:
                continue
            if not _calls_spark_session(func):
                continue
            decorators = _decorator_names(func)
            where = f"{path.relative_to(TESTS)}:{func.lineno} {func.name}"
            if func.name.startswith("test_"):
                found.append(f"{where}: a test starts its session itself; ask for a fixture marked @needs_session")
            elif "needs_session" not in decorators:
                found.append(f"{where}: a fixture starts a session without @needs_session(label)")
    return found


def test_every_session_is_started_by_a_fixture_that_names_it() -> None:
    assert _offenders() == []


def test_the_rule_finds_a_fixture_without_its_label(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import test_suite_rules as rules

    (tmp_path / "test_x.py").write_text(
        "import pytest\n\n"
        "@pytest.fixture\n"
        "def other(spark_session):\n"
        "    return spark_session('local[3]')\n\n"
        "def test_y(spark_session):\n"
        "    spark_session('local[4]')\n"
    )
    monkeypatch.setattr(rules, "TESTS", tmp_path)
    assert [line.split(": ", 1)[1] for line in rules._offenders()] == [
        "a fixture starts a session without @needs_session(label)",
        "a test starts its session itself; ask for a fixture marked @needs_session",
    ]


def test_the_stack_rule_runs_stack_independent_unit_tests_once_and_the_rest_on_both(tmp_path: Path) -> None:
    import stack_rule

    def file(name: str, source: str) -> Path:
        path = tmp_path / name
        path.write_text(source)
        return path

    both = ["modern", "classic"]
    plain = file("test_plain.py", "from sparkdl._internal.task import workdir\n")
    arrow = file("test_arrow.py", "def test_x():\n    import pyarrow\n")
    keras = file("test_keras.py", "import tensorflow as tf\n")
    # A test reaching a package the stacks differ in runs on both, whatever runs.
    assert stack_rule.one_stack_enough(arrow, "unit") is None
    assert stack_rule.one_stack_enough(plain, "integration") is None  # a JVM: pyspark
    assert "reaches none of pyspark" in str(stack_rule.one_stack_enough(plain, "unit"))
    # With both stacks: the classic one runs it, unless only the modern stack has what it imports.
    assert stack_rule.home_stack(plain, both, "modern")[0] == "classic"
    assert stack_rule.home_stack(keras, both, "classic") == (
        "modern", "it reaches tensorflow, which only the modern stack installs")
    # One stack (or an unknown set): that stack runs everything.
    assert stack_rule.home_stack(plain, ["modern"], "modern")[0] == "modern"
    assert stack_rule.home_stack(plain, [], "classic")[0] == "classic"
