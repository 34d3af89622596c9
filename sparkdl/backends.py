"""Distributed backends: what each needs on the driver (a check) and in the rank process (setup).

The torch backend hosts the TCPStore of the gang on rank 0, on a socket the launcher bound to
the task's own address, and makes ``init_process_group()`` from the environment join it. It then
creates the default process group, unless the run's config says not to.
"""

from __future__ import annotations

import functools
import os
import sys
from datetime import timedelta
from typing import Any, Protocol

from sparkdl.errors import BackendUnavailableError, ConfigError


class Backend(Protocol):
    name: str

    def check_driver(self) -> None:
        """Raises BackendUnavailableError, with install instructions, when it cannot run."""

    def setup_rank(self) -> None:
        """Prepares the rank process before the user's function is unpickled and called."""

    def teardown_rank(self) -> None:
        """Releases what setup_rank created; called after the user's function returns."""


class TorchBackend:
    """torch.distributed: gloo on CPU, NCCL (with gloo for CPU tensors) on GPU."""

    name = "torch"

    def __init__(self) -> None:
        self._store: Any = None

    def check_driver(self) -> None:
        try:
            import torch.distributed as dist
        except ImportError as exc:
            raise BackendUnavailableError(
                f"backend='torch' needs PyTorch, which cannot be imported here ({exc}). "
                "Install it, e.g. pip install torch==2.13.0"
            ) from exc
        if not dist.is_available():
            raise BackendUnavailableError(
                "backend='torch' needs torch.distributed, but this torch build has none; "
                "install an official torch build"
            )

    def setup_rank(self) -> None:
        import torch
        import torch.distributed as dist

        env = os.environ
        rank = int(env["RANK"])
        world_size = int(env["WORLD_SIZE"])
        timeout = timedelta(seconds=float(env["SPARKDL_COLLECTIVE_TIMEOUT_S"]))
        if rank == 0:
            # The launcher bound this socket to the task's own address: the store, which has no
            # authentication, never listens on every interface and never races for a port.
            self._store = dist.TCPStore(
                env["MASTER_ADDR"],
                int(env["MASTER_PORT"]),
                world_size,
                is_master=True,
                timeout=timeout,
                wait_for_workers=False,
                master_listen_fd=int(env["SPARKDL_STORE_FD"]),
            )
        # init_process_group() from the environment then connects to that store as a client.
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        use_cuda = bool(env.get("SPARKDL_GPU_IDS")) and torch.cuda.is_available()
        if env.get("SPARKDL_GPU_IDS") and not use_cuda:
            print(
                f"sparkdl: Spark assigned GPU(s) {env['SPARKDL_GPU_IDS']} to this rank, but "
                "torch.cuda.is_available() is False (a CPU build of torch?); running on the CPU",
                file=sys.stderr,
            )
        # sparkdl.context().device reads this, here and in processes this rank starts.
        env["SPARKDL_USE_CUDA"] = "1" if use_cuda else "0"
        if use_cuda:
            torch.cuda.set_device(0)
        _install_init_hook(timeout)
        if env.get("SPARKDL_INIT_PROCESS_GROUP") == "1":
            backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
            _ORIGINAL_INIT[0](backend=backend, timeout=timeout)
            _all_ranks_connected()

    def teardown_rank(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None


_ORIGINAL_INIT: list[Any] = []


def _install_init_hook(default_timeout: timedelta) -> None:
    """Makes the user's own ``dist.init_process_group(...)`` work alongside sparkdl's group.

    Code written for torchrun calls ``init_process_group`` itself. When sparkdl already created
    the default group, the call is accepted and reuses it (a timeout it passes is applied);
    otherwise the call goes through, with the run's collective timeout as its default.
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if _ORIGINAL_INIT:
        return
    original = c10d.init_process_group
    _ORIGINAL_INIT.append(original)

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        timeout = args[2] if len(args) > 2 else kwargs.get("timeout")
        if dist.is_initialized():
            if timeout is not None and hasattr(c10d, "_set_pg_timeout"):
                c10d._set_pg_timeout(timeout)
            return None
        if timeout is None and len(args) <= 2:
            kwargs["timeout"] = default_timeout
        original(*args, **kwargs)
        _all_ranks_connected()
        return None

    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group


def _all_ranks_connected() -> None:
    """Returns once every rank has finished creating the process group.

    Rank 0 serves the rendezvous store, and Gloo's full-mesh connect can leave rank 0 done while
    a peer still reads its last keys. Without this barrier, a bug that makes rank 0 raise at once
    kills the store under that peer, which then fails with a connection error instead of the
    same exception: the run reports a misleading cause and reruns a bug that every rank shares.
    """
    import torch
    import torch.distributed as dist

    if os.environ.get("SPARKDL_USE_CUDA") == "1" and "nccl" in str(dist.get_backend()):
        # NCCL's barrier otherwise guesses the device from the rank number.
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


class HorovodBackend:
    """Horovod with its Gloo controller, set up the way ``horovodrun --gloo`` would.

    Rank 0 serves Horovod's rendezvous store on the socket the launcher bound to its task's own
    address (the store has no authentication, so it never listens on every interface, and it
    lives only as long as the rank). Every rank gets the ``HOROVOD_*`` environment, so user
    code calls ``hvd.init()``, ``hvd.DistributedOptimizer`` and ``hvd.broadcast_parameters``
    unchanged.
    """

    name = "horovod"

    def __init__(self) -> None:
        self._stop_server: Any = None

    def check_driver(self) -> None:
        from sparkdl._horovod import check_horovod

        check_horovod()

    def setup_rank(self) -> None:
        import socket

        import torch

        from sparkdl._horovod import horovod_env, start_rendezvous_server

        env = os.environ
        rank = int(env["RANK"])
        hosts = env["SPARKDL_HOSTS"].split(",")
        gpu_ids = env.get("SPARKDL_GPU_IDS", "")
        use_cuda = bool(gpu_ids) and torch.cuda.is_available()
        env["SPARKDL_USE_CUDA"] = "1" if use_cuda else "0"
        if use_cuda:
            torch.cuda.set_device(0)
        isolated = bool(gpu_ids)
        port = int(env["MASTER_PORT"])
        if rank == 0:
            listener = socket.socket(fileno=int(env["SPARKDL_STORE_FD"]))
            port, self._stop_server = start_rendezvous_server(
                env["MASTER_ADDR"], hosts, listener=listener, isolated_devices=isolated
            )
        env.update(
            horovod_env(
                rank,
                hosts,
                env["MASTER_ADDR"],
                port,
                env.get("GLOO_SOCKET_IFNAME"),
                timeout_s=float(env["SPARKDL_COLLECTIVE_TIMEOUT_S"]),
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


BACKENDS = ("torch", "horovod")


def get_backend(name: str) -> Backend:
    """The backend called ``name``; ConfigError names the valid choices otherwise."""
    if name == "torch":
        return TorchBackend()
    if name == "horovod":
        return HorovodBackend()
    raise ConfigError(f"backend={name!r} is unknown; choose one of {', '.join(map(repr, BACKENDS))}")
