"""What the subcommands share: their exit statuses, their Spark options and their session.

``--master``, ``--conf KEY=VALUE`` (repeatable) and ``--properties-file FILE`` mean what they
mean to ``spark-submit``; :func:`spark_confs` merges the last two, the command line winning.
``--remote sc://host:port`` (else ``spark.remote`` from the confs, else the ``SPARK_REMOTE``
environment variable, as pyspark reads them) makes the command a Spark Connect client:
:func:`cli_session` then builds ``SparkSession.builder.remote(url)`` instead of a session with a
``SparkContext`` of its own.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.spark.session import conf_pair, create_session, read_properties
from sparkdl._internal.spark.spark_api import of

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT = 0, 1, 2, 124
# The port of an sc:// URL that names none, as the Connect client takes it.
DEFAULT_CONNECT_PORT = 15002

# Spark Connect: the master is the server's, and the client sends these to nobody.
_NOT_SENT_OVER_CONNECT = ("spark.master", "spark.remote")


def add_spark_options(p: argparse.ArgumentParser) -> None:
    """Adds ``--master``, ``--remote``, ``--conf`` and ``--properties-file`` to a subcommand's parser."""
    p.add_argument("--master", default=None, help="Spark master URL (default: spark.master from --properties-file, else local)")
    p.add_argument("--remote", metavar="URL", default=None,
                   help="a Spark Connect server, sc://host:port, instead of a Spark of this process's own "
                   "(default: spark.remote from the confs, else $SPARK_REMOTE); not with --master")
    p.add_argument("--conf", metavar="KEY=VALUE", type=conf_pair, action="append", default=[],
                   help="a Spark conf; repeat for more")
    p.add_argument("--properties-file", metavar="FILE", default=None, help="Spark confs, spark-defaults.conf style")


def spark_confs(args: argparse.Namespace) -> dict[str, str]:
    """The confs of ``--properties-file``, overridden by those of ``--conf``.

    Raises :class:`~sparkdl._internal.common.errors.ConfigError` for a bad line in the file (naming file:line),
    ``FileNotFoundError`` when it does not exist.
    """
    confs = read_properties(args.properties_file) if args.properties_file else {}
    confs.update(dict(args.conf))
    return confs


def remote_url(args: argparse.Namespace, confs: Mapping[str, str]) -> str | None:
    """The Spark Connect URL the command connects to, or None for a classic session.

    ``--remote``, else ``spark.remote`` in ``confs``, else ``$SPARK_REMOTE``. Raises
    :class:`~sparkdl._internal.common.errors.ConfigError` when ``--master`` chooses a master as well: the two
    choose between a Spark of this process's own and a Connect server's.
    """
    given = args.remote or confs.get("spark.remote") or os.environ.get("SPARK_REMOTE") or None
    if given is None or args.master is None:
        return given
    source = ("--remote" if args.remote else "--conf spark.remote" if confs.get("spark.remote")
              else "the SPARK_REMOTE environment variable")
    raise ConfigError(
        f"--master {args.master} and {source} ({given}) both choose the Spark to run on: --master starts "
        "a Spark session in this process, --remote connects to a Spark Connect server, which has its "
        "own master. Give one of them" + (" (unset SPARK_REMOTE to use --master)" if "SPARK_REMOTE" in source else "")
    )


def cli_session(args: argparse.Namespace, confs: Mapping[str, str], app_name: str, default_master: str) -> SparkSession:
    """The session a command runs on: a Spark Connect client when :func:`remote_url` gives a URL,
    else :func:`sparkdl._internal.spark.session.create_session` with ``--master``."""
    url = remote_url(args, confs)
    if url is None:
        return create_session(args.master, confs, app_name, default_master)
    return connect_session(url, confs, app_name)


def connect_session(url: str, confs: Mapping[str, str], app_name: str) -> SparkSession:
    """``SparkSession.builder.remote(url)`` with ``confs`` set on the server's session.

    A Connect client can set only runtime confs (``spark.sql.*``, ``spark.sparkdl.*``); the
    server owns the rest (``spark.executor.*``, ``spark.task.*``, its master). Those that did
    not take are named on stderr once, instead of pyspark's warning per conf.
    """
    from pyspark.sql import SparkSession

    _check_listening(url)
    sent = {k: v for k, v in confs.items() if k not in _NOT_SENT_OVER_CONNECT}
    builder = SparkSession.builder.remote(url).appName(app_name)
    for key, value in sent.items():
        builder = builder.config(key, value)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Failed to set ")
        spark = builder.getOrCreate()
    try:
        applied = of(spark).confs()  # the first round trip: a server that does not answer fails here
    except BaseException:
        spark.stop()
        raise
    ignored = [f"{k}={v}" for k, v in sent.items() if applied.get(k) != v]
    ignored += [f"{k}={confs[k]}" for k in ("spark.master",) if k in confs]
    if ignored:
        # A note to the command's user, who asked for these confs.
        print(f"sparkdl: the Spark Connect server at {url} keeps its own value of: {', '.join(ignored)} "
              "(a Connect client sets runtime confs only; set these on the server)", file=sys.stderr)
    return spark


def _check_listening(url: str, timeout_s: float = 10.0) -> None:
    """``ConnectionError`` at once when nothing listens at an ``sc://host:port`` URL: the Connect
    client itself retries a refused connection with backoff for minutes before it gives up."""
    parts = urlsplit(url)
    if parts.scheme != "sc":
        return  # "local[N]" and the like: pyspark starts the server itself
    host, port = parts.hostname or "localhost", parts.port or DEFAULT_CONNECT_PORT
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ConnectionError(f"no Spark Connect server answers at {host}:{port} ({exc}); check --remote "
                              "(or SPARK_REMOTE) and that the server is up") from exc
