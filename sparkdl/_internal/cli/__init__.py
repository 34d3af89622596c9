"""The ``sparkdl`` command line.

``sparkdl doctor``
    A pre-flight check of the driver and the cluster: Java, Spark, torch, pyarrow, numpy,
    Horovod and Petastorm (optional), GPUs; then a small Spark job that reports the same from
    each executor's Python, and the free task slots. It prints a table, then every problem with
    its fix, and exits 1 when there is an error.

``sparkdl run -n 2 train.py --lr 0.1``
    Runs an existing torch.distributed script on N gang-scheduled Spark workers, the way
    ``torchrun --nproc-per-node 2 train.py --lr 0.1`` runs it on one machine: every rank runs the
    script as ``__main__`` with ``sys.argv``, ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and the
    rest set; a failed rank reruns the whole gang.

``sparkdl conf gpu``
    Prints a configuration template that ships with sparkdl (``sparkdl conf`` lists them;
    ``--path`` gives the installed file, e.g. the GPU discovery script).

``sparkdl pack -o env.tar.gz``
    Packs this venv (without pyspark and py4j) into an archive for ``spark-submit --archives
    env.tar.gz#env`` and executors that have nothing installed; prints the settings that use it.

``doctor`` and ``run`` take ``--master URL`` for a Spark session of their own, or ``--remote sc://host:port`` (else
``spark.remote`` from ``--conf``, else ``$SPARK_REMOTE``) to be a Spark Connect client; giving
both is a usage error.

Exit status: 0 success, 1 a failed check or run, 2 a usage error, 124 a run that timed out.

The parser is here; ``doctor`` lives in :mod:`sparkdl._internal.cli.preflight` (driver checks),
:mod:`sparkdl._internal.cli.executors` and :mod:`sparkdl._internal.cli.executor_probe` (the executors), ``run`` in
:mod:`sparkdl._internal.cli.runner`, ``pack`` in :mod:`sparkdl._internal.cli.pack`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from sparkdl._internal.backends import BACKENDS
from sparkdl._internal.cli.checks import ERROR, INFO, OK, WARN, Check, Report
from sparkdl._internal.cli.options import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    add_spark_options,
)
from sparkdl._internal.cli.pack import add_parser as add_pack_parser
from sparkdl._internal.cli.preflight import (
    MIN_JAVA,
    MIN_PYARROW_FOR_SPARK4,
    doctor,
    parse_java_version,
)
from sparkdl._internal.cli.runner import run_command, run_script
from sparkdl._internal.cli.templates import add_parser as add_conf_parser

__all__ = [
    "ERROR",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_TIMEOUT",
    "EXIT_USAGE",
    "INFO",
    "MIN_JAVA",
    "MIN_PYARROW_FOR_SPARK4",
    "OK",
    "WARN",
    "Check",
    "Report",
    "build_parser",
    "doctor",
    "main",
    "parse_java_version",
    "run_command",
    "run_script",
]


# argparse names the type function in its "invalid <name> value" message: these names are
# part of the command's error text.
def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be > 0; got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``sparkdl`` parser: ``doctor`` and ``run``, each with ``func`` set to its command."""
    from sparkdl._version import __version__

    parser = argparse.ArgumentParser(prog="sparkdl", description="Distributed PyTorch inside Apache Spark.")
    parser.add_argument("--version", action="version", version=f"sparkdl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{doctor,run,conf,pack}")

    doc = sub.add_parser("doctor", help="check the driver, the executors and the task slots",
                         description="Checks Java, Spark, torch, pyarrow, Horovod, Petastorm and GPUs on the driver, "
                         "the same on the executors (one small Spark job), and the free task slots.")
    add_spark_options(doc)
    doc.add_argument("-n", "--num-workers", type=_positive_int, default=2,
                     help="ranks you plan to run: the free task slots needed (default: %(default)s)")
    doc.add_argument("--timeout", type=_positive_float, default=120.0,
                     help="bound on the executor check, in seconds (default: %(default)s)")
    doc.add_argument("--no-spark", action="store_true", help="check the driver only; start no Spark session")
    doc.set_defaults(func=doctor)

    run = sub.add_parser("run", help="run a torch.distributed script on N Spark workers, like torchrun",
                         description="Runs SCRIPT with its arguments as __main__ on N gang-scheduled Spark tasks, "
                         "with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, as torchrun would. "
                         "Example: sparkdl run -n 2 train.py --lr 0.1")
    add_spark_options(run)
    run.add_argument("-n", "--num-workers", type=_positive_int, default=1, help="ranks (default: %(default)s)")
    run.add_argument("--max-attempts", type=_positive_int, default=None,
                     help="runs of the whole gang allowed (default: Spark's spark.stage.maxConsecutiveAttempts)")
    run.add_argument("--timeout", type=_positive_float, default=None,
                     help="seconds one attempt may run once all ranks started (default: no limit)")
    run.add_argument("--start-timeout", type=_positive_float, default=120.0,
                     help="seconds for all ranks to be scheduled and start (default: %(default)s)")
    run.add_argument("--backend", choices=BACKENDS, default="torch",
                     help="torch: torch.distributed, as torchrun; horovod: one Horovod job of N ranks, "
                     "as horovodrun, for scripts that call hvd.init(); tensorflow: each rank a worker of "
                     "MultiWorkerMirroredStrategy, TF_CONFIG set; none: no process group, for ranks that "
                     "never talk to each other (default: %(default)s)")
    gpu = run.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", dest="gpu", action="store_const", const=True, default=None,
                     help="one GPU per rank (needs spark.task.resource.gpu.amount)")
    gpu.add_argument("--no-gpu", dest="gpu", action="store_const", const=False, help="CPU only")
    run.add_argument("script", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    run.set_defaults(func=run_command)
    add_conf_parser(sub)
    add_pack_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sparkdl`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code
