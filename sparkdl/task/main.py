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
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkdl import proctree
from sparkdl.rankspec import GangSpec, RankSpec, RunSpec
from sparkdl.reach import Marker, not_shared
from sparkdl.task.mpi import Endpoint, Mpirun, join_job
from sparkdl.task.net import host_of
from sparkdl.task.rankproc import STACK_DUMP_S, RankProcess
from sparkdl.task.spawn import Zygote, read_error
from sparkdl.task.workdir import Workdir
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
    Stop,
    TaskMessage,
    encode,
)

RESULT_CHUNK_BYTES = 16 * 1024 * 1024
_LOG_PIECE_CHARS = 1024 * 1024
# Messages a task keeps while it has no connection yet (its output before the gang formed).
_WAITING_MESSAGES = 10_000
# Channel "auto": how long a task tries to reach the driver before it reports through the hub.
_PROBE_S = 5.0


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
    # How the task reports (sparkdl.spark_api.CHANNEL_MODES): "direct" to the driver, "relay"
    # through the hub in task 0 and Spark's result rows, "auto" direct when it reaches the driver.
    channel: str = "direct"
    # With "relay"/"auto": what task 0 starts as the gang's hub, hub(host, secret, run,
    # first_attempt) (sparkdl.driver.relay.Hub), and the attempt number it gives the gang.
    hub: Any = None
    first_attempt: int = 0


class RankFailed(RuntimeError):
    """Raised in a Spark task whose rank process failed; it fails the task, and Spark reruns the gang."""


class DriverLink:
    """The task's end of the channel: thread-safe typed sends, tagged with rank and attempt.

    It is the :class:`~sparkdl.task.rankproc.Sink` of the rank's relays: a very long line travels
    in pieces that the driver joins back into one line. Without a connection yet (a task that will
    report through the gang's relay hub), messages wait, at most :data:`_WAITING_MESSAGES`.
    """

    def __init__(self, conn: FramedConnection | None, rank: int) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._ok = True
        self._waiting: list[TaskMessage] = []
        self.rank = rank
        self.attempt = -1

    def attach(self, conn: FramedConnection) -> None:
        """Sends go over ``conn`` from now on, those that waited first."""
        with self._lock:
            self._conn, waiting, self._waiting = conn, self._waiting, []
        for message in waiting:
            self.send(message)

    def send(self, message: TaskMessage) -> bool:
        if not self._ok:
            return False
        try:
            with self._lock:
                if self._conn is None:
                    if len(self._waiting) < _WAITING_MESSAGES:
                        self._waiting.append(message)
                    return True
                self._conn.send(encode(message, rank=self.rank, attempt=self.attempt))
            return True
        except (OSError, ChannelError):
            self._ok = False
            return False

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()

    def line(self, stream: str, text: str) -> bool:
        pieces = [text[i : i + _LOG_PIECE_CHARS] for i in range(0, len(text), _LOG_PIECE_CHARS)] or [""]
        return all(self.send(LogLine(stream, piece, i < len(pieces) - 1)) for i, piece in enumerate(pieces))

    def metric(self, record: dict[str, Any]) -> bool:
        return self.send(Metric(record))


@dataclass
class _Orders:
    """What the driver (or the relay hub) told a running rank's task."""

    lost: threading.Event = field(default_factory=threading.Event)  # the driver closed the channel
    stop: str | None = None  # the hub's Stop: the attempt is over


