"""Ranks as processes on the driver alone, without Spark tasks: for development and notebooks.

This backs ``HorovodRunner(np=-N)`` and ``TorchDistributor(local_mode=True)``. Each rank is the
same lane as in a Spark task (:class:`~sparkdl._internal.task.lane.Lane`): the same rank process,
environment, lifeline, output relay, metrics, channel to the driver and clean-up, watched by the
same monitor and failure policy, so code that runs here runs on the cluster too. There is no gang
rerun on the driver: a failure ends the run with the same report as ``sparkdl.run``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

from sparkdl._internal.backends import check_driver, get_backend
from sparkdl._internal.backends.base import LocalJob
from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.common.validate import int_at_least
from sparkdl._internal.driver import policy
from sparkdl._internal.driver.failure import failure_on_driver
from sparkdl._internal.driver.launcher import Job, Launcher, Watch, pickle_payload
from sparkdl._internal.driver.monitor import Monitor
from sparkdl._internal.driver.progress import MetricsLog
from sparkdl._internal.fs.private import user_dir
from sparkdl._internal.task.lane import Joined, Lane, RankFailed
from sparkdl._internal.task.payload import TaskPayload
from sparkdl._internal.wire.gang_member import Member
from sparkdl._internal.wire.messages import LogLine, RankState
from sparkdl._internal.wire.rankspec import RankSpec, RunSpec
from sparkdl._internal.wire.server import ChannelServer
from sparkdl._internal.wire.workdir_files import result_path

_HOST = "127.0.0.1"
log = logging.getLogger(__name__)
# After the first failure, the other ranks get this long to record their own outcome.
_SETTLE_S = 0.5


class LocalLauncher(Launcher):
    """``world_size`` rank processes on this machine; ``gpu_ids``: one per rank, or None for CPU.

    Each rank is a :class:`~sparkdl._internal.task.lane.Lane`, as in a Spark task, run in a
    thread of the driver and talking to the driver's monitor over the same authenticated channel
    on loopback: the rank's start, gang, output, stacks, end and error travel as on a cluster."""

    def __init__(self, gpu_ids: list[str] | None) -> None:
        self.gpu_ids = gpu_ids

    def launch(self, job: Job, monitor: Monitor) -> bytes:
        run = job.run
        cfg = run.config
        secret = secrets.token_bytes(32)
        lanes: list[Lane] = []
        backend_job: LocalJob | None = None
        finished = False
        with ChannelServer(_HOST, secret, monitor.on_message, monitor.on_close,
                           handshake_timeout_s=cfg.handshake_timeout_s) as server:
            payload = TaskPayload(run, job.fn_bytes, secret.hex(), *server.address, rank_host=_HOST)
            try:
                for rank in range(run.world_size):
                    gpus = [self.gpu_ids[rank]] if self.gpu_ids is not None else []
                    spec = RankSpec.of(run, rank=rank, host=_HOST, gpu_ids=gpus, task_pid=os.getpid())
                    lanes.append(Lane(payload, secret, spec, tid=rank, on_driver=True))
                    lanes[-1].start()
                members = [lane.member(None) for lane in lanes]
                # One process owns every rank: the backend forms its job (Open MPI's) for all of
                # them at once, before they are told the gang, as a gang's tasks do together.
                envs, backend_job = get_backend(run.backend).join_local(
                    [lane.part for lane in lanes if lane.part is not None], _HOST, lanes[0].workdir, secret,
                    cfg.connect_timeout_s, lambda line: monitor.log(0, 0, LogLine("e", line)))
                value = _wait(lanes, members, envs, monitor, cfg)
                finished = True
                return value
            finally:
                for lane in lanes:
                    if not finished:
                        lane.end("the run on the driver ended")
                    lane.ended()
                if backend_job is not None:
                    backend_job.close(cfg.collective_timeout_s if finished else None)
                for lane in lanes:
                    lane.stop(cfg.collective_timeout_s if finished else 0.0)
                for lane in lanes:
                    lane.release()


def _wait(lanes: list[Lane], members: list[Member], envs: list[dict[str, str] | None], monitor: Monitor,
          cfg: RunConfig) -> bytes:
    def run_lane(lane: Lane, env: dict[str, str] | None) -> None:
        try:
            lane.run(members, relayed=False, joined=Joined(env))
        except RankFailed:
            pass  # its failure reached the monitor as the rank's Exited
        except Exception as exc:  # the lane itself (its channel, its gang): the monitor's bounds end the run
            log.warning("sparkdl: rank %d on the driver: %s: %s", lane.rank, type(exc).__name__, exc)

    threads = [threading.Thread(target=run_lane, args=(lane, env), name=f"sparkdl-local-rank-{lane.rank}", daemon=True)
               for lane, env in zip(lanes, envs, strict=True)]
    for t in threads:
        t.start()
    started = time.monotonic()
    verdict: policy.Verdict | None = None
    with monitor.cond:
        while len(monitor.records) < len(lanes) or not all(
                r.state is RankState.SUCCEEDED for r in monitor.records.values()):
            verdict = monitor.check(started)
            if verdict.decision is policy.Decision.STOP:
                break
            monitor.cond.wait(timeout=0.25)
    if verdict is None or verdict.decision is not policy.Decision.STOP:
        for t in threads:
            t.join(timeout=10)
        return result_path(lanes[0].workdir).read_bytes()
    # One rank down means the others would wait on it: stop them, then report.
    time.sleep(_SETTLE_S)
    monitor.stopping = verdict.reason
    monitor.collect_stacks()  # where the ranks still running are, for the report
    for lane in lanes:
        lane.end(verdict.reason or "another rank failed")
    for t in threads:
        t.join(timeout=10)
    raise failure_on_driver(monitor, verdict, len(lanes), cfg.timeout_s)


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
