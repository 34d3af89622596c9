"""The layout of the package, checked: imports run one way, no cycles, no borrowed private
names, no module over 600 lines (a sanity bound: modules split where their meaning does, not at a
line count), no two modules of one name. Imports inside functions count as much as module-level ones."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import REPO

ROOT = REPO / "sparkdl"
MAX_LINES = 600

# The stages of the path, lowest first, named inside sparkdl._internal: a module may import modules
# of a lower layer, or of its own group (same layer and same top-level name). The leaves (layer 0)
# may import each other; the cycle test keeps that one way. The public faces (sparkdl itself,
# sparkdl.data, .ml, .compat) sit on top of the internals, and the command line on top of them.
LAYERS: list[set[str]] = [
    {"common", "spark", "fs", "wire", "sparkdl._version"},
    # "backends": every backend, for every side (the driver's check, the task's part, the rank's setup).
    {"ckpt", "backends"},
    {"rank"},
    {"train", "data"},
    {"task"},
    {"driver"},
    {"compat", "ml", "tune"},
    {"sparkdl.data", "sparkdl.ml", "sparkdl.compat", "sparkdl"},
    # The command line is an application of the public API (it calls sparkdl.run, sparkdl.RunConfig).
    {"cli"},
    # ``python -m sparkdl`` runs the command line; "_internal": the package's own __init__, a docstring.
    {"sparkdl.__main__", "_internal"},
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found["sparkdl." + ".".join(parts) if parts != ["__init__"] else "sparkdl"] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[tuple[str, str | None]]:
    """(imported module, imported name) pairs of one module, wherever in it they are."""
    is_package = path.name == "__init__.py"
    out: set[tuple[str, str | None]] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update((a.name, None) for a in node.names if a.name.startswith("sparkdl"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_package else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            if not base.startswith("sparkdl"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add((sub, None) if sub in MODULES else (base, alias.name))
    return out


def _owner(module: str) -> str:
    """The module that defines what ``module`` names (a package's names live in its __init__)."""
    while module not in MODULES and "." in module:
        module = module.rsplit(".", 1)[0]
    return module


GRAPH = {name: {_owner(m) for m, _ in _imports(name, path)} - {name} for name, path in MODULES.items()}


def _layer(module: str) -> tuple[int, str]:
    # Internal modules by their name inside sparkdl._internal, public ones by their full name.
    rel = module.removeprefix("sparkdl._internal.") if module.startswith("sparkdl._internal.") else module
    rel = "_internal" if rel == "sparkdl._internal" else rel
    best: tuple[int, str] | None = None
    for index, layer in enumerate(LAYERS):
        for key in layer:
            if (rel == key or rel.startswith(key + ".")) and (best is None or len(key) > len(best[1])):
                best = (index, key)
    assert best is not None, f"{module} is in no layer of tests/unit/test_layout.py: place it"
    return best


def test_no_module_is_over_600_lines() -> None:
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_every_module_name_is_unique_in_the_package() -> None:
    # A name says which module it is, in a traceback, a log line or a search ("probe.py": which?).
    seen: dict[str, list[str]] = {}
    for path in ROOT.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}


def test_no_import_cycles() -> None:
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(GRAPH.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join([*stack[stack.index(dep):], dep]))
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_module_imports_another_modules_private_name() -> None:
    borrowed = [
        f"{name} imports {mod}.{attr}"
        for name, path in MODULES.items()
        for mod, attr in _imports(name, path)
        if (attr or mod.rsplit(".", 1)[-1]).startswith("_")
        and not (attr or "").startswith("__")
        and mod.rsplit(".", 1)[-1] != "__main__"
        and _owner(mod) != name
        # a leaf module whose name starts with "_" is private to the package, not to a module
        and not (attr is None and mod.count(".") == 1)
    ]
    assert not borrowed, "\n".join(borrowed)


def test_imports_run_one_way_from_the_public_api_down_to_the_leaves() -> None:
    wrong = []
    for name, deps in GRAPH.items():
        here, group = _layer(name)
        for dep in deps:
            there, dep_group = _layer(dep)
            same_group = dep_group.split(".")[0] == group.split(".")[0]
            if there > here or (there == here and here > 0 and not same_group):
                wrong.append(f"{name} (layer {here}) imports {dep} (layer {there})")
    assert not wrong, "\n".join(sorted(wrong))


@pytest.mark.parametrize("layer", range(len(LAYERS)))
def test_every_layer_names_existing_modules(layer: int) -> None:
    # A renamed module must not leave a rule behind that no longer checks anything.
    for key in LAYERS[layer]:
        assert any(_layer(m)[1] == key for m in MODULES), f"no module for layer entry {key!r}"


# The data path's stages, in order (sparkdl/_internal/data/__init__.py): a module of one imports
# modules of its own stage or of earlier ones. "": the loader, the tf.data view and the Dataset
# handle, at the top of the folder, which join the stages before them.
DATA_STAGES = ["format", "decoding", "reading", "", "writing"]
DATA = "sparkdl._internal.data"


def _data_stage(module: str) -> int | None:
    if not module.startswith(DATA + "."):
        return None
    rest = module.removeprefix(DATA + ".").split(".")
    return DATA_STAGES.index(rest[0] if len(rest) > 1 or rest[0] in DATA_STAGES else "")


def test_the_data_path_imports_its_stages_one_way() -> None:
    folders = {p.name for p in (ROOT / "_internal" / "data").iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(DATA_STAGES) - {""}, f"stages of sparkdl/_internal/data: {sorted(folders)}"
    wrong = [
        f"{name} ({DATA_STAGES[here] or 'top'}) imports {dep} ({DATA_STAGES[there] or 'top'})"
        for name, deps in GRAPH.items()
        if (here := _data_stage(name)) is not None
        for dep in deps
        if (there := _data_stage(dep)) is not None and there > here
    ]
    assert not wrong, "\n".join(sorted(wrong))


def test_argument_errors_have_one_shape() -> None:
    # "X must be ALLOWED; got V" (sparkdl/_internal/common/validate.py), not "X=V: give ..." beside it.
    other = re.compile(r"=\{[^}]*!r\}\)?: (give|choose) ")
    found = [f"{path.relative_to(ROOT)}:{n}" for path in ROOT.rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1) if other.search(line)]
    assert not found, f"argument errors of another shape (use common.validate.invalid): {found}"


# Tests of the package as a whole, at the top of tests/unit; every other unit test sits in the
# folder of what it tests: sparkdl/_internal/<folder>, or the repository's jobs/ and tools/.
WHOLE_PACKAGE_TESTS = {"test_layout.py", "test_public_api.py", "test_docs_tree.py", "test_suite_rules.py"}


def test_the_unit_tests_mirror_the_package() -> None:
    unit = REPO / "tests" / "unit"
    folders = {p.name for p in (ROOT / "_internal").iterdir() if (p / "__init__.py").is_file()} | {"jobs", "tools"}
    stray = sorted(p.name for p in unit.iterdir() if p.is_dir() and p.name != "__pycache__" and p.name not in folders)
    assert not stray, f"tests/unit folders with no sparkdl/_internal folder of that name: {stray}"
    loose = sorted(p.name for p in unit.glob("*.py") if p.name not in WHOLE_PACKAGE_TESTS)
    assert not loose, f"unit tests outside the folder of what they test: {loose}"
