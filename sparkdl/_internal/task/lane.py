"""One rank, from its start to its end, for both launchers: a Spark task runs one lane per rank
it holds (``RunConfig.processes_per_task``, one by default), and the driver-local launcher one per
rank on the driver (:mod:`sparkdl._internal.driver.local`), over the same channel.

A lane has what a rank needs of its own: its channel to the driver, its working directory, its
process (:class:`~sparkdl._internal.task.rankproc.RankProcess`) with its output relays and lifeline, the
TCPStore's listener on rank 0, its part of an MPI job. :meth:`Lane.start` starts the rank while
the gang forms; :meth:`Lane.member` is what the lane tells the gang; :meth:`Lane.run` joins the
gang, tells the rank where it is, answers the driver's requests and waits for the rank's end;
:meth:`Lane.stop` and :meth:`Lane.release` end and free everything it holds.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from sparkdl._internal.backends import get_backend
from sparkdl._internal.backends.base import JoinError, Joining, TaskPart
from sparkdl._internal.spark.reach import not_shared
from sparkdl._internal.task.link import DriverLink, reach_driver
from sparkdl._internal.task.payload import TaskPayload
from sparkdl._internal.task.rankproc import STACK_DUMP_S, RankProcess
from sparkdl._internal.task.workdir import Workdir
from sparkdl._internal.wire.channel import ChannelError, FramedConnection, connect
from sparkdl._internal.wire.gang_member import Member
from sparkdl._internal.wire.messages import (
    DumpStacks,
    Exited,
    Gang,
    GoAhead,
    Hello,
    Stacks,
    Started,
    Stop,
)
from sparkdl._internal.wire.rankspec import GangSpec, RankSpec
from sparkdl._internal.wire.trial import Decide, decision_line


@dataclass(frozen=True)
class Joined:
    """A rank's place in the backend's job when its launcher formed the job for all its ranks at
    once (``Backend.join_local``): the rank's variables, instead of its part's own join."""

    env: dict[str, str] | None


class RankFailed(RuntimeError):
    """Raised in a Spark task whose rank process failed; it fails the task, and Spark reruns the gang."""


@dataclass
class Orders:
    """What the driver (or the relay hub, or the task) told a running rank's lane."""

    lost: threading.Event = field(default_factory=threading.Event)  # the driver closed the channel
    stop: str | None = None  # the attempt is over for this rank: the hub's Stop, or a failed sibling


