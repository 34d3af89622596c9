"""The typed messages of the task <-> driver protocol, and a rank's state.

On the wire each message is one JSON object (sent by :mod:`sparkdl._internal.wire.channel`, which
authenticates every frame before it is parsed). A task's messages carry its rank (``r``) and
attempt (``a``, -1 until the gang has formed) next to a kind (``t``); the driver's reply,
:class:`GoAhead`, has no kind, nor have its later requests, :class:`DumpStacks` and :class:`Stop`.
:func:`decode` turns a frame into a message and refuses anything malformed with :class:`~sparkdl._internal.wire.channel.ChannelError`, so a bad frame ends its connection
instead of a thread of the driver.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar

from sparkdl._internal.wire.channel import ChannelError


class RankState(str, enum.Enum):
    """Where one rank of one attempt is, as the driver sees it."""

    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    LOST = "lost"

    def __str__(self) -> str:
        return self.value

    @property
    def failed(self) -> bool:
        return self in (RankState.FAILED, RankState.LOST)

    @property
    def ended(self) -> bool:
        return self in (RankState.SUCCEEDED, RankState.FAILED, RankState.LOST)


@dataclass(frozen=True)
class Hello:
    """A task has connected: where it runs, before its gang has formed."""

    kind: ClassVar[str] = "hello"
    host: str
    task_pid: int
    tid: int
    # What this task found instead of the driver's marker in the checkpoint directory (a directory
    # not shared with the driver's host); None: it is shared. See sparkdl._internal.spark.reach.
    unshared: str | None = None

    def fields(self) -> dict[str, Any]:
        return {"host": self.host, "task_pid": self.task_pid, "tid": self.tid, "unshared": self.unshared}


@dataclass(frozen=True)
class Gang:
    """The gang has formed: the Spark task ids of all its members, the same on every rank."""

    kind: ClassVar[str] = "gang"
    tids: tuple[int, ...]

    def fields(self) -> dict[str, Any]:
        return {"tids": list(self.tids)}


@dataclass(frozen=True)
class Started:
    """The rank's process runs the user's function (it has been told the gang)."""

    kind: ClassVar[str] = "started"
    pid: int

    def fields(self) -> dict[str, Any]:
        return {"pid": self.pid}


@dataclass(frozen=True)
class Exited:
    """The rank's process ended: an exit code or a signal, and the error it recorded, if any.

    ``at``: when it failed, by the wall clock of its host (``time.time()``): when the rank recorded
    its error, else when its task saw it end. None on success.
    """

    kind: ClassVar[str] = "exit"
    code: int | None
    signal: int | None
    error: str | None = None
    traceback: str | None = None
    at: float | None = None

    @property
    def succeeded(self) -> bool:
        return self.code == 0 and self.signal is None

    def fields(self) -> dict[str, Any]:
        return {"code": self.code, "signal": self.signal, "error": self.error, "traceback": self.traceback,
                "at": self.at}


@dataclass(frozen=True)
class LogLine:
    """A piece of one line of the rank's output; ``more`` says the line goes on in the next one."""

    kind: ClassVar[str] = "log"
    stream: str  # "o": stdout, "e": stderr
    text: str
    more: bool = False

    def fields(self) -> dict[str, Any]:
        return {"s": self.stream, "l": self.text, "more": self.more}


@dataclass(frozen=True)
class LogLines:
    """Whole lines of the rank's output that came together (the task's relay sends what it read
    within a short window as one frame: one HMAC, one JSON document, one wake-up of the driver)."""

    kind: ClassVar[str] = "logs"
    stream: str
    texts: tuple[str, ...]

    def fields(self) -> dict[str, Any]:
        return {"s": self.stream, "ls": list(self.texts)}


MAX_LINE_BYTES = 128 * 1024 * 1024
"""The longest line of a rank's output kept whole. Output that goes on without a newline past it
(a program writing a stream of bytes with none) is sent in lines of this size by the task, and
the driver keeps no more of one line; a carriage return redraws its line, as in a terminal, so a
progress bar's redraws (tqdm's ``\r``) keep only the last one."""

# The key of a Metric record that only reports a rank's step (TrainState sends one a second from
# every rank but 0): the driver's progress line and straggler check take it; the metrics do not.
PROGRESS_KEY = "sparkdl.progress"
# The key of a Metric record that says a restore skipped a checkpoint that did not verify (its
# number; "reason" says why): the driver keeps it for the run's result and report, not the metrics.
SKIPPED_CHECKPOINT_KEY = "sparkdl.skipped_checkpoint"


@dataclass(frozen=True)
class Metric:
    """One record the rank sent with ``context().log_metrics``."""

    kind: ClassVar[str] = "metric"
    record: dict[str, Any]

    def fields(self) -> dict[str, Any]:
        return {"m": self.record}


