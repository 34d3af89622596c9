"""The reference pages that are read from the code, written at every build (``docs/conf.py``):
the settings (every ``RunConfig`` field with its default and its docstring entry, every
``spark.sparkdl.*`` conf of :mod:`sparkdl._internal.spark.confs`) and the command line (its parser's help)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
from pathlib import Path


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def run_config_fields() -> list[tuple[str, str, str]]:
    """(field, default, description) of every RunConfig field, from its dataclass and docstring."""
    from sparkdl import RunConfig

    doc = inspect.getdoc(RunConfig) or ""
    section = doc.split("Attributes:", 1)[1] if "Attributes:" in doc else ""
    described: dict[str, str] = {}
    current, example = None, False
    for line in section.splitlines():
        match = re.match(r"^    (\w+): (.*)$", line)
        if match:
            current, example = match.group(1), False
            described[current] = match.group(2)
        elif current and line.strip().endswith("::"):
            example = True  # an example block: the API page shows it; the table keeps the prose
        elif current and line.startswith("        ") and not example:
            described[current] += " " + line.strip()
    rows = []
    for field in dataclasses.fields(RunConfig):
        if field.name not in described:
            raise RuntimeError(f"RunConfig.{field.name} has no entry under Attributes: in RunConfig's docstring")
        rows.append((field.name, repr(field.default), described[field.name]))
    return rows


def settings_page() -> str:
    from sparkdl._internal.spark import confs

    lines = [
        "# Settings",
        "",
        "Generated from the code at every build: the fields of `sparkdl.RunConfig` and the Spark confs",
        "sparkdl reads. A run takes its bounds and behaviour from a `RunConfig`",
        "(`sparkdl.run(fn, config=sparkdl.RunConfig(...))`); deployment choices that belong to the cluster",
        "rather than to one run are Spark confs (`--conf`, `spark-defaults.conf`, `SparkSession.builder.config`).",
        "sparkdl reads its own confs (`spark.sparkdl.*`) from the session at each call, so `spark.conf.set` on a",
        "running session, classic or Spark Connect, changes them for the next run.",
        "",
        "## `RunConfig` fields",
        "",
        "All durations are in seconds. Invalid values fail at once with a `ConfigError` naming the field.",
        "",
        "| field | default | what it does |",
        "|---|---|---|",
    ]
    for name, default, what in run_config_fields():
        lines.append(f"| `{name}` | `{default}` | {_cell(_plain(what))} |")
    lines += ["", "## Spark confs", "", "| conf | default | what it does |", "|---|---|---|"]
    for conf in confs.ALL:
        lines.append(f"| `{conf.name}` | {_cell(conf.default)} | {_cell(conf.what)} |")
    return "\n".join(lines) + "\n"


def _plain(text: str) -> str:
    """Docstring markup as Markdown: ``x`` -> `x`, :class:`~a.B` -> `B`."""
    text = re.sub(r":\w+:`~?([\w.]+)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)
    return text.replace("``", "`")


def cli_page() -> str:
    from sparkdl._internal.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal's width: the page does not depend on it
    parser = build_parser()
    lines = ["# Command line", "", "Generated from the `sparkdl` command's own parser at every build.", "",
             "```text", parser.format_help().rstrip(), "```"]
    for action in parser._actions:  # the subcommands' parsers
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                lines += ["", f"## `sparkdl {name}`", "", "```text", sub.format_help().rstrip(), "```"]
    return "\n".join(lines) + "\n"


def write_all(out: Path) -> None:
    """Writes the generated pages under ``out``; a page whose text did not change is left as it is."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("settings.md", settings_page()), ("cli.md", cli_page())):
        path = out / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
