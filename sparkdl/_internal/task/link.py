"""A rank's channel to the driver, as its Spark task holds it: typed sends tagged with the rank
and attempt, and how the task reaches the driver (or learns it cannot)."""

from __future__ import annotations

import threading
from typing import Any

from sparkdl._internal.task.payload import TaskPayload
from sparkdl._internal.wire.channel import ChannelError, FramedConnection, connect
from sparkdl._internal.wire.messages import LogLine, LogLines, Metric, TaskMessage, encode

_LOG_PIECE_CHARS = 1024 * 1024
# Messages a rank keeps while it has no connection yet (its output before the gang formed).
_WAITING_MESSAGES = 10_000
# Channel "auto": how long a task tries to reach the driver before it reports through the hub.
_PROBE_S = 5.0


class DriverLink:
    """The rank's end of the channel: thread-safe typed sends, tagged with rank and attempt.

    It is the :class:`~sparkdl._internal.task.rankproc.Sink` of the rank's relays: a very long line travels
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

    def lines(self, stream: str, texts: list[str]) -> bool:
        """Lines that came together, in as few frames as fit :data:`_LOG_PIECE_CHARS` each (a longer
        line alone, in pieces)."""
        batch: list[str] = []
        size = 0
        for text in texts:
            if batch and size + len(text) > _LOG_PIECE_CHARS:
                if not self._batch(stream, batch):
                    return False
                batch, size = [], 0
            if len(text) > _LOG_PIECE_CHARS:
                if not self.line(stream, text):
                    return False
                continue
            batch.append(text)
            size += len(text)
        return self._batch(stream, batch)

    def _batch(self, stream: str, texts: list[str]) -> bool:
        if len(texts) <= 1:
            return all(self.send(LogLine(stream, text)) for text in texts)
        return self.send(LogLines(stream, tuple(texts)))

    def metric(self, record: dict[str, Any]) -> bool:
        return self.send(Metric(record))


def reach_driver(payload: TaskPayload, secret: bytes) -> FramedConnection | None:
    """The channel to the driver, or None when this rank reports through the relay hub: the
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
