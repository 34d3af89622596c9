"""The driver side of a run: ``sparkdl.run``.

One run is one or more Spark jobs, each a barrier ``mapInArrow`` stage followed by a shuffle, so
that Spark itself reruns the whole gang when any rank fails (a barrier *result* stage is never
retried). The driver watches every rank over an authenticated channel, bounds every wait, stops
the job when attempts are used up, and turns what it saw into one failure report.
"""

from __future__ import annotations

import inspect
import logging
import os
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from sparkdl._internal.backends import BACKENDS, check_driver, get_backend
from sparkdl._internal.ckpt.fence import RunLease
from sparkdl._internal.ckpt.store import CheckpointStore
from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.common.validate import int_at_least, invalid, nearest_multiples, one_of
from sparkdl._internal.driver import cluster
from sparkdl._internal.driver.launcher import Job, Watch, pickle_payload
from sparkdl._internal.driver.progress import MetricsLog
from sparkdl._internal.driver.report import skipped_checkpoints
from sparkdl._internal.driver.result import RunResult, log_to_mlflow
from sparkdl._internal.driver.spark import SparkLauncher
from sparkdl._internal.fs.storage import redact
from sparkdl._internal.spark import spark_api
from sparkdl._internal.spark.reach import Marker
from sparkdl._internal.spark.session import resolve_session
from sparkdl._internal.wire.messages import MAX_LINE_BYTES
from sparkdl._internal.wire.rankspec import RunSpec
from sparkdl._internal.wire.trial import TrialSpec

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

T = TypeVar("T")
log = logging.getLogger(__name__)


