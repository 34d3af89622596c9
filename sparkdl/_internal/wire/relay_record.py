"""The relay hub's record of an attempt: the contract between the hub, which runs in task 0 when
the executors cannot reach the driver (:mod:`sparkdl._internal.driver.relay`), and the driver that
replays it. The hub writes it (:meth:`Body.signed`); the record travels as result rows of the
job (:mod:`sparkdl._internal.wire.result_chunks`); the driver reads it (:func:`Body.verified`),
refusing any that the run's secret did not sign. What task 0 holds of the hub is
:class:`RelayHub`, made by the :class:`HubFactory` the driver ships in the task's payload.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any, Protocol

from sparkdl._internal.common.errors import SparkDLError
from sparkdl._internal.wire.rankspec import RunSpec

_DOMAIN = b"sparkdl-relay-record\n"
# The event index that marks when the hub stopped the attempt, among the ranks' messages.
STOP_EVENT = -1


@dataclass(frozen=True)
class Record:
    """What the hub hands task 0 at the attempt's end: whether every rank succeeded, and the signed body."""

    succeeded: bool
    blob: bytes


@dataclass(frozen=True)
class Body:
    """The attempt as the hub saw it: every connection's frames in order (``events``: (connection
    index, frame, or None when it closed; index :data:`STOP_EVENT`: the hub stopped the attempt)),
    the stacks it gathered, why it stopped, and what it dropped over its bounds."""

    run: str
    first_attempt: int
    events: list[tuple[int, dict[str, Any] | None]]
    stacks: list[tuple[int, int, str, str | None]]  # (attempt, rank, text, when it was taken)
    stop: str | None = None
    timed_out: bool = False
    dropped_lines: int = 0
    dropped_metrics: int = 0

    def signed(self, secret: bytes) -> bytes:
        # The fields as they are: asdict() would deep-copy every frame (up to 80 MiB) to serialize it.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        body = json.dumps(fields, separators=(",", ":")).encode()
        return _tag(secret, body) + body

    @classmethod
    def verified(cls, secret: bytes, blob: bytes) -> Body:
        """The body of ``blob`` if its signature is the run's; SparkDLError otherwise."""
        tag, raw = blob[:32], blob[32:]
        if len(blob) < 32 or not hmac.compare_digest(tag, _tag(secret, raw)):
            raise SparkDLError(
                "the ranks' relayed record (their output and ends, returned through Spark because the executors "
                "cannot reach this driver) failed authentication: it was not written by this run's tasks"
            )
        fields = json.loads(raw)
        try:
            return cls(run=str(fields["run"]), first_attempt=int(fields["first_attempt"]),
                       events=[(int(i), f) for i, f in fields.get("events", [])],
                       stacks=[(int(a), int(r), str(t), None if w is None else str(w)) for a, r, t, w in fields.get("stacks", [])],
                       stop=fields.get("stop"), timed_out=bool(fields.get("timed_out")),
                       dropped_lines=int(fields.get("dropped_lines", 0)),
                       dropped_metrics=int(fields.get("dropped_metrics", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise SparkDLError(f"the ranks' relayed record is malformed ({exc!r}; internal error)") from exc


def _tag(secret: bytes, body: bytes) -> bytes:
    return hmac.new(secret, _DOMAIN + body, hashlib.sha256).digest()


class RelayHub(Protocol):
    """The hub as task 0 holds it: its port (told to the gang), its record, its end."""

    port: int

    def finish(self) -> Record: ...

    def close(self) -> None: ...


class HubFactory(Protocol):
    """What the driver ships for task 0 to start the hub with (``TaskPayload.hub``)."""

    def __call__(self, host: str, secret: bytes, run: RunSpec, first_attempt: int) -> RelayHub: ...
