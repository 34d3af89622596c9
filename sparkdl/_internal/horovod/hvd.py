"""Horovod, set up in the rank the way ``horovodrun`` would: with Gloo, or in an MPI job."""

from __future__ import annotations

import os
from typing import Any

from sparkdl._internal.horovod.horovod_gloo import (
    check_horovod,
    horovod_env,
    start_rendezvous_server,
)
from sparkdl._internal.horovod.horovod_mpi import mpi_env
from sparkdl._internal.wire.rankspec import GangSpec, RankSpec, read_fd


class HorovodBackend:
    """Horovod with its Gloo controller, set up the way ``horovodrun --gloo`` would.

    Rank 0 serves Horovod's rendezvous store on the socket the launcher bound to its task's own
    address (the store has no authentication, so it never listens on every interface, and it
    lives only as long as the rank). Every rank gets the ``HOROVOD_*`` environment, so user
    code calls ``hvd.init()``, ``hvd.DistributedOptimizer`` and ``hvd.broadcast_parameters``
    unchanged.

    With ``RunConfig(horovod_controller="mpi")`` the rank's environment already places it in the
    gang's MPI job (:mod:`sparkdl._internal.horovod.mpi`); the backend only tells Horovod to use MPI.
    """

    name = "horovod"

    def __init__(self) -> None:
        self._stop_server: Any = None

    def check_driver(self) -> None:
        check_horovod()

    def setup_rank(self, spec: RankSpec, gang: GangSpec, use_cuda: bool) -> None:
        import socket

        if spec.horovod_controller == "mpi":
            store_fd = read_fd("store")
            if store_fd is not None:
                os.close(store_fd)  # no rendezvous server: MPI's own runtime is the rendezvous
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