class Lane:
    """One rank of a task; see the module's description."""

    def __init__(self, payload: TaskPayload, secret: bytes, spec: RankSpec, tid: int, *, on_driver: bool = False) -> None:
        self.payload = payload
        self.secret = secret
        self.spec = spec
        self.rank = spec.rank
        self.tid = tid
        self.told = Orders()
        self.code: int | None = None
        self.conn: FramedConnection | None = None
        self.link = DriverLink(None, spec.rank)
        self.own = Workdir(spec.run_id, spec.rank)  # swept by a later task if this one is killed
        self.workdir: Path = self.own.path
        self.listener: socket.socket | None = None
        self.proc: RankProcess | None = None
        # What the backend holds here for the rank (a TensorFlow server's port, its part of an MPI job).
        self.part: TaskPart | None = None
        self._orders: threading.Thread | None = None
        self._hello: Hello | None = None
        self._unshared: str | None = None
        self._strict = False
        self._on_driver = on_driver  # the rank is forked from the driver's zygote, not the executor's

    def start(self) -> None:
        """Reaches the driver and starts the rank process while the gang forms; checks in."""
        payload, run, host = self.payload, self.payload.run, self.spec.host
        self.conn = reach_driver(payload, self.secret)
        if self.conn is not None:
            self.link.attach(self.conn)
        if self.rank == 0:
            self.listener = socket.create_server((host, 0), backlog=1024)
        # Importing torch is the longest step of a launch on a warm executor: the rank is forked
        # from a zygote that did it already.
        self.proc = RankProcess(
            self.spec, self.workdir, payload.fn_bytes, self.link, store=self.listener, prewarm=run.config.prewarm,
            on_driver=self._on_driver, start_timeout_s=run.config.connect_timeout_s,
            tail_lines=run.config.log_tail_lines, fallback_out=sys.stdout, fallback_err=sys.stderr,
        )
        self.part = get_backend(run.backend).task_part(run.config, self.rank, host, self.workdir, self.secret)
        self._unshared = payload.checkpoints.missing() if payload.checkpoints is not None else None
        # A directory the user named stops the run here; the default one only its first save.
        self._strict = payload.checkpoints is not None and payload.checkpoints.strict
        self._hello = Hello(host, os.getpid(), self.tid, self._unshared if self._strict else None)
        if self.conn is not None:
            self.link.send(self._hello)
            self._refuse_unshared()

    def member(self, hub_port: int | None) -> Member:
        """What the rest of the gang learns of this rank (through ``allGather``)."""
        port = self.listener.getsockname()[1] if self.listener else None
        return Member(self.spec.host, port, self.tid, self.conn is not None, hub_port, self._unshared,
                      self.part.member() if self.part else {})

    def _refuse_unshared(self) -> None:
        if self._unshared is not None and self._strict:
            raise RankFailed(f"sparkdl rank {self.rank} on {self.spec.host}: the checkpoint directory is not "
                             f"shared: {self._unshared}")

    def run(self, members: list[Member], relayed: bool, joined: Joined | None = None) -> None:
        """Joins the gang of ``members`` (one a rank), runs the rank and waits for its end;
        RankFailed when it failed (or was refused). ``joined``: the backend's job, when the
        launcher formed it for all its ranks at once (on the driver: one process owns them)."""
        proc, run, cfg = self.proc, self.payload.run, self.payload.run.config
        assert proc is not None
        if relayed:
            # Some task cannot reach the driver: the whole gang reports to the hub in task 0.
            if self.conn is not None:
                self.conn.close()
            if members[0].hub is None:
                raise RankFailed(f"sparkdl rank {self.rank}: a task of the gang cannot reach the driver and task 0 "
                                 "runs no relay hub (spark.sparkdl.channel=direct): set it to auto")
            self.conn = connect((members[0].host, members[0].hub), self.secret, cfg.connect_timeout_s)
            self.link.attach(self.conn)
            assert self._hello is not None
            self.link.send(self._hello)
            self._refuse_unshared()
        conn, link, rank, host = self.conn, self.link, self.rank, self.spec.host
        assert conn is not None
        # PySpark tasks cannot see their stage attempt number; the driver numbers attempts by the
        # task ids that formed each gang (one a rank), which every rank of a gang reports identically.
        link.send(Gang(tuple(sorted(m.tid for m in members))))
        reply = GoAhead.decode(conn.recv(timeout=cfg.connect_timeout_s))
        if not reply.go or reply.attempt is None:
            raise RankFailed(f"sparkdl driver stopped rank {rank}: {reply.reason}")
        attempt = link.attempt = reply.attempt
        part = self.part
        assert part is not None
        joining = Joining(rank, host, [{"host": m.host, **m.backend} for m in members], self.workdir, self.secret,
                          cfg.connect_timeout_s, lambda line: link.line("e", line))
        try:
            job_env = joined.env if joined is not None else part.join(joining)
        except JoinError as exc:  # the rank cannot run: it reports why (with what the job said) as its failure
            link.send(Exited(1, None, str(exc), None, time.time()))
            raise RankFailed(f"sparkdl rank {rank} on {host} did not join {part.job}: {exc}") from exc
        if members[0].port is None:
            raise RankFailed("sparkdl: rank 0's task told the gang no store port (internal error)")
        proc.tell_gang(GangSpec.form(self.spec, attempt=attempt, hosts=[m.host for m in members],
                                     master_port=members[0].port,
                                     checkpoints_refused=refused(run.checkpoint_url, members)), job_env)
        if relayed and run.trial is not None:
            # The hub carries no decisions: the trial's reports are not waited on.
            proc.order(decision_line(None, off="the gang reports through the relay hub (spark.sparkdl.channel)"))
        if self.listener is not None:
            # Only the rank 0 process holds the store's socket from here on.
            self.listener.close()
            self.listener = None
        self._orders = _answer_driver(conn, link, proc, cfg.connect_timeout_s, self.told)
        part.watch(lambda why: proc.kill())
        link.send(Started(proc.pid))
        code = self.code = proc.wait()
        if self.told.stop is not None:
            return  # the hub ended this rank (the attempt failed elsewhere, or a bound passed), or the task did
        if self.told.lost.is_set() and code != 0:
            # The driver ended (a Spark Connect client that disconnected): nobody waits for this run.
            raise RankFailed(f"sparkdl rank {rank} (attempt {attempt}) on {host} was stopped: the driver "
                             "closed its channel (the driver program or Spark Connect client ended)")
        exited = proc.exited(code, part.lost)
        link.send(exited)
        if code != 0:
            how = f"was killed by signal {exited.signal}" if exited.signal else f"exited with code {code}"
            detail = f": {exited.error}" if exited.error else ""
            last = "\n".join(proc.tail)
            raise RankFailed(f"sparkdl rank {rank} (attempt {attempt}) on {host} {how}{detail}\n{last}")

    def end(self, why: str) -> None:
        """Ends the rank without a report of its own: ``why`` (a rank of its task failed)."""
        self.told.stop = why
        if self.proc is not None:
            self.proc.kill()

    def ended(self) -> None:
        """Tells the backend's part that the rank ended (after its Exited went out: the job may
        end the other ranks from here on); :meth:`stop` does it too."""
        if self.part is not None:
            self.part.ended(self.code if self.code is not None else -9)

    def stop(self, collective_timeout_s: float) -> None:
        """Ends the rank process and the backend's part of it (an MPI job's)."""
        if self.part is not None:
            self.ended()
            self.part.close(collective_timeout_s if self.code == 0 else None)
            self.part = None
        if self.proc is not None:
            self.proc.close()

    def release(self) -> None:
        """Frees the rest: the listeners and reserved port, the channel, the thread that read it, the workdir."""
        if self.listener is not None:
            self.listener.close()
        if self.part is not None:  # the rank never ran (stop closes it otherwise)
            self.part.close(None)
            self.part = None
        if self.conn is not None:
            self.conn.close()
        if self._orders is not None:
            self._orders.join(timeout=STACK_DUMP_S + 0.5)  # closing the connection woke it
        self.own.remove()


def refused(url: str, members: list[Member]) -> str | None:
    """Why no rank of this gang may save a checkpoint (the first one not seeing the marker), or None."""
    for rank, member in enumerate(members):
        if member.unshared:
            return not_shared(url, rank, member.host, member.unshared, outcome="sparkdl: this checkpoint was not saved")
    return None


def _answer_driver(conn: FramedConnection, link: DriverLink, proc: RankProcess, timeout_s: float,
                   told: Orders) -> threading.Thread:
    """Reads the driver's requests once the rank runs (:class:`DumpStacks`: reply with the rank's
    stacks; :class:`Decide`: a trial's decision, passed down to the rank; the relay hub's
    :class:`Stop`: end the rank) until the connection closes. Its replies
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
            if (decision := Decide.asked(frame)) is not None:
                proc.order(decision_line(decision))
            elif DumpStacks.asked(frame):
                link.send(Stacks(proc.pid, proc.dump_stacks()))
            elif Stop.asked(frame):
                told.stop = str(frame.get("reason", ""))
                proc.kill()

    thread = threading.Thread(target=serve, name=f"sparkdl-driver-requests-{link.rank}", daemon=True)
    thread.start()
    return thread
