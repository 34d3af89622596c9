"""What a rank is told, in one frozen description, and the one place it meets the environment.

A rank learns its place in two steps. At start, before its gang has formed, it is told the run
(id, world size, backend, settings) and its own place (rank, host, GPUs): :class:`RankSpec`.
Once every task of the gang has checked in, it is told the gang (attempt, hosts, master port,
local rank): :class:`GangSpec`. The rank process then decides its device once
(:func:`device_env`).

All of it travels as environment variables, because that is what reaches threads, forked
processes and DataLoader workers of the rank alike, and what torch's own ``init_process_group``
reads (``MASTER_ADDR``, ``RANK``, ...). This module is the only code that writes or reads them:
everything else holds a :class:`RankSpec` and a :class:`GangSpec`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import NotInRunError
from sparkdl._internal.fs.storage import redact
from sparkdl._internal.wire.trial import TrialSpec

PREFIX = "SPARKDL_"
# Descriptors a rank inherits; the environment names their numbers as SPARKDL_<NAME>_FD.
FD_NAMES = ("lifeline", "control", "metrics", "store")


@dataclass(frozen=True)
class RunSpec:
    """What every rank of one run is told: built once on the driver, shipped to every task."""

    run_id: str
    world_size: int
    backend: str
    use_gpu: bool
    checkpoint_url: str
    config: RunConfig
    # The trial this run is, in a search (sparkdl.tune); None for a plain run.
    trial: TrialSpec | None = None

    @property
    def tasks(self) -> int:
        """The gang's Spark tasks: ``world_size`` ranks, ``config.processes_per_task`` in each."""
        return self.world_size // self.config.processes_per_task


@dataclass(frozen=True)
class RankSpec:
    """One rank's place in its run, known when its process starts."""

    run_id: str
    rank: int
    world_size: int
    host: str
    backend: str
    gpu_ids: tuple[str, ...] = ()
    task_pid: int | None = None
    collective_timeout_s: float = RunConfig.collective_timeout_s
    init_process_group: bool = True
    checkpoint_url: str | None = None
    keep_checkpoints: int = RunConfig.keep_checkpoints
    checkpoint_sync: bool = RunConfig.checkpoint_sync
    checkpoint_finite_only: bool = RunConfig.checkpoint_finite_only
    horovod_controller: str = RunConfig.horovod_controller
    # The ranks of this rank's Spark task (RunConfig.processes_per_task); this one is rank % it.
    processes_per_task: int = 1
    trial: TrialSpec | None = None

    @classmethod
    def of(cls, run: RunSpec, *, rank: int, host: str, gpu_ids: list[str], task_pid: int) -> RankSpec:
        return cls(
            run_id=run.run_id,
            rank=rank,
            world_size=run.world_size,
            host=host,
            backend=run.backend,
            gpu_ids=tuple(gpu_ids),
            task_pid=task_pid,
            collective_timeout_s=run.config.collective_timeout_s,
            init_process_group=run.config.init_process_group,
            checkpoint_url=run.checkpoint_url,
            keep_checkpoints=run.config.keep_checkpoints,
            checkpoint_sync=run.config.checkpoint_sync,
            checkpoint_finite_only=run.config.checkpoint_finite_only,
            horovod_controller=run.config.horovod_controller,
            processes_per_task=run.config.processes_per_task,
            trial=run.trial,
        )


@dataclass(frozen=True)
class GangSpec:
    """What a rank learns once its gang has formed."""

    attempt: int
    hosts: tuple[str, ...]
    master_port: int
    local_rank: int
    local_world_size: int
    # Why the run's checkpoint directory must not be written: a host of the gang does not see
    # the driver's marker in it (sparkdl._internal.spark.reach); None when every host does, or nobody looked.
    checkpoints_refused: str | None = None

    @property
    def master_addr(self) -> str:
        return self.hosts[0]

    @classmethod
    def form(cls, spec: RankSpec, *, attempt: int, hosts: list[str], master_port: int,
             checkpoints_refused: str | None = None) -> GangSpec:
        if spec.gpu_ids:
            # Each rank sees exactly its task's GPUs (CUDA_VISIBLE_DEVICES), so in torchrun's terms
            # every task is a node of processes_per_task processes (--nproc_per_node): LOCAL_RANK
            # numbers the ranks of the task, each one's device is cuda:LOCAL_RANK (with one rank
            # per task: cuda:0, and a rank given several GPUs sees them as cuda:0, cuda:1, ...). A
            # host-wide LOCAL_RANK would send set_device(LOCAL_RANK) to a GPU the rank cannot see.
            local_rank, local_world = spec.rank % spec.processes_per_task, spec.processes_per_task
        else:
            local_rank, local_world = hosts[: spec.rank].count(spec.host), hosts.count(spec.host)
        return cls(attempt, tuple(hosts), master_port, local_rank, local_world, checkpoints_refused)


