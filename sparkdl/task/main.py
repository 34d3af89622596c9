"""The Spark task side of a run: one barrier task per rank.

Each task checks in with the driver over the authenticated channel, rendezvouses with its gang
through ``BarrierTaskContext.allGather``, starts its rank in a process of its own
(:class:`~sparkdl.task.rankproc.RankProcess`), relays that process's output to the driver line
by line, sends the rank's stacks when the driver asks (before it stops a run, or when a peer
failed), and streams rank 0's return value back through Spark. Whatever happens, the rank
process and everything it started end with the task.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkdl import proctree
from sparkdl.rankspec import GangSpec, RankSpec, RunSpec
from sparkdl.reach import Marker
from sparkdl.task.net import host_of
from sparkdl.task.rankproc import STACK_DUMP_S, RankProcess
from sparkdl.task.spawn import Zygote, read_error
from sparkdl.wire.channel import ChannelError, FramedConnection, connect
from sparkdl.wire.messages import (
    DumpStacks,
    Exited,
    Gang,
    GoAhead,
    Hello,
    LogLine,
    Metric,
    Stacks,
    Started,
    TaskMessage,
    encode,
)

RESULT_CHUNK_BYTES = 16 * 1024 * 1024
_LOG_PIECE_CHARS = 1024 * 1024


@dataclass(frozen=True)
class TaskPayload:
    """Everything a task needs, as plain values: the only thing shipped from driver to tasks."""

    run: RunSpec
    fn_bytes: bytes
    secret_hex: str = field(repr=False)  # never in a log line or a traceback's locals
    driver_host: str
    driver_port: int
    # The address the ranks listen on (TCPStore, gloo): loopback in local mode, else None for the
    # task's own address as Spark gives it.
    rank_host: str | None = None
    # The driver's marker in the checkpoint directory: every task must read it back before its
    # rank starts (a directory on the driver's own disk is not where other hosts' ranks write).
    checkpoints: Marker | None = None


class RankFailed(RuntimeError):
    """Raised in a Spark task whose rank process failed; it fails the task, and Spark reruns the gang."""


class DriverLink:
    """The task's end of the channel: thread-safe typed sends, tagged with rank and attempt.

    It is the :class:`~sparkdl.task.rankproc.Sink` of the rank's relays: a very long line travels
    in pieces that the driver joins back into one line.
    """

    def __init__(self, conn: FramedConnection, rank: int) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._ok = True
        self.rank = rank
        self.attempt = -1

    def send(self, message: TaskMessage) -> bool:
        if not self._ok:
            return False
        try:
            with self._lock:
                self._conn.send(encode(message, rank=self.rank, attempt=self.attempt))
            return True
        except (OSError, ChannelError):
            self._ok = False
            return False

    def line(self, stream: str, text: str) -> bool:
        pieces = [text[i : i + _LOG_PIECE_CHARS] for i in range(0, len(text), _LOG_PIECE_CHARS)] or [""]
        return all(self.send(LogLine(stream, piece, i < len(pieces) - 1)) for i, piece in enumerate(pieces))

    def metric(self, record: dict[str, Any]) -> bool:
        return self.send(Metric(record))


def task_main(payload: TaskPayload, batches: Iterator[Any]) -> Iterator[Any]:
    """The function of the barrier ``mapInArrow`` stage; yields rank 0's result as Arrow chunks."""
    import sys

    import pyarrow as pa
    from pyspark import BarrierTaskContext

    for _ in batches:
        pass
    run = payload.run
    ctx = BarrierTaskContext.get()
    rank = ctx.partitionId()
    host = payload.rank_host or host_of(ctx.getTaskInfos()[rank].address)
    conn = connect((payload.driver_host, payload.driver_port), bytes.fromhex(payload.secret_hex),
                   run.config.connect_timeout_s)
    link = DriverLink(conn, rank)
    workdir = Path(tempfile.mkdtemp(prefix=f"sparkdl-{run.run_id}-r{rank}-"))
    listener: socket.socket | None = None
    proc: RankProcess | None = None
    orders: threading.Thread | None = None
    # A rank started as a fresh interpreter is this worker's child: what it orphans comes here.
    adopting = proctree.set_subreaper()
    try:
        spec = RankSpec.of(run, rank=rank, host=host, gpu_ids=_assigned_gpus(ctx, run, rank), task_pid=os.getpid())
        if rank == 0:
            listener = socket.create_server((host, 0), backlog=1024)
        # The rank process starts now, while the gang forms. Importing torch is the longest step
        # of a launch on a warm executor: the rank is forked from a zygote that did it already.
        proc = RankProcess(
            spec, workdir, payload.fn_bytes, link, store=listener, prewarm=run.config.prewarm,
            start_timeout_s=run.config.connect_timeout_s, tail_lines=run.config.log_tail_lines,
            fallback_out=sys.stdout, fallback_err=sys.stderr,
        )
        tid = ctx.taskAttemptId()
        unshared = payload.checkpoints.missing() if payload.checkpoints is not None else None
        link.send(Hello(host, os.getpid(), tid, unshared))
        if unshared is not None:
            raise RankFailed(f"sparkdl rank {rank} on {host}: the checkpoint directory is not shared: {unshared}")
        port = listener.getsockname()[1] if listener else None
        members = [json.loads(m) for m in ctx.allGather(json.dumps({"host": host, "port": port, "tid": tid}))]
        # PySpark tasks cannot see their stage attempt number; the driver numbers attempts by the
        # set of task ids that formed each gang, which every rank of a gang reports identically.
        link.send(Gang(tuple(sorted(m["tid"] for m in members))))
        reply = GoAhead.decode(conn.recv(timeout=run.config.connect_timeout_s))
        if not reply.go or reply.attempt is None:
            raise RankFailed(f"sparkdl driver stopped rank {rank}: {reply.reason}")
        attempt = link.attempt = reply.attempt
        proc.tell_gang(GangSpec.form(spec, attempt=attempt, hosts=[m["host"] for m in members],
                                     master_port=members[0]["port"]))
        if listener is not None:
            # Only the rank 0 process holds the store's socket from here on.
            listener.close()
            listener = None
        lost = threading.Event()
        orders = _answer_driver(conn, link, proc, run.config.connect_timeout_s, lost)
        link.send(Started(proc.pid))
        code = proc.wait()
        if lost.is_set() and code != 0:
            # The driver ended (a Spark Connect client that disconnected): nobody waits for this run.
            raise RankFailed(f"sparkdl rank {rank} (attempt {attempt}) on {host} was stopped: the driver closed "
                             "its channel (the driver program or Spark Connect client ended)")
        if code != 0:
            ended = time.time()
            error, tb, failed_at = read_error(workdir)
            exit_signal = -code if code < 0 else None
            link.send(Exited(None if exit_signal else code, exit_signal, error, tb, failed_at or ended))
            how = f"was killed by signal {exit_signal}" if exit_signal else f"exited with code {code}"
            detail = f": {error}" if error else ""
            last = "\n".join(proc.tail)
            raise RankFailed(f"sparkdl rank {rank} (attempt {attempt}) on {host} {how}{detail}\n{last}")
        link.send(Exited(0, None))
        if rank == 0:
            yield from _result_batches(pa, workdir / "result.pkl")
    finally:
        if proc is not None:
            proc.close()
        if adopting:
            proctree.kill_adopted(os.getpid(), keep=Zygote.started_pids())
            proctree.set_subreaper(False)
        if listener is not None:
            listener.close()
        conn.close()
        if orders is not None:
            orders.join(timeout=STACK_DUMP_S + 0.5)  # closing the connection woke it
        shutil.rmtree(workdir, ignore_errors=True)


