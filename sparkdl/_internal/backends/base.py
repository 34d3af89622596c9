"""What every backend is (:class:`Backend`, itself the backend with nothing to do: ``"none"``),
and what it holds in a Spark task for a rank (:class:`TaskPart`); see :mod:`sparkdl._internal.backends`."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.wire.rankspec import GangSpec, RankSpec, read_fd


class JoinError(RuntimeError):
    """A rank's task could not place the rank in the backend's job (the message says why, for the report)."""


@dataclass(frozen=True)
class Joining:
    """What a task part needs to place its rank once the gang is known: ``members`` is what every
    rank's part told the gang (:meth:`TaskPart.member`, with the rank's ``host``), in rank order."""

    rank: int
    host: str
    members: Sequence[Mapping[str, Any]]
    workdir: Path
    secret: bytes
    timeout_s: float
    log: Callable[[str], object]


class TaskPart:
    """What a backend holds in a Spark task (or, on the driver, in the launcher) for one rank,
    from the rank's start to its end. This one holds nothing."""

    job = "the backend's job"
    """What :meth:`join` places the rank in, for messages."""

    @property
    def lost(self) -> str | None:
        """Why the backend's job ended the rank, when it did (for the report)."""
        return None

    def member(self) -> dict[str, Any]:
        """What the other ranks' parts learn of this one (JSON)."""
        return {}

    def join(self, joining: Joining) -> dict[str, str] | None:
        """Once the gang is known: the variables the rank's environment gets (None: none).
        Raises JoinError when the rank cannot be placed."""
        return None

    def watch(self, kill: Callable[[str], None]) -> None:
        """Once the rank runs: ``kill(why)`` ends it when the backend's job ends under it."""

    def ended(self, code: int) -> None:
        """The rank ended with ``code`` (negative: a signal): passed on to the backend's job."""

    def close(self, wait_s: float | None) -> None:
        """Frees what the part holds; first, with ``wait_s``, waits that long at most for the
        backend's job to end by itself (the rank succeeded)."""


def close_store() -> None:
    """Closes the store's socket the launcher handed rank 0, for a backend that serves no store."""
    store = read_fd("store")
    if store is not None:
        os.close(store)


class LocalJob:
    """The backend's job of ranks that one process owns (:meth:`Backend.join_local`); this one is none."""

    def close(self, wait_s: float | None) -> None:
        """Ends the job, after waiting ``wait_s`` at most for it to end by itself (None: no wait)."""


class Backend:
    """A backend with nothing to check, reserve or set up: ``backend="none"``, for data-only
    jobs (each rank reads its shard and returns; no process group, no collectives). The other
    backends override what they need."""

    name = "none"
    several_ranks_per_task = False
    """Whether a Spark task may run several of its ranks (``RunConfig.processes_per_task``)."""
    device_is_torchs = True
    """Whether the rank's GPU is torch's to use (``cuda:LOCAL_RANK``); False: the framework's own."""
    horovod_job = False
    """Whether the gang's ranks form one Horovod job (``hvd.init()`` in a rank joins it)."""

    def check_driver(self, config: RunConfig) -> None:
        """Fails before any task starts when the backend cannot run with ``config``:
        BackendUnavailableError (with what to install) or ConfigError (naming the setting)."""
        if config.horovod_controller != "gloo":
            raise ConfigError(
                f"RunConfig.horovod_controller={config.horovod_controller!r} applies to backend='horovod' "
                f"only, not to backend={self.name!r}; leave it at 'gloo' or choose backend='horovod'"
            )

    def task_part(self, config: RunConfig, rank: int, host: str, workdir: Path, secret: bytes) -> TaskPart:
        """What a task holds for its rank ``rank`` on ``host``, made when the rank starts."""
        return TaskPart()

    def join_local(self, parts: Sequence[TaskPart], host: str, workdir: Path, secret: bytes, timeout_s: float,
                   log: Callable[[str], object]) -> tuple[list[dict[str, str] | None], LocalJob]:
        """Ranks that one process owns (on the driver), all on ``host``: each rank's variables,
        and the job to close at the end. Raises JoinError."""
        members = [{"host": host, **p.member()} for p in parts]
        envs = [p.join(Joining(r, host, members, workdir, secret, timeout_s, log)) for r, p in enumerate(parts)]
        return envs, LocalJob()

    def prepare_rank(self, workdir: Path) -> None:
        """In the rank process, while the gang forms: what the backend's imports need first, and
        the imports themselves (the rank then waits for the gang without them)."""

    def setup_rank(self, spec: RankSpec, gang: GangSpec, use_cuda: bool) -> None:
        """Prepares the rank process before the user's function is unpickled and called.

        ``use_cuda``: the rank runs on ``cuda:LOCAL_RANK`` (``cuda:0`` with one rank per task),
        which the rank process has already made the current device.
        """
        close_store()  # rank 0's TCPStore socket: nothing here listens on it

    def teardown_rank(self) -> None:
        """Releases what setup_rank created; called after the user's function returns."""
