"""Runs whose driver the executors cannot reach: the gang reports through Spark itself.

A Spark Connect client may be a laptop or a notebook service that no executor can open a
connection to. Its tasks then find no driver at the channel's address (``spark.sparkdl.channel``
"auto"), or are told not to try ("relay"), and report to a :class:`Hub` that task 0 runs for the
attempt instead: the same authenticated channel and messages, a :class:`~sparkdl._internal.driver.monitor.Monitor`
of its own, and the attempt's part of the failure policy. When a rank fails the hub gathers its
peers' stacks and tells every task to stop (:class:`~sparkdl._internal.wire.messages.Stop`); the tasks end
without failing their Spark stage, so that the hub's record of the attempt (every rank's output,
metrics and end, in order) comes back as result rows of the job, signed with the run's secret.
The driver checks the signature and :func:`replay`\\ s the record into its own monitor: the same
rank-tagged output, the same report, at the end of each attempt instead of live. Whether to run
another attempt, the driver decides, in a new Spark job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from sparkdl._internal.common.errors import SparkDLError
from sparkdl._internal.driver.monitor import Monitor
from sparkdl._internal.driver.progress import MetricsLog, Progress
from sparkdl._internal.wire.channel import ChannelError, FramedConnection, Message
from sparkdl._internal.wire.messages import LogLine, LogLines, Metric, RankState, Stop, decode
from sparkdl._internal.wire.rankspec import RunSpec
from sparkdl._internal.wire.relay_record import STOP_EVENT, Body, Record
from sparkdl._internal.wire.server import ChannelServer

# Output kept for the driver, in all; past it lines are counted, not kept (ends always are).
MAX_LOG_BYTES = 64 * 1024 * 1024
# Metrics kept for the driver, in all (their JSON); past it they are counted, not kept.
MAX_METRIC_BYTES = 16 * 1024 * 1024
_POLL_S = 0.25
# After the hub's Stop: how long, beyond kill_grace_s, the tasks have to end and hang up.
_SETTLE_S = 5.0


@dataclass(frozen=True)
class Replayed:
    """What the hub decided, as the driver learns it from the record."""

    stop: str | None  # why the hub stopped the attempt (a bound, a failed rank), None if it did not
    timed_out: bool
    dropped_lines: int
    dropped_metrics: int = 0


class Hub:
    """The channel server and monitor of one attempt, in task 0; see the module's docstring."""

    def __init__(self, host: str, secret: bytes, run: RunSpec, first_attempt: int) -> None:
        cfg = dataclasses.replace(run.config, echo_logs=False)
        self.run, self.cfg, self._secret = run, cfg, secret
        self.first_attempt = first_attempt
        self.monitor = Monitor(run.world_size, first_attempt + 1, cfg, None, MetricsLog(None, keep=False),
                               Progress(1.0, enabled=False), first_attempt=first_attempt)
        self._events: list[tuple[int, Message | None]] = []
        self._keys: dict[Hashable, int] = {}
        self._conns: dict[Hashable, FramedConnection] = {}
        self._closed: set[Hashable] = set()
        self._log_bytes = 0
        self._dropped = 0
        self._metric_bytes = 0
        self._dropped_metrics = 0
        self._stop: str | None = None
        self._timed_out = False
        self._server = ChannelServer(host, secret, self._on_message, self._on_close,
                                     handshake_timeout_s=cfg.handshake_timeout_s)
        self.port = self._server.address[1]
        self._server.__enter__()
        self._watcher = threading.Thread(target=self._watch, name="sparkdl-relay-hub", daemon=True)
        self._watcher.start()

    # ---- the channel -------------------------------------------------------------------------

    def _on_message(self, conn: FramedConnection, frame: Message) -> None:
        key = id(conn)
        with self.monitor.cond:
            index = self._keys.setdefault(key, len(self._keys))
            self._conns[key] = conn
            kept = frame.get("t") != "stacks" and self._keep(frame)
            if kept:
                self._events.append((index, frame))
        self.monitor.on_message(conn, frame)

    def _keep(self, frame: Message) -> bool:
        kind = frame.get("t")
        if kind == Metric.kind:
            size = len(json.dumps(frame.get("m"), separators=(",", ":"), default=str))
            if self._metric_bytes + size > MAX_METRIC_BYTES:
                self._dropped_metrics += 1
                return False
            self._metric_bytes += size
            return True
        if kind not in (LogLine.kind, LogLines.kind):
            return True
        texts = frame.get("ls") if kind == LogLines.kind else [frame.get("l", "")]
        size = sum(len(str(t)) for t in texts) if isinstance(texts, list) else 0
        if self._log_bytes + size > MAX_LOG_BYTES:
            self._dropped += len(texts) if kind == LogLines.kind and isinstance(texts, list) else \
                0 if frame.get("more") else 1
            return False
        self._log_bytes += size
        return True

    def _on_close(self, conn: FramedConnection, reason: str | None) -> None:
        key = id(conn)
        with self.monitor.cond:
            if key in self._keys:
                self._events.append((self._keys[key], None))
            self._closed.add(key)
        self.monitor.on_close(conn, reason)

    # ---- the attempt's policy ----------------------------------------------------------------

    def _watch(self) -> None:
        mon, cfg, n = self.monitor, self.cfg, self.run.world_size
        joined_by = time.monotonic() + cfg.connect_timeout_s + cfg.handshake_timeout_s
        running_since: float | None = None
        settle_by: float | None = None
        while True:
            ask_all = False
            with mon.cond:
                now = time.monotonic()
                recs = self._records()
                if len(self._keys) >= n and set(self._keys) <= self._closed:
                    return
                if settle_by is not None:
                    if now > settle_by:
                        return
                    mon.cond.wait(_POLL_S)
                    continue
                if running_since is None and len(recs) == n:
                    running_since = now
                failed = sorted(rec.rank for rec in recs if rec.state.failed)
                reason: str | None = None
                if mon.unshared is not None:
                    reason = f"rank {mon.unshared[0]} does not share the checkpoint directory"
                elif failed:
                    reason = f"rank {failed[0]} failed"
                elif running_since is None and now > joined_by:
                    reason = (f"only {len(recs)} of {n} ranks reached the relay hub in task 0 within "
                              f"connect_timeout_s + handshake_timeout_s (RunConfig.connect_timeout_s)")
                    self._timed_out = True
                elif cfg.timeout_s is not None and running_since is not None and now - running_since > cfg.timeout_s:
                    reason = f"the attempt ran longer than timeout_s={cfg.timeout_s:g} s (RunConfig.timeout_s)"
                    self._timed_out = ask_all = True
                if reason is None:
                    mon.cond.wait(_POLL_S)
                    continue
                self._stop = reason
                self._events.append((STOP_EVENT, None))  # when, among the ranks' messages
                if self._timed_out:
                    mon.stopping = reason  # ranks it stops are not lost: the report says why
            # The stacks of the running ranks: asked when a rank failed (the monitor did) or now.
            mon.collect_stacks(ask=ask_all)
            with mon.cond:
                conns = [c for key, c in self._conns.items() if key not in self._closed]
                settle_by = time.monotonic() + cfg.kill_grace_s + _SETTLE_S
            for conn in conns:
                with contextlib.suppress(OSError, ChannelError):
                    conn.send(Stop(reason).encode())

    def _records(self) -> list[Any]:
        """The records of this hub's attempt (call with the monitor's ``cond`` held)."""
        return [rec for (a, _), rec in self.monitor.records.items() if a == self.first_attempt]

    def finish(self) -> Record:
        """Once this task has hung up: waits for the attempt to settle, then the signed record."""
        self._watcher.join()
        with self.monitor.cond:
            recs = self._records()
            succeeded = (self._stop is None and len(recs) == self.run.world_size
                         and all(rec.state is RankState.SUCCEEDED for rec in recs))
            body = Body(self.run.run_id, self.first_attempt, list(self._events),
                        [(r.attempt, r.rank, r.stack, r.stack_when) for r in recs if r.stack],
                        stop=self._stop, timed_out=self._timed_out, dropped_lines=self._dropped,
                        dropped_metrics=self._dropped_metrics)
        return Record(succeeded, body.signed(self._secret))

    def close(self) -> None:
        self._server.close()


