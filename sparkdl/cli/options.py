"""What the subcommands share: their exit statuses and their Spark options.

``--master``, ``--conf KEY=VALUE`` (repeatable) and ``--properties-file FILE`` mean what they
mean to ``spark-submit``; :func:`spark_confs` merges the last two, the command line winning.
"""

from __future__ import annotations

import argparse

from sparkdl.session import conf_pair, read_properties

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT = 0, 1, 2, 124


def add_spark_options(p: argparse.ArgumentParser) -> None:
    """Adds ``--master``, ``--conf`` and ``--properties-file`` to a subcommand's parser."""
    p.add_argument("--master", default=None, help="Spark master URL (default: spark.master from --properties-file, else local)")
    p.add_argument("--conf", metavar="KEY=VALUE", type=conf_pair, action="append", default=[],
                   help="a Spark conf; repeat for more")
    p.add_argument("--properties-file", metavar="FILE", default=None, help="Spark confs, spark-defaults.conf style")


def spark_confs(args: argparse.Namespace) -> dict[str, str]:
    """The confs of ``--properties-file``, overridden by those of ``--conf``.

    Raises :class:`~sparkdl.errors.ConfigError` for a bad line in the file (naming file:line),
    ``FileNotFoundError`` when it does not exist.
    """
    confs = read_properties(args.properties_file) if args.properties_file else {}
    confs.update(dict(args.conf))
    return confs
