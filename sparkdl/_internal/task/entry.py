"""The Spark task side of a run: one barrier task per rank, or per ``processes_per_task`` ranks.

Each rank of a task (a :class:`~sparkdl._internal.task.lane.Lane`) checks in with the driver over the
authenticated channel and starts in a process of its own
(:class:`~sparkdl._internal.task.rankproc.RankProcess`); the task rendezvouses with its gang through
``BarrierTaskContext.allGather``; each lane relays its process's output to the driver line by
line, sends the rank's stacks when the driver asks (before it stops a run, or when a peer
failed), and task 0 streams rank 0's return value back through Spark. Whatever happens, every
rank process and everything it started end with the task.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

from sparkdl._internal.common import proctree
from sparkdl._internal.common.net import host_of
from sparkdl._internal.task.lane import Lane, RankFailed
from sparkdl._internal.task.payload import TaskPayload
from sparkdl._internal.task.spawn import Zygote
from sparkdl._internal.wire.gang_member import Member
from sparkdl._internal.wire.rankspec import RankSpec, RunSpec
from sparkdl._internal.wire.relay_record import RelayHub
from sparkdl._internal.wire.result_chunks import record_rows, result_rows
from sparkdl._internal.wire.workdir_files import result_path

__all__ = ["RankFailed", "TaskPayload", "task_main"]


def task_main(payload: TaskPayload, batches: Iterator[Any]) -> Iterator[Any]:
    """The function of the barrier ``mapInArrow`` stage; yields rank 0's result as Arrow chunks
    (and, when the gang reported through the relay hub, the hub's signed record of the attempt)."""
    import pyarrow as pa
    from pyspark import BarrierTaskContext

    for _ in batches:
        pass
    run = payload.run
    per_task = run.config.processes_per_task
    ctx = BarrierTaskContext.get()
    task = ctx.partitionId()
    host = payload.rank_host or host_of(ctx.getTaskInfos()[task].address)
    secret = bytes.fromhex(payload.secret_hex)
    lanes: list[Lane] = []
    hub: RelayHub | None = None
    # A rank started as a fresh interpreter is this worker's child: what it orphans comes here.
    adopting = proctree.set_subreaper()
    try:
        gpus = _assigned_gpus(ctx, run, task)
        if task == 0 and payload.channel != "direct" and payload.hub is not None:
            # Started before the gang forms: its port travels with the gang's addresses.
            hub = payload.hub(host, secret, run, payload.first_attempt)
        for local in range(per_task):
            spec = RankSpec.of(run, rank=task * per_task + local, host=host, gpu_ids=gpus, task_pid=os.getpid())
            lanes.append(Lane(payload, secret, spec, ctx.taskAttemptId()))
            lanes[-1].start()
        mine = [lane.member(hub.port if hub is not None and lane.rank == 0 else None) for lane in lanes]
        members = Member.decode_all(ctx.allGather(Member.encode(mine)))
        relayed = not all(m.direct for m in members)
        if not relayed and hub is not None:
            hub.close()
            hub = None
        failure = _run_lanes(lanes, members, relayed)
        if failure is not None and not (relayed and isinstance(failure, RankFailed)):
            raise failure  # Spark reruns the gang
        # Relayed: the hub has the ranks' records; the stage must not fail, or they are lost.
        if relayed:
            for lane in lanes:
                lane.link.close()  # all of this task's messages are sent: the hub may settle
            if hub is None:
                return
            record = hub.finish()
            if record.succeeded:
                yield from result_rows(pa, result_path(lanes[0].workdir))
            yield from record_rows(pa, record.blob)
        elif task == 0:
            yield from result_rows(pa, result_path(lanes[0].workdir))
    finally:
        for lane in lanes:
            lane.stop(run.config.collective_timeout_s)
        if adopting:
            proctree.kill_adopted(os.getpid(), keep=Zygote.started_pids())
            proctree.set_subreaper(False)
        for lane in lanes:
            lane.release()
        if hub is not None:
            hub.close()


def _run_lanes(lanes: list[Lane], members: list[Member], relayed: bool) -> BaseException | None:
    """Runs every lane of the task to its rank's end; the first failure, or None. One rank per
    task runs in this thread. With several, each runs in a thread of its own, and the first
    that fails ends its siblings (without a report of their own: Spark ends the other tasks of
    the gang alike when this one fails)."""
    if len(lanes) == 1:
        try:
            lanes[0].run(members, relayed)
        except BaseException as exc:  # the caller raises it, or keeps it for the hub
            return exc
        return None
    failures: list[BaseException] = []
    lock = threading.Lock()

    def run_lane(lane: Lane) -> None:
        try:
            lane.run(members, relayed)
        except BaseException as exc:  # handed to the task's thread
            with lock:
                failures.append(exc)
                first = len(failures) == 1
            if first and not relayed:
                for sibling in lanes:
                    if sibling is not lane:
                        sibling.end(f"rank {lane.rank} of this task failed")

    threads = [threading.Thread(target=run_lane, args=(lane,), name=f"sparkdl-lane-{lane.rank}", daemon=True)
               for lane in lanes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return failures[0] if failures else None


def _assigned_gpus(ctx: Any, run: RunSpec, task: int) -> list[str]:
    if not run.use_gpu:
        return []
    resources = ctx.resources()
    if "gpu" not in resources or not resources["gpu"].addresses:
        raise RankFailed(
            f"use_gpu=True but Spark assigned no GPU to task {task}: set "
            "spark.task.resource.gpu.amount and spark.executor.resource.gpu.amount"
        )
    gpus = list(resources["gpu"].addresses)
    per_task = run.config.processes_per_task
    if len(gpus) < per_task:
        raise RankFailed(
            f"RunConfig.processes_per_task={per_task} runs {per_task} ranks in each task, one a GPU, but Spark "
            f"assigned {len(gpus)} GPU(s) to task {task} ({','.join(gpus)}): set "
            f"spark.task.resource.gpu.amount={per_task}, or processes_per_task={len(gpus)}"
        )
    return gpus
