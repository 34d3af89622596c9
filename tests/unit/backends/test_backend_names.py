"""A backend is one class (sparkdl/_internal/backends): nothing outside that folder decides by a
backend's name, so adding a backend is adding a class. The check reads every module's syntax
tree for a comparison of something named like a backend with a backend's name (``backend ==
"horovod"``, ``spec.backend in ("torch", ...)``, ``args.backend != "torch"``)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

from sparkdl._internal.backends import BACKENDS, get_backend

PACKAGE = REPO / "sparkdl"
HOME = PACKAGE / "_internal" / "backends"


def _names(node: ast.AST) -> set[str]:
    """The backend names a comparison's operand spells out (a string, or a tuple/list/set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & set(BACKENDS)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_names(e) for e in node.elts)) if node.elts else set()
    return set()


def _about_a_backend(node: ast.AST) -> bool:
    return any("backend" in (n.id if isinstance(n, ast.Name) else n.attr).lower()
               for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute)))


def branches(path: Path) -> list[str]:
    """``line: comparison`` for each comparison of a backend-named thing with a backend's name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            named = set().union(*(_names(o) for o in operands))
            if named and any(_about_a_backend(o) for o in operands if not _names(o)):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_outside_backends_branches_on_a_backends_name() -> None:
    found = [f"{path.relative_to(REPO)}:{hit}" for path in sorted(PACKAGE.rglob("*.py")) if HOME not in path.parents
             for hit in branches(path)]
    assert not found, "decide through the backend's class (sparkdl/_internal/backends) instead:\n" + "\n".join(found)


def test_the_check_finds_each_form_of_such_a_branch(tmp_path: Path) -> None:
    # The check above would also pass by finding nothing anywhere.
    source = tmp_path / "branchy.py"
    source.write_text('if run.backend == "tensorflow":\n    pass\n'
                      'if spec.backend in ("torch", "horovod"):\n    pass\n'
                      'ok = backend not in BACKENDS\n'
                      'if args.backend != "none":\n    pass\n')
    assert branches(source) == ["1: run.backend == 'tensorflow'", "3: spec.backend in ('torch', 'horovod')",
                                "6: args.backend != 'none'"]


def test_every_registered_backend_is_a_class_of_its_own_name() -> None:
    for name in BACKENDS:
        assert get_backend(name).name == name