def task_main(payload: TaskPayload, batches: Iterator[Any]) -> Iterator[Any]:
    """The function of the barrier ``mapInArrow`` stage; yields rank 0's result as Arrow chunks
    (and, when the gang reported through the relay hub, the hub's signed record of the attempt)."""
    import sys

    import pyarrow as pa
    from pyspark import BarrierTaskContext

    for _ in batches:
        pass
    run = payload.run
    ctx = BarrierTaskContext.get()
    rank = ctx.partitionId()
    host = payload.rank_host or host_of(ctx.getTaskInfos()[rank].address)
    secret = bytes.fromhex(payload.secret_hex)
    conn = _reach_driver(payload, secret)
    link = DriverLink(conn, rank)
    own = Workdir(run.run_id, rank)  # swept by a later task if this one is killed
    workdir = own.path
    listener: socket.socket | None = None
    proc: RankProcess | None = None
    orders: threading.Thread | None = None
    hub: Any = None
    relayed = False
    # Horovod's MPI controller: this rank's part of the gang's MPI job (sparkdl.task.mpi).
    mpi: Endpoint | None = None
    mpirun: Mpirun | None = None
    code: int | None = None
    # A rank started as a fresh interpreter is this worker's child: what it orphans comes here.
    adopting = proctree.set_subreaper()
    try:
        spec = RankSpec.of(run, rank=rank, host=host, gpu_ids=_assigned_gpus(ctx, run, rank), task_pid=os.getpid())
        if rank == 0:
            listener = socket.create_server((host, 0), backlog=1024)
            if payload.channel != "direct":
                # Started before the gang forms: its port travels with the gang's addresses.
                hub = payload.hub(host, secret, run, payload.first_attempt)
        # The rank process starts now, while the gang forms. Importing torch is the longest step
        # of a launch on a warm executor: the rank is forked from a zygote that did it already.
        proc = RankProcess(
            spec, workdir, payload.fn_bytes, link, store=listener, prewarm=run.config.prewarm,
            start_timeout_s=run.config.connect_timeout_s, tail_lines=run.config.log_tail_lines,
            fallback_out=sys.stdout, fallback_err=sys.stderr,
        )
        if run.backend == "horovod" and run.config.horovod_controller == "mpi":
            mpi = Endpoint(host, secret, rank, workdir, handshake_timeout_s=run.config.handshake_timeout_s)
        tid = ctx.taskAttemptId()
        unshared = payload.checkpoints.missing() if payload.checkpoints is not None else None
        # A directory the user named stops the run here; the default one only its first save.
        strict = payload.checkpoints is not None and payload.checkpoints.strict
        hello = Hello(host, os.getpid(), tid, unshared if strict else None)
        refusal = f"sparkdl rank {rank} on {host}: the checkpoint directory is not shared: {unshared}"
        if conn is not None:
            link.send(hello)
            if unshared is not None and strict:
                raise RankFailed(refusal)
        port = listener.getsockname()[1] if listener else None
        me = {"host": host, "port": port, "tid": tid, "direct": conn is not None, "hub": hub.port if hub else None,
              "mpi": mpi.port if mpi else None, "unshared": unshared}
        members = [json.loads(m) for m in ctx.allGather(json.dumps(me))]
        refused = _refused(run.checkpoint_url, members)
        relayed = not all(m["direct"] for m in members)
        if relayed:
            # Some task cannot reach the driver: the whole gang reports to the hub in task 0.
            if conn is not None:
                conn.close()
            conn = connect((members[0]["host"], members[0]["hub"]), secret, run.config.connect_timeout_s)
            link.attach(conn)
            link.send(hello)
        elif hub is not None:
            hub.close()
            hub = None
        try:
            assert conn is not None
            if relayed and unshared is not None and strict:
                raise RankFailed(refusal)
            # PySpark tasks cannot see their stage attempt number; the driver numbers attempts by the
            # set of task ids that formed each gang, which every rank of a gang reports identically.
            link.send(Gang(tuple(sorted(m["tid"] for m in members))))
            reply = GoAhead.decode(conn.recv(timeout=run.config.connect_timeout_s))
            if not reply.go or reply.attempt is None:
                raise RankFailed(f"sparkdl driver stopped rank {rank}: {reply.reason}")
            attempt = link.attempt = reply.attempt
            job_env = None
            if mpi is not None:
                job_env, mpirun = _join_mpi(mpi, members, spec, workdir, secret, link, run.config.connect_timeout_s)
            proc.tell_gang(GangSpec.form(spec, attempt=attempt, hosts=[m["host"] for m in members],
                                         master_port=members[0]["port"], checkpoints_refused=refused), job_env)
            if listener is not None:
                # Only the rank 0 process holds the store's socket from here on.
                listener.close()
                listener = None
            told = _Orders()
            orders = _answer_driver(conn, link, proc, run.config.connect_timeout_s, told)
            if mpi is not None:
                mpi.watch(lambda why: proc.kill() if proc is not None else None)
            link.send(Started(proc.pid))
            code = proc.wait()
            if told.stop is not None:
                pass  # the hub ended this rank: the attempt failed elsewhere, or a bound passed
            elif told.lost.is_set() and code != 0:
                # The driver ended (a Spark Connect client that disconnected): nobody waits for this run.
                raise RankFailed(f"sparkdl rank {rank} (attempt {attempt}) on {host} was stopped: the driver "
                                 "closed its channel (the driver program or Spark Connect client ended)")
            elif code != 0:
                ended = time.time()
                error, tb, failed_at = read_error(workdir)
                error = error or (mpi.lost if mpi is not None else None)
                exit_signal = -code if code < 0 else None
                link.send(Exited(None if exit_signal else code, exit_signal, error, tb, failed_at or ended))
                how = f"was killed by signal {exit_signal}" if exit_signal else f"exited with code {code}"
                detail = f": {error}" if error else ""
                last = "\n".join(proc.tail)
                raise RankFailed(f"sparkdl rank {rank} (attempt {attempt}) on {host} {how}{detail}\n{last}")
            else:
                link.send(Exited(0, None))
        except RankFailed:
            if not relayed:
                raise  # Spark reruns the gang
            # Relayed: the hub has this rank's record; the stage must not fail, or it is lost.
        if relayed:
            link.close()  # all of this task's messages are sent: the hub may settle
            if hub is None:
                return
            record = hub.finish()
            if record.succeeded:
                yield from _result_batches(pa, workdir / "result.pkl")
            yield from _record_batches(pa, record.blob)
        elif rank == 0:
            yield from _result_batches(pa, workdir / "result.pkl")
    finally:
        if mpi is not None:
            # After the rank's Exited went out: the job may end the other ranks from here on.
            mpi.ended(code if code is not None else -9)
            if code == 0:
                # The job ends once every rank's process has; ending this part first would end the
                # job under ranks still running. A peer is waited for as long as in a collective.
                (mpirun.wait if mpirun is not None else mpi.wait_daemon)(run.config.collective_timeout_s)
            if mpirun is not None:
                mpirun.close()
            mpi.close()
        if proc is not None:
            proc.close()
        if adopting:
            proctree.kill_adopted(os.getpid(), keep=Zygote.started_pids())
            proctree.set_subreaper(False)
        if listener is not None:
            listener.close()
        if conn is not None:
            conn.close()
        if orders is not None:
            orders.join(timeout=STACK_DUMP_S + 0.5)  # closing the connection woke it
        if hub is not None:
            hub.close()
        own.remove()


