"""Ranks as processes on the driver alone, without Spark tasks: for development and notebooks.

This backs ``HorovodRunner(np=-N)`` and ``TorchDistributor(local_mode=True)``. Each rank is the
same rank process as on a cluster, started the same way (:class:`~sparkdl._internal.task.rankproc.RankProcess`),
with the same environment, lifeline, output relay, metrics and clean-up, and watched by the same
monitor and failure policy, so code that runs here runs on the cluster too. There is no gang
rerun on the driver: a failure ends the run with the same report as ``sparkdl.run``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sparkdl._internal.backends import check_driver, get_backend
from sparkdl._internal.backends.base import LocalJob, TaskPart
from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.common.validate import int_at_least
from sparkdl._internal.driver import policy
from sparkdl._internal.driver.failure import failure_on_driver
from sparkdl._internal.driver.launcher import Job, Launcher, Watch, pickle_payload
from sparkdl._internal.driver.monitor import Monitor
from sparkdl._internal.driver.progress import MetricsLog
from sparkdl._internal.fs.private import user_dir
from sparkdl._internal.task.rankproc import RankProcess
from sparkdl._internal.wire.messages import (
    Gang,
    Hello,
    LogLine,
    Metric,
    RankState,
    Stacks,
    Started,
)
from sparkdl._internal.wire.rankspec import GangSpec, RankSpec, RunSpec
from sparkdl._internal.wire.workdir_files import result_path

_HOST = "127.0.0.1"
# After the first failure, the other ranks get this long to record their own outcome.
_SETTLE_S = 0.5


class _MonitorSink:
    """A rank's output straight into the driver's monitor (no channel on the driver)."""

    def __init__(self, monitor: Monitor, rank: int) -> None:
        self._monitor = monitor
        self._rank = rank

    def line(self, stream: str, text: str) -> bool:
        self._monitor.log(0, self._rank, LogLine(stream, text))
        return True

    def lines(self, stream: str, texts: list[str]) -> bool:
        for text in texts:
            self._monitor.log(0, self._rank, LogLine(stream, text))
        return True

    def metric(self, record: dict[str, Any]) -> bool:
        self._monitor.metric(0, self._rank, Metric(record))
        return True


class LocalLauncher(Launcher):
    """``world_size`` rank processes on this machine; ``gpu_ids``: one per rank, or None for CPU."""

    def __init__(self, gpu_ids: list[str] | None) -> None:
        self.gpu_ids = gpu_ids

    def launch(self, job: Job, monitor: Monitor) -> bytes:
        run = job.run
        cfg = run.config
        root = Path(tempfile.mkdtemp(prefix=f"sparkdl-local-{run.run_id}-"))
        listener = socket.create_server((_HOST, 0), backlog=1024)
        hosts = [_HOST] * run.world_size
        procs: list[RankProcess] = []
        gangs: list[GangSpec] = []
        backend = get_backend(run.backend)
        parts: list[TaskPart] = []  # what the backend holds for each rank (a port, its part of an MPI job)
        backend_job: LocalJob | None = None
        secret = secrets.token_bytes(32)
        finished = False
        try:
            for rank in range(run.world_size):
                workdir = root / f"rank-{rank}"
                workdir.mkdir()
                gpus = [self.gpu_ids[rank]] if self.gpu_ids is not None else []
                spec = RankSpec.of(run, rank=rank, host=_HOST, gpu_ids=gpus, task_pid=os.getpid())
                # The gang is known before the rank starts: it joins at once, as attempt 0.
                monitor.hello(("local", rank), Hello(_HOST, os.getpid(), rank))
                monitor.join(("local", rank), rank, Gang(tuple(range(run.world_size))))
                proc = RankProcess(
                    spec, workdir, job.fn_bytes, _MonitorSink(monitor, rank),
                    store=listener if rank == 0 else None, prewarm=cfg.prewarm, on_driver=True,
                    start_timeout_s=cfg.connect_timeout_s, tail_lines=cfg.log_tail_lines,
                )
                procs.append(proc)
                gangs.append(GangSpec.form(spec, attempt=0, hosts=hosts, master_port=listener.getsockname()[1]))
            for rank in range(run.world_size):
                parts.append(backend.task_part(cfg, rank, _HOST, root / f"rank-{rank}", secret))
            # Formed before the ranks are told the gang, as a gang's tasks do (one job of them all).
            job_envs, backend_job = backend.join_local(parts, _HOST, root, secret, cfg.connect_timeout_s,
                                               lambda line: monitor.log(0, 0, LogLine("e", line)))
            for proc, gang, job_env, part in zip(procs, gangs, job_envs, parts, strict=True):
                proc.tell_gang(gang, job_env)
                monitor.rank_event(0, proc.spec.rank, Started(proc.pid))
                monitor.stack_source(0, proc.spec.rank, functools.partial(_ask_stacks, proc, monitor))
                part.watch(functools.partial(_end, proc))
            listener.close()
            value = _wait(procs, monitor, cfg, root, parts)
            finished = True
            return value
        finally:
            for part in parts:
                part.ended(0 if finished else -9)
            if backend_job is not None:
                backend_job.close(cfg.collective_timeout_s if finished else None)
            for part in parts:
                part.close(None)
            for proc in procs:
                proc.close()
            listener.close()
            shutil.rmtree(root, ignore_errors=True)


def _end(proc: RankProcess, why: str) -> None:
    proc.kill()  # the backend's job (Open MPI's) ended under this rank: its part says why


def _watch(proc: RankProcess, monitor: Monitor, part: TaskPart) -> None:
    code = proc.wait()
    if code != 0 and monitor.stopping is not None:
        return  # stopped by the driver after another rank failed: it stays "stopped while running"
    # Reported at exit, not when the loop notices: the root cause is the first rank to exit.
    monitor.rank_event(0, proc.spec.rank, proc.exited(code, part.lost))
    if code != 0:
        part.ended(code)  # once its failure is recorded: the backend's job (Open MPI's) then ends


def _ask_stacks(proc: RankProcess, monitor: Monitor) -> bool:
    """The driver-local side of a stacks request: the rank is signalled from a thread of its own."""

    def dump() -> None:
        monitor.stacks(0, proc.spec.rank, Stacks(proc.pid, proc.dump_stacks()))

    threading.Thread(target=dump, name="sparkdl-stacks", daemon=True).start()
    return True


def _wait(procs: list[RankProcess], monitor: Monitor, cfg: RunConfig, root: Path, parts: list[TaskPart]) -> bytes:
    watchers = [threading.Thread(target=_watch, args=(p, monitor, part), daemon=True)
                for p, part in zip(procs, parts, strict=True)]
    for t in watchers:
        t.start()
    started = time.monotonic()
    verdict: policy.Verdict | None = None
    with monitor.cond:
        while not all(r.state is RankState.SUCCEEDED for r in monitor.records.values()):
            verdict = monitor.check(started)
            if verdict.decision is policy.Decision.STOP:
                break
            monitor.cond.wait(timeout=0.25)
    if verdict is None or verdict.decision is not policy.Decision.STOP:
        for t in watchers:
            t.join(timeout=10)
        return result_path(procs[0].workdir).read_bytes()
    # One rank down means the others would wait on it: stop them, then report.
    time.sleep(_SETTLE_S)
    monitor.stopping = verdict.reason
    monitor.collect_stacks()  # where the ranks still running are, for the report
    for proc in procs:
        proc.kill()
    for t in watchers:
        t.join(timeout=10)
    raise failure_on_driver(monitor, verdict, len(procs), cfg.timeout_s)


def run_on_driver(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    num_processes: int,
    backend: str = "torch",
    gpu_ids: list[str] | None = None,
    config: RunConfig | None = None,
) -> Any:
    """Runs ``fn`` on ``num_processes`` local rank processes; returns rank 0's return value.

    ``gpu_ids``: the driver's GPU addresses to hand out, one per rank, or None for CPU.
    Checkpoints go to ``<temp dir>/sparkdl-<uid>/runs/<run id>/checkpoints``, under this user's
    private directory (a ConfigError before any process starts when that is not private). The
    ranks' output files (``.../<run id>/logs``) stay only when the console did not show every line.
    """
    # On the driver every rank has one GPU of its own: there are no tasks to share theirs.
    cfg = (config or RunConfig()).replace(processes_per_task=1)
    int_at_least("the number of processes", num_processes, 1)
    if gpu_ids is not None and len(gpu_ids) < num_processes:
        raise ConfigError(
            f"{num_processes} processes need {num_processes} GPUs on the driver, but "
            f"spark.driver.resource.gpu lists {len(gpu_ids)} ({gpu_ids}); lower the number of processes"
        )
    check_driver(backend, cfg)
    fn_bytes = pickle_payload(fn, args, kwargs)
    run_id = secrets.token_hex(6)
    run = RunSpec(
        run_id=run_id, world_size=num_processes, backend=backend, use_gpu=gpu_ids is not None,
        # No Spark conf is read here: the temp dir (TMPDIR) is what moves the default.
        checkpoint_url=str(user_dir("runs", setting="TMPDIR") / run_id / "checkpoints"), config=cfg,
    )
    logs = user_dir("runs", setting="TMPDIR") / run_id / "logs"
    watch = Watch.open(cfg, num_processes, 1, None, MetricsLog(None), logs)
    try:
        return LocalLauncher(gpu_ids).run(Job(run, fn_bytes, max_attempts=1), watch.monitor)
    finally:
        if not watch.close(cfg).console:
            # Nobody is handed this run's directory (the caller gets rank 0's value): the files
            # stay only when they hold lines the console did not show, as the warning says.
            shutil.rmtree(logs, ignore_errors=True)
            with contextlib.suppress(OSError):
                logs.parent.rmdir()
