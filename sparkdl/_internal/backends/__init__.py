"""Distributed backends: each is one class that says, for every side of a run, what the backend
needs (:class:`Backend`); nothing outside this package branches on a backend's name.

- the driver: :meth:`Backend.check_driver`, before any Spark work;
- the Spark task: :meth:`Backend.task_part`, what the task holds for each of its ranks (a port,
  its part of an MPI job), what it tells the gang, and the environment a rank gets once the gang
  is known; on the driver, :meth:`Backend.join_local` forms the same of ranks it owns all of;
- the rank process: :meth:`Backend.prepare_rank` while the gang forms, :meth:`Backend.setup_rank`
  once it is known, :meth:`Backend.teardown_rank` after the user's function returned.

A backend is chosen by name (``run(..., backend=...)``, one of :data:`BACKENDS`); :func:`get_backend`
is the only way to get one, and it imports nothing heavy until a method is called. Adding a
backend is adding a class here and its name to :data:`BACKENDS`.
"""

from __future__ import annotations

from sparkdl._internal.backends.base import Backend
from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import ConfigError

BACKENDS = ("torch", "horovod", "tensorflow", "none")


def get_backend(name: str) -> Backend:
    """The backend called ``name``; ConfigError names the valid choices otherwise."""
    if name == "torch":
        from sparkdl._internal.backends.torchdist import TorchBackend

        return TorchBackend()
    if name == "horovod":
        from sparkdl._internal.backends.horovod.hvd import HorovodBackend

        return HorovodBackend()
    if name == "tensorflow":
        from sparkdl._internal.backends.tfdist import TensorflowBackend

        return TensorflowBackend()
    if name == "none":
        return Backend()
    raise ConfigError(f"backend={name!r} is unknown; choose one of {', '.join(map(repr, BACKENDS))}")


def check_driver(name: str, config: RunConfig) -> None:
    """Fails before any task starts when backend ``name`` with ``config`` cannot run here."""
    get_backend(name).check_driver(config)