def _refused(url: str, members: list[dict[str, Any]]) -> str | None:
    """Why no rank of this gang may save a checkpoint (the first one not seeing the marker), or None."""
    for rank, member in enumerate(members):
        if found := member.get("unshared"):
            return not_shared(url, rank, str(member["host"]), str(found), outcome="sparkdl: this checkpoint was not saved")
    return None


def _reach_driver(payload: TaskPayload, secret: bytes) -> FramedConnection | None:
    """The channel to the driver, or None when this task reports through the relay hub: the
    driver is out of its reach (channel "auto", within :data:`_PROBE_S`) or never tried ("relay")."""
    cfg = payload.run.config
    if payload.channel == "relay":
        return None
    if payload.channel == "direct":
        return connect((payload.driver_host, payload.driver_port), secret, cfg.connect_timeout_s)
    try:
        return connect((payload.driver_host, payload.driver_port), secret, min(cfg.connect_timeout_s, _PROBE_S))
    except ChannelError:
        return None


def _answer_driver(conn: FramedConnection, link: DriverLink, proc: RankProcess, timeout_s: float,
                   told: _Orders) -> threading.Thread:
    """Reads the driver's requests once the rank runs (:class:`DumpStacks`: reply with the rank's
    stacks; the relay hub's :class:`Stop`: end the rank) until the connection closes. Its replies
    go through ``link``, whose lock orders them with the relays' sends; the socket's timeout stays
    the one ``recv`` of GoAhead set. When the driver closes the connection while the rank runs,
    the driver is gone (a Spark Connect client ends without the server): ``told.lost`` is set and
    the rank killed, which ends the task."""

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
                    told.lost.set()
                    proc.kill()
                return
            if DumpStacks.asked(frame):
                link.send(Stacks(proc.pid, proc.dump_stacks()))
            elif Stop.asked(frame):
                told.stop = str(frame.get("reason", ""))
                proc.kill()

    thread = threading.Thread(target=serve, name="sparkdl-driver-requests", daemon=True)
    thread.start()
    return thread


def _join_mpi(mpi: Endpoint, members: list[dict[str, Any]], spec: RankSpec, workdir: Path, secret: bytes,
              link: DriverLink, timeout_s: float) -> tuple[dict[str, str], Mpirun | None]:
    """This rank's place in the gang's MPI job (rank 0 starts mpirun); a rank that cannot join
    reports why (with what mpirun said) as its failure."""
    nodes = [(m["host"], m["mpi"]) for m in members]
    try:
        return join_job(mpi, spec.rank, nodes, workdir, secret, spec.host, timeout_s, lambda line: link.line("e", line))
    except (RuntimeError, TimeoutError) as exc:
        link.send(Exited(1, None, str(exc), None, time.time()))
        raise RankFailed(f"sparkdl rank {spec.rank} on {spec.host} did not join the MPI job: {exc}") from exc


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


def _record_batches(pa: Any, blob: bytes) -> Iterator[Any]:
    """The hub's record of the attempt, in chunks numbered -1, -2, ... (rank 0's result: 0, 1, ...)."""
    for i in range(0, max(len(blob), 1), RESULT_CHUNK_BYTES):
        yield _chunk(pa, -1 - i // RESULT_CHUNK_BYTES, blob[i : i + RESULT_CHUNK_BYTES])


def _result_batches(pa: Any, path: Path) -> Iterator[Any]:
    with open(path, "rb") as f:
        index = 0
        while True:
            chunk = f.read(RESULT_CHUNK_BYTES)
            if not chunk and index > 0:
                return
            yield _chunk(pa, index, chunk)
            index += 1


def _chunk(pa: Any, index: int, data: bytes) -> Any:
    """One row of the stage's result (its schema: sparkdl.driver.spark's ``chunk long, data binary``)."""
    return pa.RecordBatch.from_arrays([pa.array([index], pa.int64()), pa.array([data], pa.binary())],
                                      names=["chunk", "data"])