CHECKPOINT_URL_FILE = "checkpoint_url"
"""In the rank's private workdir: the checkpoint URL, where it holds a password (see :func:`rank_env`)."""


def rank_env(spec: RankSpec, workdir: Path | None = None) -> dict[str, str]:
    """The variables a rank process starts with (added to the task's own environment).

    A checkpoint URL with a password is given redacted: the environment is what the user's code,
    every program it starts and the failure report's context show. With ``workdir`` (the rank's
    private directory, where :func:`write_secrets` put it), the rank reads the whole URL there."""
    env = {
        # Set before torch starts, so the rank sees exactly the GPUs Spark assigned to its task.
        "CUDA_VISIBLE_DEVICES": ",".join(spec.gpu_ids),
        "PYTHONUNBUFFERED": "1",
        PREFIX + "RUN_ID": spec.run_id,
        PREFIX + "RANK": str(spec.rank),
        PREFIX + "WORLD_SIZE": str(spec.world_size),
        PREFIX + "HOST": spec.host,
        PREFIX + "BACKEND": spec.backend,
        PREFIX + "GPU_IDS": ",".join(spec.gpu_ids),
        PREFIX + "COLLECTIVE_TIMEOUT_S": str(spec.collective_timeout_s),
        PREFIX + "INIT_PROCESS_GROUP": "1" if spec.init_process_group else "0",
        PREFIX + "KEEP_CHECKPOINTS": str(spec.keep_checkpoints),
        PREFIX + "CHECKPOINT_SYNC": "1" if spec.checkpoint_sync else "0",
        PREFIX + "CHECKPOINT_FINITE_ONLY": "1" if spec.checkpoint_finite_only else "0",
        PREFIX + "HOROVOD_CONTROLLER": spec.horovod_controller,
        PREFIX + "PROCESSES_PER_TASK": str(spec.processes_per_task),
    }
    if spec.trial is not None:
        env.update(spec.trial.env())
    if spec.task_pid is not None:
        # The Python worker running this rank's Spark task (a forked rank's parent is the zygote).
        env[PREFIX + "TASK_PID"] = str(spec.task_pid)
    if spec.checkpoint_url:
        shown = redact(spec.checkpoint_url)
        env[PREFIX + "CHECKPOINT_DIR"] = shown
        if shown != spec.checkpoint_url and workdir is not None:
            env[PREFIX + "CHECKPOINT_URL_FILE"] = str(workdir / CHECKPOINT_URL_FILE)
        elif shown != spec.checkpoint_url:
            env[PREFIX + "CHECKPOINT_DIR"] = spec.checkpoint_url
    return env