def _answer_driver(conn: FramedConnection, link: DriverLink, proc: RankProcess, timeout_s: float,
                   lost: threading.Event) -> threading.Thread:
    """Reads the driver's requests once the rank runs (:class:`DumpStacks`: reply with the rank's
    stacks) until the connection closes. Its replies go through ``link``, whose lock orders them
    with the relays' sends; the socket's timeout stays the one ``recv`` of GoAhead set. When the
    driver closes the connection while the rank runs, the driver is gone (a Spark Connect client
    ends without the server): ``lost`` is set and the rank killed, which ends the task."""

    def serve() -> None:
        while True:
            try:
                if not conn.readable(0.5):
                    continue
                frame = conn.recv(timeout=timeout_s)
            except (ValueError, ChannelError):
                return
            except OSError:
                frame = None
            if frame is None:
                if proc.running():
                    lost.set()
                    proc.kill()
                return
            if DumpStacks.asked(frame):
                link.send(Stacks(proc.pid, proc.dump_stacks()))

    thread = threading.Thread(target=serve, name="sparkdl-driver-requests", daemon=True)
    thread.start()
    return thread


def _assigned_gpus(ctx: Any, run: RunSpec, rank: int) -> list[str]:
    if not run.use_gpu:
        return []
    resources = ctx.resources()
    if "gpu" not in resources or not resources["gpu"].addresses:
        raise RankFailed(
            f"use_gpu=True but Spark assigned no GPU to the task of rank {rank}: set "
            "spark.task.resource.gpu.amount and spark.executor.resource.gpu.amount"
        )
    return list(resources["gpu"].addresses)


def _result_batches(pa: Any, path: Path) -> Iterator[Any]:
    with open(path, "rb") as f:
        index = 0
        while True:
            chunk = f.read(RESULT_CHUNK_BYTES)
            if not chunk and index > 0:
                return
            yield pa.RecordBatch.from_arrays(
                [pa.array([index], pa.int64()), pa.array([chunk], pa.binary())],
                names=["chunk", "data"],
            )
            index += 1