@dataclass(frozen=True)
class Stacks:
    """The rank's Python stacks (every thread, as :mod:`faulthandler` writes them), sent in reply to
    :class:`DumpStacks`; ``text`` is None when the rank had ended or gave none in time."""

    kind: ClassVar[str] = "stacks"
    pid: int | None
    text: str | None

    def fields(self) -> dict[str, Any]:
        return {"pid": self.pid, "text": self.text}


TaskMessage = Hello | Gang | Started | Exited | LogLine | LogLines | Metric | Stacks


@dataclass(frozen=True)
class DumpStacks:
    """The driver's request to a running rank's task, before it stops the attempt: reply with
    :class:`Stacks`."""

    def encode(self) -> dict[str, Any]:
        return {"do": "stacks"}

    @staticmethod
    def asked(frame: dict[str, Any] | None) -> bool:
        return frame is not None and frame.get("do") == "stacks"


@dataclass(frozen=True)
class Stop:
    """The relay hub's order to a task (runs whose driver the executors cannot reach, see
    :mod:`sparkdl._internal.driver.relay`): end the rank now, its attempt is over; the task then ends
    without failing its Spark stage, so the attempt's record still reaches the driver."""

    reason: str

    def encode(self) -> dict[str, Any]:
        return {"do": "stop", "reason": self.reason}

    @staticmethod
    def asked(frame: dict[str, Any] | None) -> bool:
        return frame is not None and frame.get("do") == "stop"


@dataclass(frozen=True)
class GoAhead:
    """The driver's reply to :class:`Gang`: run as ``attempt``, or stop for ``reason``."""

    go: bool
    attempt: int | None = None
    reason: str | None = None

    def encode(self) -> dict[str, Any]:
        if self.go:
            return {"go": True, "attempt": self.attempt}
        return {"go": False, "reason": self.reason}

    @classmethod
    def decode(cls, frame: dict[str, Any] | None) -> GoAhead:
        if not frame or frame.get("go") is not True:
            return cls(False, reason=str((frame or {}).get("reason", "no reply")))
        return cls(True, attempt=_int(frame, "attempt"))


@dataclass(frozen=True)
class Envelope:
    """A task's message with the rank and attempt it comes from."""

    rank: int
    attempt: int
    message: TaskMessage


def encode(message: TaskMessage, *, rank: int, attempt: int) -> dict[str, Any]:
    return {"t": message.kind, "r": rank, "a": attempt, **message.fields()}


def decode(frame: dict[str, Any]) -> Envelope:
    """The typed message in ``frame``; ChannelError when it is not one."""
    kind = frame.get("t")
    rank, attempt = _int(frame, "r"), _int(frame, "a")
    message: TaskMessage
    if kind == "hello":
        message = Hello(str(frame.get("host", "?")), _int(frame, "task_pid"), _int(frame, "tid"),
                        _opt_str(frame, "unshared"))
    elif kind == "gang":
        tids = frame.get("tids")
        if not isinstance(tids, list):
            raise ChannelError("malformed 'gang' message: no list of task ids")
        message = Gang(tuple(sorted(_as_int(t, "tids") for t in tids)))
    elif kind == "started":
        message = Started(_int(frame, "pid"))
    elif kind == "exit":
        message = Exited(_opt_int(frame, "code"), _opt_int(frame, "signal"), _opt_str(frame, "error"),
                         _opt_str(frame, "traceback"), _opt_float(frame, "at"))
    elif kind == "stacks":
        message = Stacks(_opt_int(frame, "pid"), _opt_str(frame, "text"))
    elif kind == "log":
        message = LogLine(str(frame.get("s", "o")), str(frame.get("l", "")), bool(frame.get("more")))
    elif kind == "logs":
        texts = frame.get("ls")
        if not isinstance(texts, list):
            raise ChannelError("malformed 'logs' message: no list of lines")
        message = LogLines(str(frame.get("s", "o")), tuple(str(t) for t in texts))
    elif kind == "metric":
        record = frame.get("m")
        if not isinstance(record, dict):
            raise ChannelError("malformed 'metric' message: no record")
        message = Metric(record)
    else:
        raise ChannelError(f"unknown message kind {kind!r}")
    return Envelope(rank, attempt, message)


def _as_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ChannelError(f"malformed message: {key!r} is not an integer ({value!r})")
    return value


def _int(frame: dict[str, Any], key: str) -> int:
    return _as_int(frame.get(key), key)


def _opt_int(frame: dict[str, Any], key: str) -> int | None:
    value = frame.get(key)
    return None if value is None else _as_int(value, key)


def _opt_float(frame: dict[str, Any], key: str) -> float | None:
    value = frame.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ChannelError(f"malformed message: {key!r} is not a number ({value!r})")
    return float(value)


def _opt_str(frame: dict[str, Any], key: str) -> str | None:
    value = frame.get(key)
    return None if value is None else str(value)
