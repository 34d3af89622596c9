"""``sparkdl pack``: this Python environment as one archive, for executors that have nothing installed.

    sparkdl pack -o env.tar.gz
    spark-submit --archives env.tar.gz#env --conf spark.pyspark.python=./env/bin/python \\
        --conf spark.pyspark.driver.python=$(which python) job.py

Spark unpacks the archive into each executor's working directory as ``env`` (the name after
``#``), and its Python workers, so every rank, run ``./env/bin/python``. The venv is packed by
venv-pack (``pip install 'sparkdl[pack]'``), which rewrites its scripts to be relocatable; the
interpreter itself is not packed: ``env/bin/python`` links to the venv's base Python, which every
executor host needs at the same path (``--python-prefix`` names another one).

Left out: pyspark and py4j, which the cluster's Spark brings (its pyspark comes first on its
workers' path, and a second copy is half a gigabyte). Refused before anything is written: an
archive named .tar (Spark cannot unpack a venv from one), a Python that is not a venv (a conda
environment is packed by conda-pack), a venv without torch, pyarrow or sparkdl, and a sparkdl
installed in editable mode, whose code stays in the checkout.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import sys
import time
from pathlib import Path

from sparkdl._internal.cli.options import EXIT_FAILED, EXIT_OK

NEEDED = ("torch", "pyarrow", "sparkdl")
# What the cluster's Spark brings: not packed.
LEFT_OUT = ("pyspark", "py4j")


class PackError(Exception):
    """Why this environment cannot be packed, with what to do."""


def _site_packages(prefix: Path) -> Path:
    found = sorted(prefix.glob("lib/python3*/site-packages"))
    if not found:
        raise PackError(f"{prefix} has no lib/python3.*/site-packages: not a venv sparkdl pack knows")
    return found[0]


def check_venv(prefix: Path) -> None:
    """Refuses a ``prefix`` that is not a venv, lacks one of :data:`NEEDED`, or has sparkdl editable."""
    if not (prefix / "pyvenv.cfg").is_file():
        raise PackError(f"{prefix} is not a virtual environment (no pyvenv.cfg): run sparkdl pack with the "
                        "venv's own Python (path/to/venv/bin/sparkdl pack); a conda environment is packed by "
                        "conda-pack, a system Python by neither (make a venv)")
    site = _site_packages(prefix)
    dists = {d.metadata["Name"].lower().replace("_", "-"): d for d in md.distributions(path=[str(site)])}
    missing = [name for name in NEEDED if name not in dists]
    if missing:
        raise PackError(f"the venv {prefix} lacks {', '.join(missing)}: the executors need them; pip install "
                        "them there first (torch: the build for the executors' hardware)")
    text = dists["sparkdl"].read_text("direct_url.json")
    if text and json.loads(text).get("dir_info", {}).get("editable"):
        raise PackError(f"sparkdl is installed in {prefix} in editable mode (pip install -e): its code stays in "
                        f"{json.loads(text).get('url', 'the checkout')}, which executors do not have; install "
                        "it as a wheel (pip install . , or pip install sparkdl) and pack again")


def check_format(output: Path) -> None:
    """Refuses a plain ``.tar``: Spark (3.5 and 4 checked) unpacks it with Java code of its own, which
    fails the application at its start on a venv's archive ("expanding bin/python3.11 would create
    entry outside of ..."), where it unpacks a .tar.gz with the system's tar."""
    if output.name.lower().endswith(".tar"):
        raise PackError(f"{output.name}: Spark cannot unpack a venv from a plain .tar (the application fails at "
                        "its start: \"expanding bin/python3.11 would create entry outside of ...\"): name it "
                        f"{output.name}.gz (--compress-level 0 for no compression)")


def pack(prefix: Path, output: Path, *, python_prefix: str | None = None, compress_level: int = 4,
         exclude: list[str] | None = None, force: bool = False) -> Path:
    """Packs the venv at ``prefix`` into ``output`` (its format from the name: .tar.gz, .tgz,
    .zip) without pyspark and py4j; returns the archive's path. Raises PackError."""
    check_format(output)
    check_venv(prefix)
    try:
        import venv_pack
    except ImportError:
        raise PackError("sparkdl pack needs venv-pack: pip install 'sparkdl[pack]' (or venv-pack2) into "
                        f"the venv {prefix}") from None
    site = _site_packages(prefix).relative_to(prefix)
    patterns = [f"{site}/{name}{tail}" for name in LEFT_OUT for tail in ("/*", "-*")] + list(exclude or [])
    if output.exists() and not force:
        raise PackError(f"{output} exists: remove it or pass --force")
    try:
        done = venv_pack.pack(prefix=str(prefix), output=str(output), python_prefix=python_prefix,
                              compress_level=compress_level, force=force,
                              filters=[("exclude", pattern) for pattern in patterns])
    except venv_pack.VenvPackException as exc:
        raise PackError(f"venv-pack refused {prefix}: {exc}") from None
    return Path(done)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pack", help="pack this venv into an archive for executors with nothing installed",
                       description="Packs this Python's venv (torch, pyarrow, sparkdl and the rest, without "
                       "pyspark and py4j, which the cluster's Spark brings) into an archive that spark-submit "
                       "--archives ships to every executor, and prints the settings that use it.")
    p.add_argument("-o", "--output", default="sparkdl-env.tar.gz",
                   help="the archive; .tar.gz, .tgz or .zip (default: %(default)s)")
    p.add_argument("--name", default="env", help="the directory it unpacks to on executors (default: %(default)s)")
    p.add_argument("--python-prefix", default=None,
                   help="where the executors' base Python lives, if not where this venv's does (e.g. /usr)")
    p.add_argument("--compress-level", type=int, default=4, choices=range(10), metavar="0-9",
                   help="gzip level: 1 is about 3x faster than the default and a few %% larger (default: %(default)s)")
    p.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="also leave out files matching PATTERN (relative to the venv); repeatable")
    p.add_argument("--force", action="store_true", help="overwrite the archive")
    p.set_defaults(func=pack_command)


def pack_command(args: argparse.Namespace) -> int:
    prefix, output = Path(sys.prefix), Path(args.output).resolve()
    started = time.monotonic()
    try:
        done = pack(prefix, output, python_prefix=args.python_prefix, compress_level=args.compress_level,
                    exclude=args.exclude, force=args.force)
    except PackError as exc:
        print(f"sparkdl pack: {exc}", file=sys.stderr)
        return EXIT_FAILED
    base = args.python_prefix or os.path.realpath(sys.base_prefix)
    size = done.stat().st_size / 2**20
    print(f"packed {prefix} into {done} ({size:,.0f} MiB) in {time.monotonic() - started:.0f} s, without "
          f"{' and '.join(LEFT_OUT)} (the cluster's Spark brings them).\n"
          f"The executors need Python {sys.version_info[0]}.{sys.version_info[1]} at {base} (the packed "
          "python links there). Ship it with:\n"
          f"  spark-submit --archives {done}#{args.name} --conf spark.pyspark.python=./{args.name}/bin/python \\\n"
          f"      --conf spark.pyspark.driver.python={sys.executable} ...\n"
          f"or the confs spark.archives={done}#{args.name} and spark.pyspark.python=./{args.name}/bin/python "
          "(a driver started as `python job.py` keeps its own Python).")
    return EXIT_OK
