"""TensorFlow on the gang: ``tf.distribute.MultiWorkerMirroredStrategy`` across the ranks.

Each rank is one worker of the strategy. Its ``TF_CONFIG`` is built from the gang: every
worker's address is its task's own address (never a wildcard) and a port its task reserved
(:func:`reserve_port`), and its index is its rank, so that ``MultiWorkerMirroredStrategy()`` in
the user's function forms one cluster of the gang's ranks, and a Keras ``model.fit`` under the
strategy trains on all of them.

Keras: TensorFlow 2.16+ ships Keras 3, whose ``model.fit`` does not run under
``MultiWorkerMirroredStrategy`` (keras-team/keras#20585: "Attempt to convert a value
(PerReplica...)"). Keras 2 does: with the ``tf-keras`` package installed the ranks start with
``TF_USE_LEGACY_KERAS=1`` (unless set already), which makes ``tf.keras`` Keras 2.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

from sparkdl._internal.backends.base import Backend, Joining, TaskPart, close_store
from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import BackendUnavailableError
from sparkdl._internal.wire.rankspec import GangSpec, RankSpec


def reserve_port(host: str) -> socket.socket:
    """A port on ``host`` for one rank's TensorFlow server, held for the rank's lifetime.

    The socket is bound with ``SO_REUSEADDR`` and never listens: TensorFlow's gRPC server (which
    sets ``SO_REUSEADDR`` too) binds the same port beside it, while a plain ``bind`` by any other
    process, and the kernel's choice of ports for outgoing connections, keep away from it.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
    except OSError:
        sock.close()
        raise
    return sock


def tf_config(endpoints: list[tuple[str, int]], rank: int) -> dict[str, str]:
    """The environment that places rank ``rank`` in the strategy's cluster of ``endpoints``."""
    workers = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in endpoints]
    config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}
    return {"TF_CONFIG": json.dumps(config)}


def prepare_rank_env(workdir: Path) -> None:
    """Set in a TensorFlow rank before TensorFlow is imported: Keras 2 for ``tf.keras`` when it
    is installed (see the module's description), TensorFlow's C++ INFO and WARNING lines off (every
    line a rank prints on stderr reaches the driver's console), and the rank's temporary files in
    its workdir, which goes with the rank: AutoGraph's generated modules are removed only by an
    exit handler, which a rank (ended by ``os._exit``) never runs."""
    tmp = workdir / "tmp"
    tmp.mkdir(exist_ok=True)
    tempfile.tempdir = str(tmp)
    if importlib.util.find_spec("tf_keras") is not None:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


class TensorflowBackend(Backend):
    """``backend="tensorflow"``: the rank's ``TF_CONFIG`` is in its environment before the
    user's function runs; the function creates the strategy (``MultiWorkerMirroredStrategy()``).
    Each rank's task holds its server's port (:class:`PortPart`); the GPUs are TensorFlow's."""

    name = "tensorflow"
    device_is_torchs = False

    def check_driver(self, config: RunConfig) -> None:
        super().check_driver(config)
        if importlib.util.find_spec("tensorflow") is None:
            raise BackendUnavailableError(
                "backend='tensorflow' needs TensorFlow in the driver's and the executors' Python, and it cannot "
                "be imported here: pip install 'sparkdl[tensorflow]' (or tensorflow-cpu and tf-keras on "
                "machines without GPUs)"
            )

    def task_part(self, config: RunConfig, rank: int, host: str, workdir: Path, secret: bytes) -> TaskPart:
        return PortPart(host)

    def prepare_rank(self, workdir: Path) -> None:
        prepare_rank_env(workdir)
        import tensorflow  # noqa: F401

    def setup_rank(self, spec: RankSpec, gang: GangSpec, use_cuda: bool) -> None:
        close_store()  # torch's store socket: TensorFlow's workers meet through TF_CONFIG
        if spec.world_size > 1 and "TF_CONFIG" not in os.environ:
            raise RuntimeError("the TensorFlow rank was started without TF_CONFIG (internal error)")

    def teardown_rank(self) -> None:
        pass


class PortPart(TaskPart):
    """A TensorFlow rank's port, reserved by its task (:func:`reserve_port`) until the rank ends;
    the rank's ``TF_CONFIG`` names every rank's host and port."""

    def __init__(self, host: str) -> None:
        self._sock = reserve_port(host)

    def member(self) -> dict[str, Any]:
        return {"port": self._sock.getsockname()[1]}

    def join(self, joining: Joining) -> dict[str, str] | None:
        return tf_config([(m["host"], m["port"]) for m in joining.members], joining.rank)

    def close(self, wait_s: float | None) -> None:
        self._sock.close()
