"""Sphinx configuration of sparkdl's documentation site (``tools/docs`` builds it into ``docs/_build``).

The pages are Markdown (MyST). The reference pages are generated from the code at build time
(``docs/generate.py``): the API from the docstrings, every ``RunConfig`` field and
``spark.sparkdl.*`` setting with its default, and the command line from its parser, so that
none of them can drift from the code. Warnings are errors: a broken cross-reference or a stale
name fails the build.
"""

from __future__ import annotations

import pkgutil
import sys
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS))
sys.path.insert(0, str(DOCS.parent))

import generate  # noqa: E402

import sparkdl  # noqa: E402

project = "sparkdl"
author = "the sparkdl authors"
copyright = "the sparkdl authors; Apache-2.0"
release = version = sparkdl.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# The Spark ML classes list their Params as Spark does: read like a function's arguments.
napoleon_custom_sections = [("Params", "params_style")]
nitpicky = True
# Names of other projects: no inventories are fetched (the build runs offline).
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|pyspark|pyarrow|numpy|np|pd|pandas|fsspec|horovod|pa|pq|concurrent|collections|typing|"
               r"threading|socket|subprocess|argparse|pathlib|os|io|types|datetime|dataclasses|enum|abc|optuna)(\..*)?"),
    (r"py:class", r"(Path|Any|Callable|Iterator|Iterable|Mapping|Sequence|T|Self|Generator|NoneType|optional|"
                  r"DataFrame|SparkSession|Tensor|Module|Optimizer|Transformer|ParamMap)"),
    # A type alias of the loader's (dict[str, Any]): autodoc shows its name.
    (r"py:class", r"Batch"),
    # CheckpointStore(writer=...): the run and attempt a rank's store writes for, set by the run
    # itself (sparkdl._internal.ckpt.fence.Writer, internal).
    (r"py:class", r"Writer"),
]

html_theme = "furo"
html_title = f"sparkdl {release}"
html_static_path: list[str] = []


def _internal_reference(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    """A reference to a name of sparkdl that the site does not document (an internal module or
    class) is shown as code without a link, if the name exists; a stale one stays a warning."""
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    contexts = ["", "sparkdl."]  # as written; a public name of sparkdl
    module = node.get("py:module") or ""
    while module:  # the module the reference is made in, and its packages
        contexts.append(module + ".")
        if node.get("py:class"):
            contexts.append(f"{module}.{node['py:class']}.")
        module = module.rpartition(".")[0]
    for prefix in contexts:
        if (prefix + target).startswith("sparkdl.") and _resolves(prefix + target):
            return contnode
    return None


def _resolves(dotted: str) -> bool:
    try:
        pkgutil.resolve_name(dotted)  # imports the longest module prefix, then follows attributes
    except (ImportError, AttributeError, ValueError):
        return False
    return True


def setup(app: Any) -> None:
    generate.write_all(DOCS / "reference" / "_generated")
    app.connect("missing-reference", _internal_reference)
