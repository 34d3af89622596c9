"""torch.distributed: gloo on CPU, NCCL (with gloo for CPU tensors) on GPU.

Rank 0 hosts the TCPStore of the gang, on a socket the launcher bound to the task's own address,
and ``init_process_group()`` from the environment joins it. The backend then creates the default
process group, unless the run's config says not to.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

from sparkdl._internal.backends.base import Backend
from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import BackendUnavailableError, ConfigError
from sparkdl._internal.wire.rankspec import GangSpec, RankSpec, read_fd


class TorchBackend(Backend):
    """torch.distributed: gloo on CPU, NCCL (with gloo for CPU tensors) on GPU; the one backend
    whose tasks may run several ranks each (``RunConfig.processes_per_task``)."""

    name = "torch"
    several_ranks_per_task = True

    def __init__(self) -> None:
        self._store: Any = None

    def check_driver(self, config: RunConfig) -> None:
        super().check_driver(config)
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

    def prepare_rank(self, workdir: Path) -> None:
        import torch.distributed  # noqa: F401

    def setup_rank(self, spec: RankSpec, gang: GangSpec, use_cuda: bool) -> None:
        import torch.distributed as dist

        timeout = timedelta(seconds=spec.collective_timeout_s)
        if spec.rank == 0:
            store_fd = read_fd("store")
            if store_fd is None:
                raise RuntimeError("rank 0 was started without the store's socket (internal error)")
            # The launcher bound this socket to the task's own address: the store, which has no
            # authentication, never listens on every interface and never races for a port.
            self._store = dist.TCPStore(
                gang.master_addr,
                gang.master_port,
                spec.world_size,
                is_master=True,
                timeout=timeout,
                wait_for_workers=False,
                master_listen_fd=store_fd,
            )
        # init_process_group() from the environment then connects to that store as a client.
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        _install_init_hook(timeout, use_cuda)
        if spec.world_size > 1:
            _refuse_horovod_init(spec.world_size)
        if spec.init_process_group:
            backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
            _ORIGINAL_INIT[0](backend=backend, timeout=timeout)
            _all_ranks_connected(use_cuda)

    def teardown_rank(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None


_ORIGINAL_INIT: list[Any] = []


def _install_init_hook(default_timeout: timedelta, use_cuda: bool) -> None:
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
        _all_ranks_connected(use_cuda)
        return None

    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group


_HOROVOD_BASICS = "horovod.common.basics"


def _refuse_horovod_init(world_size: int) -> None:
    """Makes Horovod's ``init()`` (``hvd.init()`` of any framework) raise a ConfigError naming
    ``backend='horovod'``: under this backend it finds no Horovod job of the gang's ranks and
    would run one of its own, of one process, in every rank, each training alone on its data.

    Horovod is patched when (if ever) the rank imports it; nothing is imported here."""

    def refuse(module: ModuleType) -> None:
        def init(*args: Any, **kwargs: Any) -> None:
            raise ConfigError(
                f"Horovod's init() was called under backend='torch': each of the {world_size} ranks "
                "would run a Horovod job of its own, of one process. Run this code with backend='horovod' "
                "(sparkdl.run(..., backend='horovod'), sparkdl run --backend horovod, HorovodRunner), "
                "which makes the ranks one Horovod job; or use torch.distributed (sparkdl.context())"
            )

        module.HorovodBasics.init = init

    if _HOROVOD_BASICS in sys.modules:
        refuse(sys.modules[_HOROVOD_BASICS])
        return

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
            if name != _HOROVOD_BASICS:
                return None
            sys.meta_path.remove(self)  # the real spec, found by the other finders; once
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            execute = spec.loader.exec_module

            def exec_module(module: ModuleType) -> None:
                execute(module)
                refuse(module)

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, Finder())


def _all_ranks_connected(use_cuda: bool) -> None:
    """Returns once every rank has finished creating the process group.

    Rank 0 serves the rendezvous store, and Gloo's full-mesh connect can leave rank 0 done while
    a peer still reads its last keys. Without this barrier, a bug that makes rank 0 raise at once
    kills the store under that peer, which then fails with a connection error instead of the
    same exception: the run reports a misleading cause and reruns a bug that every rank shares.
    """
    import torch
    import torch.distributed as dist

    if use_cuda and "nccl" in str(dist.get_backend()):
        # NCCL's barrier otherwise guesses the device from the rank number.
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()
