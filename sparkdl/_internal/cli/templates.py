"""``sparkdl conf``: the configuration templates that ship inside the package (``sparkdl/conf/``),
so that a user who installed the wheel has every file a message or a page points at.

``sparkdl conf`` lists them; ``sparkdl conf gpu`` prints one (to copy into
``$SPARK_HOME/conf/spark-defaults.conf`` or pass to ``--properties-file``); ``sparkdl conf
gpu-discovery --path`` prints where it is installed (for ``spark.*.resource.gpu.discoveryScript``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sparkdl._internal.cli.options import EXIT_OK, EXIT_USAGE

DIR = Path(__file__).resolve().parents[2] / "conf"
TEMPLATES = {
    "cpu": ("spark-defaults.conf", "Spark settings for sparkdl on a CPU cluster"),
    "gpu": ("spark-defaults.gpu.conf", "Spark settings for a GPU cluster: one GPU per task"),
    "gpu-discovery": ("gpu-discovery.sh", "Spark's GPU discovery script (nvidia-smi)"),
    "log4j2": ("log4j2.properties", "a quiet Spark log: warnings and errors only"),
    "jobs": ("sparkdl-defaults.conf", "the defaults of the jobs' options (jobs/)"),
    "build-horovod": ("build-horovod.sh", "builds Horovod against a venv's torch: bash it with the venv's path"),
}


def path_of(name: str) -> Path:
    """The installed file of template ``name`` (a key of :data:`TEMPLATES`)."""
    return DIR / TEMPLATES[name][0]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("conf", help="print a configuration template that ships with sparkdl",
                       description="Prints a configuration template that ships with sparkdl, or lists them.")
    p.add_argument("name", nargs="?", choices=sorted(TEMPLATES), help="the template (none: list them)")
    p.add_argument("--path", action="store_true", help="print where the file is installed instead of its text")
    p.set_defaults(func=conf_command)


def conf_command(args: argparse.Namespace) -> int:
    if args.name is None:
        if args.path:
            print(DIR)
            return EXIT_OK
        width = max(map(len, TEMPLATES))
        for name, (file, what) in TEMPLATES.items():
            print(f"{name:<{width}}  {file:<24}  {what}")
        print(f"\n`sparkdl conf NAME` prints one; `--path` where it is ({DIR}).")
        return EXIT_OK
    path = path_of(args.name)
    if not path.is_file():
        print(f"sparkdl conf: {path} is missing from this installation; reinstall sparkdl", file=sys.stderr)
        return EXIT_USAGE
    if args.path:
        print(path)
    else:
        sys.stdout.write(path.read_text())
    return EXIT_OK
