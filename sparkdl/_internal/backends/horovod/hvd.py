"""Horovod, set up in the rank the way ``horovodrun`` would: with Gloo, or in an MPI job."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sparkdl._internal.backends.base import (
    Backend,
    JoinError,
    Joining,
    LocalJob,
    TaskPart,
    close_store,
)
from sparkdl._internal.backends.horovod.horovod_gloo import (
    check_horovod,
    horovod_env,
    start_rendezvous_server,
)
from sparkdl._internal.backends.horovod.horovod_mpi import check_mpi, mpi_env
from sparkdl._internal.backends.horovod.mpi import Endpoint, Mpirun, join_job, join_local
from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.wire.rankspec import GangSpec, RankSpec, read_fd


class HorovodBackend(Backend):
    """Horovod with its Gloo controller, set up the way ``horovodrun --gloo`` would.

    Rank 0 serves Horovod's rendezvous store on the socket the launcher bound to its task's own
    address (the store has no authentication, so it never listens on every interface, and it
    lives only as long as the rank). Every rank gets the ``HOROVOD_*`` environment, so user
    code calls ``hvd.init()``, ``hvd.DistributedOptimizer`` and ``hvd.broadcast_parameters``
    unchanged.

    With ``RunConfig(horovod_controller="mpi")`` the rank's environment already places it in the
    gang's MPI job (:mod:`sparkdl._internal.backends.horovod.mpi`); the backend only tells Horovod to use MPI.
    """

    name = "horovod"
    horovod_job = True

    def __init__(self) -> None:
        self._stop_server: Any = None

    def check_driver(self, config: RunConfig) -> None:
        check_horovod()
        if config.horovod_controller == "mpi":
            check_mpi()

    def task_part(self, config: RunConfig, rank: int, host: str, workdir: Path, secret: bytes) -> TaskPart:
        if config.horovod_controller != "mpi":
            return TaskPart()  # Gloo: rank 0 serves the rendezvous on the store's socket
        return MpiPart(Endpoint(host, secret, rank, workdir, handshake_timeout_s=config.handshake_timeout_s))

    def join_local(self, parts: Sequence[TaskPart], host: str, workdir: Path, secret: bytes, timeout_s: float,
                   log: Callable[[str], object]) -> tuple[list[dict[str, str] | None], LocalJob]:
        if not parts or not isinstance(parts[0], MpiPart):
            return super().join_local(parts, host, workdir, secret, timeout_s, log)
        # One Open MPI job of the local ranks, formed before they are told the gang.
        envs, mpirun = join_local([p.endpoint for p in parts if isinstance(p, MpiPart)], host, workdir, secret,
                                  timeout_s, log)
        return list(envs), MpirunJob(mpirun)

    def prepare_rank(self, workdir: Path) -> None:
        import torch.distributed  # noqa: F401

    def setup_rank(self, spec: RankSpec, gang: GangSpec, use_cuda: bool) -> None:
        import socket

        if spec.horovod_controller == "mpi":
            close_store()  # no rendezvous server: MPI's own runtime is the rendezvous
            os.environ.update(mpi_env(spec.rank, spec.collective_timeout_s))
            return
        hosts = list(gang.hosts)
        isolated = bool(spec.gpu_ids)
        port = gang.master_port
        if spec.rank == 0:
            store_fd = read_fd("store")
            if store_fd is None:
                raise RuntimeError("rank 0 was started without the store's socket (internal error)")
            listener = socket.socket(fileno=store_fd)
            port, self._stop_server = start_rendezvous_server(
                gang.master_addr, hosts, listener=listener, isolated_devices=isolated
            )
        os.environ.update(
            horovod_env(
                spec.rank,
                hosts,
                gang.master_addr,
                port,
                os.environ.get("GLOO_SOCKET_IFNAME"),
                timeout_s=spec.collective_timeout_s,
                isolated_devices=isolated,
            )
        )

    def teardown_rank(self) -> None:
        try:
            import horovod.torch as hvd

            if hvd.is_initialized():
                hvd.shutdown()
        finally:
            if self._stop_server is not None:
                self._stop_server()
                self._stop_server = None


class MpiPart(TaskPart):
    """A rank's part of the gang's Open MPI job, held by its task (:mod:`.mpi`): the endpoint
    mpirun's agent asks to start the rank's daemon, and in rank 0's task mpirun itself."""

    job = "the MPI job"

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.mpirun: Mpirun | None = None

    @property
    def lost(self) -> str | None:
        return self.endpoint.lost

    def member(self) -> dict[str, Any]:
        return {"mpi": self.endpoint.port}

    def join(self, joining: Joining) -> dict[str, str] | None:
        nodes = [(m["host"], m["mpi"]) for m in joining.members]
        try:
            env, self.mpirun = join_job(self.endpoint, joining.rank, nodes, joining.workdir, joining.secret,
                                        joining.host, joining.timeout_s, joining.log)
        except (RuntimeError, TimeoutError) as exc:
            raise JoinError(str(exc)) from exc
        return env

    def watch(self, kill: Callable[[str], None]) -> None:
        self.endpoint.watch(kill)

    def ended(self, code: int) -> None:
        self.endpoint.ended(code)

    def close(self, wait_s: float | None) -> None:
        # The job ends once every rank's process has; ending this part first would end the job
        # under ranks still running. A peer is waited for as long as in a collective.
        if wait_s is not None:
            (self.mpirun.wait if self.mpirun is not None else self.endpoint.wait_daemon)(wait_s)
        if self.mpirun is not None:
            self.mpirun.close()
        self.endpoint.close()


class MpirunJob(LocalJob):
    """The one mpirun of the ranks the driver owns."""

    def __init__(self, mpirun: Mpirun) -> None:
        self.mpirun = mpirun

    def close(self, wait_s: float | None) -> None:
        if wait_s is not None:
            self.mpirun.wait(wait_s)  # every rank's MPI part has ended by then
        self.mpirun.close()