class _Replay:
    """A task's connection as the replay plays it: requests to it go nowhere (it has ended)."""

    def send(self, message: Message) -> None:
        raise OSError("a relayed task cannot be asked anything")


def replay(blob: bytes, secret: bytes, run_id: str, first_attempt: int, monitor: Monitor) -> Replayed:
    """Feeds the hub's record into the driver's monitor, as if its tasks had reported live."""
    record = Body.verified(secret, blob)
    if record.run != run_id or record.first_attempt != first_attempt:
        raise SparkDLError(
            f"the ranks' relayed record is of run {record.run} attempt {record.first_attempt}, "
            f"not of run {run_id} attempt {first_attempt} (a record from another Spark job)"
        )
    stop, timed_out = record.stop, record.timed_out
    conns: dict[int, Any] = {}
    for index, frame in record.events:
        if index == STOP_EVENT:
            if stop and timed_out:
                with monitor.cond:  # the ranks the hub stopped for a bound are not lost
                    monitor.stopping = stop
            continue
        conn = conns.setdefault(index, _Replay())
        try:
            if frame is None:
                monitor.on_close(conn, None)
            else:
                decode(frame)  # malformed frames are refused, as on the live channel
                monitor.on_message(conn, frame)
        except (ChannelError, KeyError, OSError):
            continue  # a frame the driver cannot place (it was refused on the live channel too)
    for attempt, rank, text, when in record.stacks:
        monitor.relayed_stacks(attempt, rank, text, when)
    dropped = record.dropped_lines
    if dropped:
        print(f"sparkdl: {dropped} lines of the ranks' output were not relayed (over {MAX_LOG_BYTES >> 20} MiB)")
    dropped_metrics = record.dropped_metrics
    if dropped_metrics:
        print(f"sparkdl: {dropped_metrics} metric records of the ranks were not relayed (over "
              f"{MAX_METRIC_BYTES >> 20} MiB); log fewer, or let the executors reach the driver "
              "(spark.sparkdl.channel)")
    return Replayed(stop, timed_out, dropped, dropped_metrics)


def blind_bound(config: Any) -> float | None:
    """How long the driver waits for a relayed attempt's record, which comes only at its end:
    the gang's start and its own bound (the hub enforces timeout_s), None without timeout_s."""
    if config.timeout_s is None:
        return None
    return float(config.start_timeout_s + config.timeout_s + config.kill_grace_s + 2 * _SETTLE_S)
