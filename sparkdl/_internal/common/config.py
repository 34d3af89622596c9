"""Frozen, validated settings of a run. Every time bound of the launcher is a field here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.common.validate import (
    int_at_least,
    invalid,
    is_number,
    one_of,
    positive_seconds,
)

# Durations in seconds: each must be positive; timeout_s may also be None (no limit).
_SECONDS = (
    "start_timeout_s",
    "checkpoint_lease_s",
    "slot_wait_s",
    "collective_timeout_s",
    "connect_timeout_s",
    "handshake_timeout_s",
    "kill_grace_s",
    "outcome_wait_s",
    "progress_interval_s",
    "log_flush_timeout_s",
)
HOROVOD_CONTROLLERS = ("gloo", "mpi")


@dataclass(frozen=True)
class RunConfig:
    """Bounds and behaviour of :func:`sparkdl.run`. All durations are in seconds.

    Example::

        sparkdl.run(train, num_workers=4, config=sparkdl.RunConfig(timeout_s=3600))

    Attributes:
        max_attempts: how many times the whole gang may run before the run fails. ``None`` means
            Spark's own ``spark.stage.maxConsecutiveAttempts`` (4 unless set).
        timeout_s: wall-clock limit of one attempt, from the moment all ranks have started.
            ``None`` (the default) means no limit on training time; hangs inside collectives are
            still bounded by ``collective_timeout_s``.
        start_timeout_s: how long all ranks of an attempt may take to be scheduled and to check in
            with the driver. Busy task slots make a barrier stage wait; this turns the wait into an
            error.
        slot_wait_s: how long to wait for executors to register before deciding that the cluster
            has too few task slots for ``num_workers`` (also when Spark refuses the gang's barrier
            stage because they have not registered yet: a run right after the session started,
            over Spark Connect).
        collective_timeout_s: timeout of the process group that sparkdl creates (and of a user's
            own ``init_process_group`` call without a timeout): a rank that waits this long in a
            collective fails, and the gang reruns.
        connect_timeout_s: bound on a task's connection to the driver and on its first reply.
        handshake_timeout_s: how long, in all, a peer that connects to the driver's channel has
            to send its first authenticated frame, however slowly it sends, before it is dropped.
        kill_grace_s: after a run is stopped, how long to wait for Spark to end its tasks.
        log_tail_lines: lines of each rank's output kept for the failure report.
        init_process_group: create the default torch process group before calling ``fn``.
        echo_logs: print every rank's output on the driver, tagged with its rank. Every line also
            goes to a file per rank in the run's directory (``RunResult.log_dir``:
            ``rank-<r>.log``, and ``rank-<r>.attempt-<a>.log`` for reruns), echoed or not.
        console: how the driver's console shows the ranks' lines (with ``echo_logs``): ``"all"``,
            every line of every rank; ``"dedupe"``, rank 0's lines and every rank's stderr
            (warnings, errors) as they come, and a stdout line that other ranks print alike once,
            with their ranks (``[ranks 1-1023] ...``), within a second (a rank's line may then
            show before the rank's own line printed just before it); ``"auto"``, ``"dedupe"`` from
            8 ranks on, else ``"all"``. The files always get every line of every rank, in order.
        log_flush_timeout_s: once the ranks ended, how long the run waits for the driver's
            console (a slow pipe, a log collector) to take the ranks' lines still queued for it.
            Lines it did not take in time are counted in a warning that names the run's log
            directory, which has every line.
        keep_checkpoints: complete checkpoints kept in the checkpoint directory.
        checkpoint_sync: fsync every checkpoint file (and, on local and NFS paths, its directory
            entry) before the checkpoint counts, for stores where a host's crash may lose what a
            process wrote. Off by default: without it a checkpoint torn by a host's crash is
            found by its commit record and skipped, and a restore falls back to the one before
            (the cost: ``docs/benchmarks.md``, checkpoints).
        checkpoint_finite_only: refuse to commit a checkpoint that holds a NaN or infinite value
            (a diverged run), with :class:`~sparkdl.SparkDLError` naming where, so that a
            diverged state never replaces the good checkpoints kept; the rank fails, and a rerun
            resumes from the newest good one.
        checkpoint_lease_s: the driver holds the checkpoint directory for its run, renewing a
            lease file in it every third of this. A second run given the same directory while
            the first runs is refused before it starts, naming both; a run whose driver died on
            another host is taken over once its lease went this long without renewal.
        progress: show a live progress line on the driver (epoch, step, throughput, loss) from
            rank 0's metrics.
        progress_interval_s: least time between two progress lines.
        straggler_factor: a rank whose step (reported by ``TrainState`` every second) times this
            factor is below the median step of the attempt's ranks is named a straggler, in the
            progress line and in the failure report (once the median is 10 steps or more).
        mlflow: log the run's metrics and final model to MLflow (the active MLflow run, or a new
            one). ``None`` means the Spark conf ``spark.sparkdl.mlflow.enabled`` (default false).
        prewarm: start each rank by forking a per-executor process that has torch imported
            already (a "zygote", started by the executor's first run and ended with the executor;
            ranks on the driver have the driver's own, ended with the driver process), which saves
            the 1.5 to 2.5 s of importing torch on every later launch. ``False`` starts every rank
            as a fresh interpreter.
        stop_on_repeated_error: stop before ``max_attempts`` when a rerun cannot help (see
            :func:`sparkdl._internal.driver.policy.unrecoverable`).
        outcome_wait_s: after a rank fails, how long to wait for the other ranks of its attempt
            to report their own outcome before judging whether a rerun can help.
        min_workers: let the gang shrink when executors are gone for good. ``None`` (the
            default): every attempt runs ``num_workers`` ranks, and a gang that cannot get its
            slots after a failure stops the run after ``start_timeout_s``. With ``min_workers=M``
            (1 <= M <= ``num_workers``): when an attempt failed and the next gang cannot get
            ``num_workers`` free task slots within ``slot_wait_s`` (an executor or host was lost
            and not replaced), the driver stops that Spark job and runs the next attempt as a new
            job on as many ranks as there are free slots, but not fewer than M; with fewer than
            M free slots the run fails with :class:`~sparkdl.InsufficientSlotsError`. The new
            attempt keeps the run id, checkpoint directory and attempt count (it still counts
            against ``max_attempts``), and its ranks see the new ``WORLD_SIZE`` and
            ``sparkdl.context().world_size``: resume from a checkpoint that does not depend on
            the number of ranks. ``RunResult.world_sizes`` lists each attempt's world size.
            Raise ``slot_wait_s`` where replacing an executor takes longer (YARN, Kubernetes),
            so that the run does not shrink while a replacement is on its way. A shrunk gang
            grows back: once the cluster has ``num_workers`` free task slots again (a restarted
            worker, dynamic allocation), the driver stops the attempt right after its next
            checkpoint is committed and runs the next one on ``num_workers`` ranks from there;
            that attempt does not count against ``max_attempts``, and steps the stopped attempt
            made after the checkpoint are made again.

            Example::

                cfg = sparkdl.RunConfig(min_workers=2, slot_wait_s=60)
                result = sparkdl.launch(train, num_workers=4, max_attempts=4, config=cfg)
                result.world_sizes  # e.g. [4, 3]: an executor was lost during attempt 0
                # [4, 3, 4]: and came back before the run ended
        horovod_controller: with ``backend="horovod"``, what coordinates Horovod's ranks:
            ``"gloo"`` (the default; Horovod's Gloo over TCP) or ``"mpi"`` (the ranks form one
            Open MPI job, ``hvd.mpi_enabled()`` is True, and MPI carries Horovod's CPU
            collectives: for clusters whose MPI uses InfiniBand/RDMA). With ``"mpi"`` each task
            starts its rank's part of the job (no ssh); Open MPI 4 (``mpirun``, ``orted``) is
            needed on the driver and every executor, and Horovod built with MPI.
        processes_per_task: rank processes in each Spark task (torchrun's ``--nproc_per_node``),
            as Spark's ``TorchDistributor`` runs ``spark.task.resource.gpu.amount`` processes per
            task. ``num_workers`` still counts ranks and must be a multiple of it: the gang is
            ``num_workers / processes_per_task`` tasks. The ranks of one task are consecutive
            (task ``t`` runs ranks ``t*P`` to ``t*P+P-1``), each in a process of its own with its
            own lifeline, output and clean-up, and ``LOCAL_RANK`` numbers them within the task.
            With GPUs each rank sees all of its task's GPUs and its device is
            ``cuda:LOCAL_RANK`` (the task needs at least ``processes_per_task`` GPUs). A rank
            that fails fails its whole task, and Spark reruns the gang. Torch backend only.
    """

    max_attempts: int | None = None
    timeout_s: float | None = None
    start_timeout_s: float = 120.0
    slot_wait_s: float = 10.0
    collective_timeout_s: float = 1800.0
    connect_timeout_s: float = 30.0
    handshake_timeout_s: float = 10.0
    kill_grace_s: float = 30.0
    log_tail_lines: int = 20
    init_process_group: bool = True
    echo_logs: bool = True
    console: str = "auto"
    log_flush_timeout_s: float = 60.0
    keep_checkpoints: int = 3
    checkpoint_sync: bool = False
    checkpoint_finite_only: bool = False
    checkpoint_lease_s: float = 30.0
    stop_on_repeated_error: bool = True
    progress: bool = True
    progress_interval_s: float = 5.0
    straggler_factor: float = 1.5
    mlflow: bool | None = None
    prewarm: bool = True
    outcome_wait_s: float = 10.0
    min_workers: int | None = None
    horovod_controller: str = "gloo"
    processes_per_task: int = 1

    def __post_init__(self) -> None:
        int_at_least("max_attempts", self.max_attempts, 1, note=" (1 means no rerun)", allow_none=True)
        positive_seconds("RunConfig.timeout_s", self.timeout_s, allow_none=True)
        for name in _SECONDS:
            positive_seconds(f"RunConfig.{name}", getattr(self, name))
        int_at_least("RunConfig.log_tail_lines", self.log_tail_lines, 0)
        if not is_number(self.straggler_factor) or not self.straggler_factor > 1:
            raise invalid("RunConfig.straggler_factor", self.straggler_factor,
                          "a number > 1 (1.5: a rank at two thirds of the median step is a straggler)")
        one_of("RunConfig.console", self.console, {
            "all": "every line of every rank",
            "dedupe": "rank 0's lines, and the lines other ranks print alike once",
            "auto": "'dedupe' from 8 ranks on",
        })
        int_at_least("RunConfig.keep_checkpoints", self.keep_checkpoints, 1)
        int_at_least("RunConfig.min_workers", self.min_workers, 1, allow_none=True,
                     note=" (the fewest ranks a shrunk gang may run on)")
        int_at_least("RunConfig.processes_per_task", self.processes_per_task, 1,
                     note=" (rank processes in each Spark task)")
        if self.horovod_controller not in HOROVOD_CONTROLLERS:
            raise ConfigError(
                f"RunConfig.horovod_controller={self.horovod_controller!r} is unknown; choose "
                f"{' or '.join(map(repr, HOROVOD_CONTROLLERS))}"
            )

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with ``changes`` applied and validated, e.g. ``cfg.replace(timeout_s=600)``."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, object]:
        """Plain values only, for shipping to the tasks."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
