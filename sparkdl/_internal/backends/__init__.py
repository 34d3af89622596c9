"""Distributed backends: what each needs on the driver (a check) and in the rank process (setup).

A backend is chosen by name (``run(..., backend="torch"|"horovod"|"tensorflow")``); :func:`get_backend` is the
only way to get one, and it imports nothing heavy until a method is called.
"""

from __future__ import annotations

from typing import Protocol

from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.wire.rankspec import GangSpec, RankSpec


class Backend(Protocol):
    name: str

    def check_driver(self) -> None:
        """Raises BackendUnavailableError, with install instructions, when it cannot run."""

    def setup_rank(self, spec: RankSpec, gang: GangSpec, use_cuda: bool) -> None:
        """Prepares the rank process before the user's function is unpickled and called.

        ``use_cuda``: the rank runs on ``cuda:LOCAL_RANK`` (``cuda:0`` with one rank per task),
        which the rank process has already made the current device.
        """

    def teardown_rank(self) -> None:
        """Releases what setup_rank created; called after the user's function returns."""


BACKENDS = ("torch", "horovod", "tensorflow")


def check_driver(name: str, config: RunConfig) -> None:
    """Fails before any task starts when backend ``name`` with ``config`` cannot run here."""
    get_backend(name).check_driver()
    if config.horovod_controller != "gloo":
        if name != "horovod":
            raise ConfigError(
                f"RunConfig.horovod_controller={config.horovod_controller!r} applies to backend='horovod' "
                f"only, not to backend={name!r}; leave it at 'gloo' or choose backend='horovod'"
            )
        from sparkdl._internal.horovod.horovod_mpi import check_mpi

        check_mpi()


def get_backend(name: str) -> Backend:
    """The backend called ``name``; ConfigError names the valid choices otherwise."""
    if name == "torch":
        from sparkdl._internal.backends.torchdist import TorchBackend

        return TorchBackend()
    if name == "horovod":
        from sparkdl._internal.horovod.hvd import HorovodBackend

        return HorovodBackend()
    if name == "tensorflow":
        from sparkdl._internal.backends.tfdist import TensorflowBackend

        return TensorflowBackend()
    raise ConfigError(f"backend={name!r} is unknown; choose one of {', '.join(map(repr, BACKENDS))}")
