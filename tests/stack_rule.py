"""Which tests one stack may run for both, as a rule read from the code.

The two stacks (``constraints/modern.txt``, ``constraints/classic.txt``) pin the same torch,
Python and sparkdl; they differ only in pyspark, pyarrow, numpy, pandas and Petastorm (and
py4j/protobuf, which come with them). A test can behave differently on the two stacks only if it
reaches one of those packages. So:

- every test that needs a JVM (``tests/integration``, ``tests/cluster``, ``tests/e2e``) goes
  through pyspark and runs on both stacks;
- a test of ``tests/unit`` runs on both stacks when its file, or a sparkdl module it imports
  (followed through sparkdl's own imports, those inside functions included), imports one of the
  stack's packages; otherwise one stack runs it, and the summaries say which and why.

That one stack is the classic stack when both run in this invocation (``tools/test`` says which
in ``SPARKDL_TEST_STACKS``): its lane is the shorter one in CI (see docs/contributing.md). A test
that reaches a package only the modern stack installs (TensorFlow, NVIDIA DALI) stays on the
modern stack. With one stack, that stack runs them all.

Package ``__init__`` files are not followed as a side effect of importing a submodule: importing
``sparkdl._internal.wire.messages`` runs ``sparkdl/__init__.py``, but the test exercises the wire module,
not the data path that ``sparkdl/__init__`` re-exports.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

# What differs between constraints/modern.txt and constraints/classic.txt (and only that).
STACK_PACKAGES = ("pyspark", "pyarrow", "numpy", "pandas", "petastorm", "py4j")
# What tools/bootstrap.sh installs on the modern stack only.
MODERN_ONLY = ("tensorflow", "nvidia")

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "sparkdl"


def _module_file(name: str) -> Path | None:
    """The file of sparkdl module ``name`` (``sparkdl._internal.data.loader``), or None if it is not one."""
    parts = name.split(".")
    if parts[0] != PACKAGE:
        return None
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path, module: str | None) -> set[str]:
    """Every module name that ``path`` imports, anywhere in the file (relative ones resolved)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level and module:
                package = module.split(".")
                # A package's __init__ is its own package; a plain module's package is its parent.
                keep = len(package) - node.level + (1 if path.name == "__init__.py" else 0)
                base = ".".join(package[:keep] + ([base] if base else []))
            found.add(base)
            # ``from sparkdl._internal.data import loader`` imports the module sparkdl._internal.data.loader.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


@functools.cache
def _reach(module: str) -> frozenset[str]:
    """The stack packages (and modern-only ones) that sparkdl module ``module`` reaches through
    sparkdl's own imports."""
    seen: set[str] = set()
    hits: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _module_file(name)
        if path is None:
            continue
        for imported in _imports(path, name):
            top = imported.split(".")[0]
            if top in STACK_PACKAGES or top in MODERN_ONLY:
                hits.add(top)
            elif top == PACKAGE and _module_file(imported) is not None and imported != PACKAGE:
                todo.append(imported)
    return frozenset(hits)


@functools.cache
def stack_packages_reached(test_file: Path) -> tuple[frozenset[str], tuple[str, ...]]:
    """(the stack packages, and modern-only ones, the test file reaches; the sparkdl modules it imports directly)."""
    hits: set[str] = set()
    direct = sorted(
        name for name in _imports(test_file, None)
        if name.split(".")[0] == PACKAGE and _module_file(name) is not None
    )
    for name in _imports(test_file, None):
        top = name.split(".")[0]
        if top in STACK_PACKAGES or top in MODERN_ONLY:
            hits.add(top)
    for name in direct:
        hits.update(_reach(name))
    return frozenset(hits), tuple(direct)


def one_stack_enough(test_file: Path, tier: str) -> str | None:
    """Why one stack may run this test file for both, or None if both must run it."""
    if tier != "unit":
        return None
    hits, direct = stack_packages_reached(test_file)
    if hits & set(STACK_PACKAGES):
        return None
    through = ", ".join(direct) or "no sparkdl module"
    return f"needs no JVM and reaches none of {', '.join(STACK_PACKAGES)} (imports {through})"


def home_stack(test_file: Path, running: list[str], current: str) -> tuple[str, str]:
    """The stack that runs a test :func:`one_stack_enough` allows, and why that one, given the
    stacks ``running`` in this invocation: with both, the classic one unless the test reaches a
    package only the modern one has; otherwise ``current``, which then runs everything."""
    if set(running) != {"modern", "classic"}:
        return current, "the only stack running"
    hits, _ = stack_packages_reached(test_file)
    if reached := sorted(hits & set(MODERN_ONLY)):
        return "modern", f"it reaches {', '.join(reached)}, which only the modern stack installs"
    return "classic", "the classic stack's lane ends earlier in CI"
