"""What the jobs in jobs/ share: their command line, their defaults file and their SparkSession.

Only the driver uses this module. Functions that run on the executors live in the job scripts
themselves (``__main__``), which cloudpickle ships by value; a function defined here would be
pickled by reference, and ``_common`` is not importable on an executor.

Defaults come from ``conf/sparkdl-defaults.conf`` (or ``--defaults FILE``, or
``$SPARKDL_CONF_DIR/sparkdl-defaults.conf``): ``key value`` lines like ``spark-defaults.conf``.
A key ``sparkdl.jobs.<option>`` is the default of ``--<option>`` in every job that has that
option, ``sparkdl.<job>.<option>`` in that job only (it wins over ``sparkdl.jobs``). Options given
on the command line win over both.

Where neither names the job's data, model or output, the job uses a directory of its own under
``<temp dir>/sparkdl-<uid>/jobs`` (:data:`PRIVATE_DEFAULTS`), which only this user may write: a
fixed name under the shared temp dir would belong to whoever creates it first.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkdl import ConfigError
from sparkdl._internal.fs.private import user_dir
from sparkdl._internal.spark.session import conf_pair, create_session
from sparkdl._internal.spark.session import read_properties as _read_properties

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

REPO_CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
DEFAULTS_NAME = "sparkdl-defaults.conf"

# option -> (its directory under <temp dir>/sparkdl-<uid>/jobs, the defaults-file key that moves it)
PRIVATE_DEFAULTS = {
    "data": ("digits", "sparkdl.jobs.data"),
    "model": ("model", "sparkdl.jobs.model"),
    "output": ("predictions", "sparkdl.inference.output"),
    "images": ("digit-images", "sparkdl.images.images"),
    "pipeline": ("image-pipeline", "sparkdl.images.pipeline"),
    "study": ("tune-digits", "sparkdl.tune.study"),
}


def conf_dir() -> Path:
    """The directory of the defaults files: ``$SPARKDL_CONF_DIR``, else the repository's ``conf/``."""
    return Path(os.environ.get("SPARKDL_CONF_DIR") or REPO_CONF_DIR)


def read_properties(path: str | os.PathLike[str]) -> dict[str, str]:
    """:func:`sparkdl._internal.spark.session.read_properties`, ending the job with its ``file:line`` message on a bad line."""
    try:
        return _read_properties(path)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None