def write_secrets(spec: RankSpec, workdir: Path) -> None:
    """Writes what :func:`rank_env` keeps out of the environment into the rank's private workdir (0600)."""
    if spec.checkpoint_url and redact(spec.checkpoint_url) != spec.checkpoint_url:
        fd = os.open(workdir / CHECKPOINT_URL_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(spec.checkpoint_url)


def _checkpoint_url(env: Mapping[str, str]) -> str | None:
    path = env.get(PREFIX + "CHECKPOINT_URL_FILE")
    if path:
        with open(path) as f:
            return f.read()
    return env.get(PREFIX + "CHECKPOINT_DIR") or None


def gang_env(spec: RankSpec, gang: GangSpec) -> dict[str, str]:
    """The variables a rank learns once the gang formed: torch's own names and sparkdl's."""
    return {
        "MASTER_ADDR": gang.master_addr,
        "MASTER_PORT": str(gang.master_port),
        "RANK": str(spec.rank),
        "WORLD_SIZE": str(spec.world_size),
        "LOCAL_RANK": str(gang.local_rank),
        "LOCAL_WORLD_SIZE": str(gang.local_world_size),
        PREFIX + "LOCAL_RANK": str(gang.local_rank),
        PREFIX + "LOCAL_WORLD_SIZE": str(gang.local_world_size),
        PREFIX + "ATTEMPT": str(gang.attempt),
        PREFIX + "HOSTS": ",".join(gang.hosts),
        **({PREFIX + "CHECKPOINTS_REFUSED": gang.checkpoints_refused} if gang.checkpoints_refused else {}),
    }


def device_env(use_cuda: bool) -> dict[str, str]:
    """The rank's device, decided once in the rank process, for ``context().device`` everywhere."""
    return {PREFIX + "USE_CUDA": "1" if use_cuda else "0"}


def fd_env(fds: Mapping[str, int]) -> dict[str, str]:
    """Names the numbers of the descriptors a rank inherits (see :data:`FD_NAMES`)."""
    return {f"{PREFIX}{name.upper()}_FD": str(fd) for name, fd in fds.items()}


def in_run(env: Mapping[str, str] | None = None) -> bool:
    """True inside a rank process (or a process it started)."""
    return (os.environ if env is None else env).get(PREFIX + "RUN_ID") is not None


def read_fd(name: str, env: Mapping[str, str] | None = None) -> int | None:
    value = (os.environ if env is None else env).get(f"{PREFIX}{name.upper()}_FD")
    return int(value) if value is not None else None


PIPE_ATOMIC_BYTES = 4096
"""The most one metrics record may take: one write of at most PIPE_BUF bytes to the rank's
metrics pipe is atomic, so threads and processes never interleave theirs."""


def send_record(line: bytes) -> bool:
    """Writes one JSON line (at most :data:`PIPE_ATOMIC_BYTES`) to the rank's metrics pipe, which
    its task relays to the driver; False where there is none (outside a run, the driver-local
    launcher) or it is closed."""
    fd = read_fd("metrics")
    if fd is None:
        return False
    try:
        os.write(fd, line)
    except OSError:
        return False
    return True


def read_rank(env: Mapping[str, str] | None = None) -> RankSpec:
    """The :class:`RankSpec` this process was started with; NotInRunError outside a run."""
    env = os.environ if env is None else env
    if not in_run(env):
        raise NotInRunError(
            "sparkdl.context() is only available inside a function launched by sparkdl.run(...); "
            "outside a run, pass rank and world_size explicitly where an API asks for them"
        )
    task_pid = env.get(PREFIX + "TASK_PID")
    return RankSpec(
        run_id=env[PREFIX + "RUN_ID"],
        rank=int(env[PREFIX + "RANK"]),
        world_size=int(env[PREFIX + "WORLD_SIZE"]),
        host=env[PREFIX + "HOST"],
        backend=env[PREFIX + "BACKEND"],
        gpu_ids=tuple(g for g in env.get(PREFIX + "GPU_IDS", "").split(",") if g),
        task_pid=int(task_pid) if task_pid else None,
        collective_timeout_s=float(env.get(PREFIX + "COLLECTIVE_TIMEOUT_S", RunConfig.collective_timeout_s)),
        init_process_group=env.get(PREFIX + "INIT_PROCESS_GROUP", "1") == "1",
        checkpoint_url=_checkpoint_url(env),
        keep_checkpoints=int(env.get(PREFIX + "KEEP_CHECKPOINTS", RunConfig.keep_checkpoints)),
        checkpoint_sync=env.get(PREFIX + "CHECKPOINT_SYNC") == "1",
        checkpoint_finite_only=env.get(PREFIX + "CHECKPOINT_FINITE_ONLY") == "1",
        horovod_controller=env.get(PREFIX + "HOROVOD_CONTROLLER", RunConfig.horovod_controller),
        processes_per_task=int(env.get(PREFIX + "PROCESSES_PER_TASK", "1")),
        trial=TrialSpec.from_env(env),
    )


def read_gang(env: Mapping[str, str] | None = None) -> GangSpec:
    """The :class:`GangSpec` of this rank (after the gang formed)."""
    env = os.environ if env is None else env
    hosts = tuple(h for h in env.get(PREFIX + "HOSTS", "").split(",") if h) or (env.get(PREFIX + "HOST", ""),)
    return GangSpec(
        attempt=int(env[PREFIX + "ATTEMPT"]),
        hosts=hosts,
        master_port=int(env.get("MASTER_PORT", "0")),
        local_rank=int(env[PREFIX + "LOCAL_RANK"]),
        local_world_size=int(env[PREFIX + "LOCAL_WORLD_SIZE"]),
        checkpoints_refused=env.get(PREFIX + "CHECKPOINTS_REFUSED") or None,
    )


def read_use_cuda(env: Mapping[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(PREFIX + "USE_CUDA") == "1"
