"""What each rank's task tells the rest of its gang through ``BarrierTaskContext.allGather``
(:class:`Member`): written by the lane (``Lane.member``), read by every lane of the gang."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Member:
    """One rank, as the gang learns it.

    ``host``: the task's address; ``port``: rank 0's TCPStore port (None for the others);
    ``tid``: the Spark task attempt id (the driver numbers attempts by them); ``direct``: the task
    reached the driver (else the gang reports through the hub); ``hub``: the hub's port, in task 0
    when it runs one; ``unshared``: why this task cannot see the checkpoint directory, if it cannot;
    ``backend``: what the backend's part holds (``TaskPart.member``).
    """

    host: str
    port: int | None
    tid: int
    direct: bool
    hub: int | None = None
    unshared: str | None = None
    backend: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def encode(members: list[Member]) -> str:
        """One task's members, as ``allGather`` carries them."""
        return json.dumps([asdict(m) for m in members])

    @staticmethod
    def decode_all(gathered: list[str]) -> list[Member]:
        """Every task's members, in rank order. ValueError when one is not a member's record."""
        out = []
        for text in gathered:
            for raw in json.loads(text):
                if not isinstance(raw, dict) or set(raw) != {f for f in Member.__dataclass_fields__}:
                    raise ValueError(f"not a gang member's record: {str(raw)[:200]}")
                member = Member(**raw)
                if not (isinstance(member.host, str) and isinstance(member.tid, int) and isinstance(member.direct, bool)
                        and isinstance(member.backend, dict)):
                    raise ValueError(f"not a gang member's record: {str(raw)[:200]}")
                out.append(member)
        return out
