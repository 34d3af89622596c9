"""``sparkdl run``: an existing torch.distributed script on N gang-scheduled Spark workers.

Every rank runs the script as ``__main__`` with the command's ``sys.argv``, as ``torchrun``
would; the exit status says how the run ended (see :mod:`sparkdl._internal.cli`). With ``--remote`` the
command is a Spark Connect client: the ranks run on the server's executors and their output
comes back over sparkdl's channel to this process, as from a classic session. ``--backend
horovod`` runs a script written for ``horovodrun`` (``hvd.init()``) as one Horovod job; a script
that calls Horovod's ``init()`` is refused under the torch backend, where each rank would train
alone.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from sparkdl._internal.backends import get_backend
from sparkdl._internal.cli.options import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    cli_session,
    remote_url,
    spark_confs,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def run_script(source: str, path: str, argv: list[str], cwd: str) -> None:
    """Runs in each rank: the script as ``__main__``, from the driver's directory when it exists here.

    Like torchrun, the script's own directory comes first on ``sys.path`` (for its sibling
    modules) and relative paths resolve against the directory the command was started in, when
    this host has those directories (local mode, shared file systems).
    """
    from sparkdl._internal.compat.drop_ins import run_script_source

    if os.path.isdir(cwd):
        os.chdir(cwd)
    script_dir = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(script_dir) and script_dir not in sys.path:
        sys.path.insert(0, script_dir)
    run_script_source(source, path, argv)


def horovod_init_line(source: str) -> int | None:
    """The line where a script calls Horovod's ``init()`` (``hvd.init()`` after ``import
    horovod.torch as hvd``, or ``init()`` imported from ``horovod.*``), None when it does not
    (or cannot be parsed: the ranks then report the syntax error)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    modules: set[str] = set()  # names bound to horovod modules
    functions: set[str] = set()  # names bound to horovod's init
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "horovod" or alias.name.startswith("horovod."):
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "horovod":
            for alias in node.names:
                (functions if alias.name in ("init", "*") else modules).add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and (func.id in functions or (func.id == "init" and "*" in functions)):
            return node.lineno
        if isinstance(func, ast.Attribute) and func.attr == "init" and ast.unparse(func.value) in modules:
            return node.lineno
    return None


def _session(args: argparse.Namespace, script: Path, confs: Mapping[str, str]) -> SparkSession:
    # One seam for the session, which tests replace to check exit statuses without a JVM.
    return cli_session(args, confs, f"sparkdl-run-{script.name}", f"local[{args.num_workers}]")


def run_command(args: argparse.Namespace) -> int:
    """``sparkdl run``: the script on ``-n`` gang-scheduled Spark workers."""
    import sparkdl

    path = Path(args.script)
    # What goes to stderr below is the command's answer to its user, not a diagnostic.
    if not path.is_file():
        print(f"sparkdl run: {args.script}: no such file", file=sys.stderr)
        return EXIT_USAGE
    source = path.read_text()
    if not get_backend(args.backend).horovod_job and args.num_workers > 1 and (line := horovod_init_line(source)):
        print(f"sparkdl run: {args.script} calls Horovod's init() (line {line}): with --backend torch each "
              f"of the {args.num_workers} ranks would run a Horovod job of its own, of one process, on all "
              "the data. Add --backend horovod to run the ranks as one Horovod job, as horovodrun does",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        config = sparkdl.RunConfig(
            max_attempts=args.max_attempts, timeout_s=args.timeout, start_timeout_s=args.start_timeout,
        )
        confs = spark_confs(args)
        remote_url(args, confs)  # --master with --remote (or SPARK_REMOTE): a usage error, before any session
    except sparkdl.ConfigError as exc:
        print(f"sparkdl run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        spark = _session(args, path, confs)
    except Exception as exc:  # no JVM, a Connect server that does not answer: said in one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        where = remote_url(args, confs)
        print(f"sparkdl run: cannot start the Spark session{f' (Spark Connect {where})' if where else ''}: {first}",
              file=sys.stderr)
        return EXIT_FAILED
    try:
        sparkdl.run(
            run_script, source, str(path.resolve()), list(args.script_args), os.getcwd(),
            num_workers=args.num_workers, backend=args.backend, use_gpu=args.gpu, config=config, spark=spark,
        )
    except sparkdl.RunTimeoutError as exc:
        print(exc, file=sys.stderr)
        return EXIT_TIMEOUT
    except sparkdl.SparkDLError as exc:
        print(exc, file=sys.stderr)
        return EXIT_FAILED
    finally:
        spark.stop()
    return EXIT_OK
