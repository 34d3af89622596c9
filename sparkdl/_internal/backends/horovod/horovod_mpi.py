"""Horovod with its MPI controller: what a rank and the driver check, and the rank's settings.

The MPI job itself is formed by the gang's tasks (:mod:`sparkdl._internal.backends.horovod.mpi`); by the time the
backend sets up a rank, the rank's environment already places it in that job. Nothing heavy is
imported at import time.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess

from sparkdl._internal.common.errors import BackendUnavailableError

_MPI_HINT = (
    "horovod_controller='mpi' needs Open MPI 4 (mpirun, orted) on the PATH of the driver and of every "
    "executor (Debian/Ubuntu: apt-get install openmpi-bin libopenmpi-dev) and Horovod built with MPI "
    "(`bash \"$(sparkdl conf build-horovod --path)\" VENV` does both); or use RunConfig(horovod_controller='gloo')"
)
# Horovod checks for stalled ranks this often at most (its own default).
_STALL_CHECK_S = 60


def open_mpi_version() -> str:
    """The version of the ``mpirun`` on the PATH; BackendUnavailableError if there is none or it is
    not Open MPI 4 (sparkdl's launcher drives Open MPI 4's daemon, ``orted``)."""
    mpirun = shutil.which("mpirun")
    if mpirun is None or shutil.which("orted") is None:
        raise BackendUnavailableError(f"no mpirun or orted on the PATH. {_MPI_HINT}")
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BackendUnavailableError(f"{mpirun} --version failed ({exc}). {_MPI_HINT}") from exc
    found = re.search(r"\(Open MPI\) (\d+)\.(\d+)\.(\d+)", out)
    if found is None or found[1] != "4":
        what = f"Open MPI {'.'.join(found.groups())}" if found else repr((out.strip().splitlines() or ["?"])[0])
        raise BackendUnavailableError(f"{mpirun} is {what}, not Open MPI 4. {_MPI_HINT}")
    return ".".join(found.groups())


def check_mpi() -> str:
    """``"Horovod <v>, Open MPI <v>"`` when Horovod's MPI controller can run here; else
    BackendUnavailableError saying what to install."""
    from sparkdl._internal.backends.horovod.horovod_gloo import check_horovod

    version = check_horovod()
    import horovod.torch as hvd

    if not hvd.mpi_built():
        raise BackendUnavailableError(f"Horovod {version} was built without MPI. {_MPI_HINT}")
    return f"Horovod {version}, Open MPI {open_mpi_version()}"


def mpi_env(rank: int, collective_timeout_s: float) -> dict[str, str]:
    """The ``HOROVOD_*`` variables of a rank whose environment places it in the MPI job as ``rank``.

    A rank stalled in a collective for ``collective_timeout_s`` makes Horovod shut down (its
    stall check), as Gloo's timeout does with the Gloo controller.
    """
    placed = os.environ.get("OMPI_COMM_WORLD_RANK")
    if placed != str(rank):
        raise RuntimeError(f"rank {rank} is not placed in an MPI job (OMPI_COMM_WORLD_RANK={placed!r}); "
                           "horovod_controller='mpi' ranks are started by sparkdl's launchers only")
    stall = max(1, math.ceil(collective_timeout_s))
    return {
        "HOROVOD_CONTROLLER": "mpi",
        "HOROVOD_CPU_OPERATIONS": "mpi",
        "HOROVOD_STALL_CHECK_TIME_SECONDS": str(min(_STALL_CHECK_S, stall)),
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(stall),
    }