def job_parser(job: str, description: str, epilog: str) -> argparse.ArgumentParser:
    """A parser with the options every job has; the job adds its own."""
    p = argparse.ArgumentParser(
        prog=f"jobs/{job}.py",
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    spark = p.add_argument_group("Spark (as spark-submit takes them; under spark-submit, give them to spark-submit)")
    spark.add_argument(
        "--master",
        default=None,
        help="Spark master URL for a session this job creates when run with plain python "
        "(default: spark.master from --properties-file, else local[NUM_WORKERS])",
    )
    spark.add_argument(
        "--conf",
        metavar="KEY=VALUE",
        type=conf_pair,
        action="append",
        default=[],
        help="a Spark conf; repeat for more. Under spark-submit only session (SQL) confs take effect",
    )
    spark.add_argument(
        "--properties-file",
        metavar="FILE",
        default=None,
        help="Spark confs for a session this job creates (default: conf/spark-defaults.conf)",
    )
    spark.add_argument(
        "--defaults",
        metavar="FILE",
        default=None,
        help=f"this job's defaults (default: conf/{DEFAULTS_NAME}; $SPARKDL_CONF_DIR moves conf/)",
    )
    spark.add_argument("--num-workers", type=int, default=2, help="ranks / task slots to use (default: %(default)s)")
    return p


def parse_job_args(parser: argparse.ArgumentParser, job: str, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parses ``argv`` over the defaults file; unknown keys in the file are errors that name it."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--defaults", default=None)
    known, _ = pre.parse_known_args(argv)
    path = Path(known.defaults) if known.defaults else conf_dir() / DEFAULTS_NAME
    if path.is_file():
        apply_defaults(parser, job, read_properties(path), str(path))
    elif known.defaults:
        parser.error(f"--defaults {known.defaults}: no such file")
    args = parser.parse_args(argv)
    if args.num_workers < 1:
        parser.error(f"--num-workers must be >= 1; got {args.num_workers}")
    return args


def apply_defaults(parser: argparse.ArgumentParser, job: str, props: dict[str, str], where: str) -> None:
    """Sets the parser's defaults from ``sparkdl.jobs.*`` and then ``sparkdl.<job>.*`` keys."""
    actions = {a.option_strings[0][2:]: a for a in parser._actions if a.option_strings and a.option_strings[0].startswith("--")}
    updates: dict[str, Any] = {}
    for scope in ("jobs", job):
        prefix = f"sparkdl.{scope}."
        for key, value in props.items():
            if not key.startswith(prefix):
                continue
            option = key[len(prefix) :]
            action = actions.get(option)
            if action is None:
                if scope == job:
                    parser.error(f"{where}: {key}: jobs/{job}.py has no option --{option}")
                continue  # a shared key for an option that other jobs have
            updates[action.dest] = _convert(action, value, f"{where}: {key}", parser)
    for key in props:
        scope = key.split(".")[1] if key.count(".") >= 2 else ""
        if not key.startswith("sparkdl.") or scope not in ("jobs", "etl", "train", "inference", "images", "tune"):
            parser.error(f"{where}: unknown key {key!r}; keys are sparkdl.jobs.<option> or sparkdl.<job>.<option>")
    parser.set_defaults(**updates)


def _convert(action: argparse.Action, value: str, where: str, parser: argparse.ArgumentParser) -> Any:
    if action.nargs == 0:  # a flag: store_true or --x/--no-x
        lowered = value.lower()
        if lowered not in ("true", "false"):
            parser.error(f"{where}: expected true or false; got {value!r}")
        return lowered == "true"
    if action.type is None or value == "":
        return value or None
    try:
        return action.type(value)  # type: ignore[operator]
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(f"{where}: {value!r} is not valid: {exc}")


def private_help(option: str) -> str:
    """The words of ``--<option>``'s help that say where it points by default."""
    name, key = PRIVATE_DEFAULTS[option]
    return f"(default: {key}, else <temp dir>/sparkdl-<uid>/jobs/{name}, a private directory)"


def fill_private_defaults(args: argparse.Namespace, *options: str) -> None:
    """Sets each of ``options`` that neither the command line nor the defaults file gave to
    ``<temp dir>/sparkdl-<uid>/jobs/<name>``; ``<temp dir>/sparkdl-<uid>/jobs`` is created 0700 and
    checked, and the job ends with a message naming the directory and the option when it is not
    this user's private directory. A value the user gave is kept as it is, unchecked."""
    for option in options:
        if getattr(args, option):
            continue
        name, key = PRIVATE_DEFAULTS[option]
        try:
            jobs = user_dir("jobs", setting=f"--{option} (or {key} in the defaults file)")
        except ConfigError as exc:
            raise SystemExit(str(exc)) from None
        setattr(args, option, str(jobs / name))


def under_spark_submit() -> bool:
    """True when spark-submit started this Python process (its JVM is already running)."""
    # PythonRunner, which spark-submit uses for .py applications, hands the gateway over this way.
    return "PYSPARK_GATEWAY_PORT" in os.environ


def absolute(path: str) -> str:
    """A local path made absolute (executors run in other directories); URLs are kept."""
    if "://" in path:
        return path
    return str(Path(path).expanduser().resolve())


def session(args: argparse.Namespace, app_name: str, slots: int | None = None) -> SparkSession:
    """The job's SparkSession: the one spark-submit set up, or a new one from the job's options
    (on ``local[slots]``, by default ``local[NUM_WORKERS]``, when no master is given)."""
    if under_spark_submit():
        from pyspark.sql import SparkSession

        builder = SparkSession.builder.appName(app_name)
        if args.master:
            print(f"{app_name}: --master {args.master} ignored: spark-submit chose the master", file=sys.stderr)
        # spark-submit set Spark's confs up from its own options; ours add only session (SQL) confs.
        for key, value in args.conf:
            builder = builder.config(key, value)
        return builder.getOrCreate()

    props_path = args.properties_file or str(conf_dir() / "spark-defaults.conf")
    confs = read_properties(props_path) if Path(props_path).is_file() else {}
    if args.properties_file and not Path(props_path).is_file():
        raise SystemExit(f"--properties-file {props_path}: no such file")
    confs.update(dict(args.conf))
    log4j = conf_dir() / "log4j2.properties"
    if log4j.is_file():
        # pyspark hands these confs to the spark-submit that starts the driver JVM, so the JVM's
        # own start-up already logs through the quiet configuration.
        opt = f"-Dlog4j2.configurationFile={log4j.as_uri()}"
        for key in ("spark.driver.extraJavaOptions", "spark.executor.extraJavaOptions"):
            confs[key] = f"{confs[key]} {opt}" if key in confs else opt
    # A session of our own: on loopback and with this interpreter as the workers' Python when local.
    return create_session(args.master, confs, app_name, f"local[{slots or args.num_workers}]")