def run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Runs ``fn(*args, **kwargs)`` on ``num_workers`` gang-scheduled Spark tasks; returns rank 0's value.

    The same as ``launch(...).value``; see :func:`launch` for the arguments and everything else.
    With ``train`` as in :func:`launch`'s example, ``state = sparkdl.run(train, 0.1, num_workers=2)``.
    """
    value: T = launch(fn, *args, **kwargs).value
    return value


def launch(
    fn: Callable[..., Any],
    *args: Any,
    num_workers: int,
    backend: str = "torch",
    use_gpu: bool | None = None,
    max_attempts: int | None = None,
    config: RunConfig | None = None,
    spark: SparkSession | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    **kwargs: Any,
) -> RunResult:
    """Runs ``fn(*args, **kwargs)`` on ``num_workers`` gang-scheduled Spark tasks.

    Returns a :class:`RunResult`: rank 0's return value (``.value``), the metrics the ranks sent
    with ``context().log_metrics`` (``.metrics``, ``.plot()``), the run's directory and the
    number of attempts. :func:`run` returns just the value.

    Each rank runs in a process of its own with ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` set and, with the torch backend, the
    default process group already created (``dist.init_process_group()`` in ``fn`` is accepted
    too). On CPUs ``LOCAL_RANK`` numbers the ranks of one host, as torchrun's does. On GPUs
    each rank sees only the GPUs Spark gave its task (``CUDA_VISIBLE_DEVICES``), so it is what
    torchrun makes of a node started with ``--nproc_per_node=1``: ``LOCAL_RANK`` 0,
    ``LOCAL_WORLD_SIZE`` 1, device ``cuda:0``; with ``spark.task.resource.gpu.amount=2`` the one
    rank of a task drives both GPUs, ``cuda:0`` and ``cuda:1``. With
    ``RunConfig(processes_per_task=P)`` each task runs P ranks instead (``--nproc_per_node=P``):
    ``num_workers`` ranks on ``num_workers / P`` tasks, ``LOCAL_RANK`` 0 .. P-1 within a task,
    each rank's device ``cuda:LOCAL_RANK`` among its task's GPUs. When any rank fails, Spark reruns the whole gang, up to ``max_attempts`` times in all;
    ``sparkdl.context().attempt`` tells the rank which attempt it is in. With
    ``RunConfig(min_workers=M)``, a rerun that cannot get ``num_workers`` task slots (an executor
    lost for good) goes on with fewer ranks, at least ``M``; ``RunResult.world_sizes`` says how many.

    Example::

        def train(lr):
            ctx = sparkdl.context()
            model = DDP(Net().to(ctx.device))
            ...
            return model.module.state_dict()

        result = sparkdl.launch(train, 0.1, num_workers=2)
        state, history = result.value, result.metrics

    Args:
        fn: the function each rank runs. It and its arguments are cloudpickled; they must not
            capture a SparkSession, SparkContext or DataFrame.
        num_workers: number of ranks, one Spark task slot each.
        backend: ``"torch"`` (torch.distributed), ``"horovod"``, ``"tensorflow"``
            (``MultiWorkerMirroredStrategy``'s ``TF_CONFIG``) or ``"none"`` (no process group:
            data-only jobs whose ranks never talk to each other).
        use_gpu: give each rank the GPUs Spark assigned to its task. ``None`` means yes when
            ``spark.task.resource.gpu.amount`` is set.
        max_attempts: runs of the gang allowed in all (overrides ``config.max_attempts``).
        config: bounds and behaviour, see :class:`RunConfig`.
        spark: the session to use; by default the active one, else a new local one.
        checkpoint_dir: where ``context().save_checkpoint`` writes: a local or shared path or
            any URL pyarrow/fsspec reach; every executor must reach it. By default a new
            directory ``<spark.sparkdl.runDir>/<run id>/checkpoints`` (without that conf, runs go
            under ``<temp dir>/sparkdl-<uid>/runs``, a directory private to this user, which suits
            local mode). Pass the same directory again to resume a run that the driver restarted.

    Raises:
        ConfigError: bad arguments or Spark confs, before any task starts; also when the default
            run directory exists but is not private (a symlink, another user's, or writable
            by others).
        InsufficientSlotsError: the cluster cannot run ``num_workers`` tasks at once; with
            ``RunConfig.min_workers``, also when the gang after a failed attempt cannot get even
            ``min_workers`` free slots within ``slot_wait_s``.
        RunFailedError: every attempt failed; the message is the per-rank report.
        RunTimeoutError: the gang did not start, or an attempt did not finish, within its bound.
    """
    return launch_with(fn, args, kwargs, LaunchOptions.from_call(locals()))


@dataclass(frozen=True)
class LaunchOptions:
    """``run``'s and ``launch``'s keywords as one object, checked when made (before any task
    starts); their meaning is documented on :func:`launch`. ``config`` holds ``max_attempts``
    when that was given."""

    num_workers: int
    backend: str = "torch"
    use_gpu: bool | None = None
    config: RunConfig = field(default_factory=RunConfig)
    spark: Any = None  # SparkSession | None
    checkpoint_dir: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        int_at_least("num_workers", self.num_workers, 1)
        cfg = self.config
        if not isinstance(cfg, RunConfig):
            raise invalid("config", cfg, "a sparkdl.RunConfig")
        if cfg.min_workers is not None and cfg.min_workers > self.num_workers:
            raise ConfigError(
                f"RunConfig.min_workers={cfg.min_workers} is more than num_workers={self.num_workers}: "
                "min_workers is the fewest ranks a gang may shrink to; set it to at most num_workers, "
                "or to None for a gang that never shrinks"
            )
        one_of("backend", self.backend, BACKENDS)

    @classmethod
    def from_call(cls, arguments: dict[str, Any]) -> LaunchOptions:
        """The options of a ``run``/``launch`` call, from its ``locals()`` taken first thing."""
        cfg = arguments["config"] or RunConfig()
        if arguments["max_attempts"] is not None and isinstance(cfg, RunConfig):  # else refused by name below
            cfg = cfg.replace(max_attempts=arguments["max_attempts"])
        return cls(arguments["num_workers"], arguments["backend"], arguments["use_gpu"], cfg, arguments["spark"],
                   arguments["checkpoint_dir"])


# run's keywords are launch's: one list, which help() and the API reference show for both.
run.__signature__ = inspect.signature(launch).replace(return_annotation="T")  # type: ignore[attr-defined]


def launch_with(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: LaunchOptions, *,
                trial: TrialSpec | None = None, judge: Callable[[int, float], bool | None] | None = None,
                stop: threading.Event | None = None) -> RunResult:
    """:func:`launch` with its options as one object; a search's trial (``sparkdl.tune``) also
    passes the ``trial`` its ranks see and ``judge``, which answers rank 0's reports (step,
    value -> prune, or None: no decision is sent), and ``stop``, which, once set, stops the run
    as Ctrl-C does (its gang ended, KeyboardInterrupt raised)."""
    if not callable(fn):
        raise invalid("fn", fn, "callable")
    cfg, num_workers, backend, checkpoint_dir = options.config, options.num_workers, options.backend, options.checkpoint_dir
    tasks = _tasks(num_workers, backend, cfg.processes_per_task)
    fn_bytes = pickle_payload(fn, args, kwargs)
    check_driver(backend, cfg)

    session = resolve_session(options.spark, tasks)
    api = spark_api.of(session)
    conf = api.confs()
    gpu = cluster.resolve_gpu(conf, options.use_gpu)
    cluster.check_cluster(api, num_workers, cfg, tasks=tasks)
    cluster.check_executor_python(api)
    attempts_allowed = cfg.max_attempts if cfg.max_attempts is not None else cluster.stage_attempts(conf)

    run_id = secrets.token_hex(6)
    run_dir = cluster.run_dir(conf, run_id, default_fs=api.default_fs(), user=api.spark_user())
    store = CheckpointStore(checkpoint_dir or f"{run_dir}/checkpoints", keep=cfg.keep_checkpoints)
    metrics_path = cluster.local_metrics_path(run_dir, run_id)
    metrics = MetricsLog(metrics_path)
    # The ranks' output beside the metrics: on the driver's own disk, where the user looks (the run
    # dir may be remote).
    watch = Watch.open(cfg, num_workers, attempts_allowed, store, metrics, metrics_path.parent / "logs")
    monitor, output = watch.monitor, watch.output
    mlflow_on = cluster.mlflow_enabled(conf, cfg)
    spec = RunSpec(run_id=run_id, world_size=num_workers, backend=backend, use_gpu=gpu,
                   checkpoint_url=store.url, config=cfg, trial=trial)
    monitor.judge = judge
    value: Any = None
    marker: Marker | None = None
    lease: RunLease | None = None
    try:
        # Every task reads this back before its rank starts: a checkpoint directory that only the
        # driver's host has stops the run here, not after the checkpoints are lost (sparkdl._internal.spark.reach).
        # Only a directory the user named stops the run before training; the default run
        # directory stops its first save (a run that never saves needs no shared storage).
        explicit = checkpoint_dir is not None or bool(conf.get(cluster.RUN_DIR_CONF, None))
        marker = Marker.plant(store.url, strict=explicit)
        # The directory is this run's until it ends: a second run given it is refused, naming both.
        lease = RunLease(store.url, run_id, cfg.checkpoint_lease_s).acquire()
        if lease.took_over:
            gone = store.remove_leftovers_of(lease.took_over)
            log.warning("sparkdl: run %s takes checkpoint directory %s over from run %s, whose driver "
                        "is gone%s", run_id, redact(store.url), lease.took_over,
                        f"; removed what it left half-written: {', '.join(gone)}" if gone else "")
        value = SparkLauncher(session, api, checkpoints=marker, stop=stop).run(Job(spec, fn_bytes, attempts_allowed), monitor)
    finally:
        if lease is not None:
            lease.release()
        if marker is not None:
            marker.remove()
        metrics.close()
        watch.close(cfg)
        if monitor.cut_chars:
            log.warning("sparkdl: %d characters of the ranks' output were not kept: lines longer than %d MiB "
                        "are cut there", monitor.cut_chars, MAX_LINE_BYTES >> 20)
        result = RunResult(
            value=value,
            run_id=run_id,
            run_dir=run_dir,
            checkpoint_dir=store.url,
            attempts=monitor.attempts_seen(),
            world_sizes=monitor.world_sizes(),
            records=metrics.records,
            metrics_path=str(metrics.path) if metrics.path else None,
            log_dir=str(output.log_dir) if output.log_dir else None,
            skipped_checkpoints=skipped_checkpoints(list(monitor.records.values())),
        )
        if mlflow_on:
            # Metrics go to MLflow whether the run succeeded or not; the model only on success.
            try:
                log_to_mlflow(result, num_workers=num_workers, backend=backend, succeeded=monitor.succeeded)
            except Exception as exc:  # a tracking server's trouble must not hide the run's outcome
                log.warning("sparkdl: logging to MLflow failed: %s: %s", type(exc).__name__, exc)
    return result


def _tasks(num_workers: int, backend: str, per_task: int) -> int:
    """The Spark tasks of a gang of ``num_workers`` ranks, ``per_task`` rank processes in each."""
    if per_task == 1:
        return num_workers
    if not get_backend(backend).several_ranks_per_task:
        raise ConfigError(
            f"RunConfig.processes_per_task={per_task} runs several torch ranks in each Spark task; "
            f"backend={backend!r} runs one rank per task: set processes_per_task=1 (and, on GPUs, "
            "spark.task.resource.gpu.amount=1), or use backend='torch'"
        )
    if num_workers % per_task:
        raise ConfigError(
            f"num_workers={num_workers} is not a multiple of RunConfig.processes_per_task={per_task}: "
            f"each Spark task runs {per_task} ranks; use {nearest_multiples('num_workers', num_workers, per_task)}"
        )
    return num_workers // per_task
