"""``sparkdl.context()``: who and where this rank is, inside a function launched by ``sparkdl.run``.

The context is read from the rank process's environment (through :mod:`sparkdl._internal.wire.rankspec`, the
only reader of it), which the launcher sets before the user's code starts. That keeps it correct
in threads and in DataLoader worker processes too.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparkdl._internal.ckpt import sharded as sharded_ckpt
from sparkdl._internal.ckpt.fence import Writer
from sparkdl._internal.ckpt.store import CheckpointStore
from sparkdl._internal.common.errors import ConfigError, NotInRunError, SparkDLError
from sparkdl._internal.common.validate import invalid
from sparkdl._internal.rank import orders
from sparkdl._internal.wire import rankspec
from sparkdl._internal.wire.messages import PROGRESS_KEY
from sparkdl._internal.wire.trial import OBJECTIVE, REPORT_KEY, TrialSpec

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RunContext:
    """This rank's place in the run.

    Attributes:
        rank: global rank, 0 .. world_size - 1.
        world_size: number of ranks in the gang.
        local_rank: index of this rank among the devices it can see: on GPUs each rank sees only
            the GPUs Spark assigned to its task, so this is its index among the ranks of its task
            (0 unless ``RunConfig.processes_per_task`` > 1); on CPUs it is the index of this rank
            among the ranks on the same host.
        local_world_size: ranks that share ``local_rank``'s numbering.
        attempt: 0 on the first run of the gang, 1 on its first rerun, and so on.
        run_id: identifier shared by every rank of every attempt of the run.
        host: address of the executor this rank runs on.
        backend: the run's backend: ``"torch"``, ``"horovod"``, ``"tensorflow"`` or ``"none"``.
        gpu_ids: GPU addresses Spark assigned to this rank's task (empty on CPU).
        trial: in a search (:func:`sparkdl.tune`), this run's trial: ``trial.number`` and
            ``trial.params``, what the search space returned for it; None in a plain run.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    attempt: int
    run_id: str
    host: str
    backend: str
    gpu_ids: tuple[str, ...]
    use_cuda: bool
    checkpoint_url: str | None = None
    keep_checkpoints: int = 3
    checkpoint_sync: bool = False
    checkpoint_finite_only: bool = False
    # Why the checkpoint directory must not be written (a host of the gang does not share it).
    checkpoints_refused: str | None = None
    trial: TrialSpec | None = None
    collective_timeout_s: float = 1800.0

    @property
    def device(self) -> torch.device:
        """``cuda:LOCAL_RANK`` when the rank runs on a GPU (``cuda:0``, the first GPU it sees, with
        one rank per task), else ``cpu``."""
        import torch

        return torch.device("cuda", self.local_rank) if self.use_cuda else torch.device("cpu")

    @property
    def checkpoints(self) -> CheckpointStore:
        """The run's checkpoint store (``run(checkpoint_dir=...)``)."""
        if not self.checkpoint_url:
            raise NotInRunError("this run has no checkpoint directory")
        return CheckpointStore(self.checkpoint_url, keep=self.keep_checkpoints, refused=self.checkpoints_refused,
                               writer=Writer(self.run_id, self.attempt), sync=self.checkpoint_sync,
                               finite_only=self.checkpoint_finite_only)

    def save_checkpoint(self, obj: Any, *, all_ranks: bool = False, sharded: bool = False) -> int | None:
        """Saves ``obj`` (state_dicts, tensors, numbers, strings and containers of them, or any
        picklable object) as the run's next checkpoint.

        By default only rank 0 writes and other ranks return None at once; the write is atomic,
        so a crash in the middle leaves the previous checkpoint valid. The last
        ``RunConfig.keep_checkpoints`` are kept. With ``all_ranks=True`` every rank writes to
        its own subdirectory ``rank-<r>``. An ``obj`` holding objects of other classes than the
        ones listed is saved, but :meth:`load_checkpoint` reads it back only with
        ``weights_only=False``.

        With ``sharded=True`` (a model sharded with FSDP's ``fully_shard`` or tensor
        parallelism), every rank must call it with its own ``obj``, e.g.
        ``{"model": msd, "optimizer": osd}`` from
        ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)``: each rank
        writes the ``DTensor`` shards it holds (``torch.distributed.checkpoint``), rank 0 the
        rest, and the checkpoint counts only once every rank's part is written. Load it with
        ``load_checkpoint(into=...)``, on any number of ranks.

        Returns:
            the checkpoint's sequence number on a rank that wrote, else None.
        """
        if sharded:
            if all_ranks:
                raise ConfigError("save_checkpoint: pass sharded=True or all_ranks=True, not both")
            return sharded_ckpt.save(self.checkpoints, obj, weights_only=False)
        if all_ranks:
            return self.checkpoints.child(f"rank-{self.rank}").save(obj)
        if self.rank != 0:
            return None
        return self.checkpoints.save(obj)

    def load_checkpoint(self, *, all_ranks: bool = False, weights_only: bool = True, into: Any = None) -> Any:
        """The latest complete checkpoint of the run (rank 0's, or this rank's own), or None.

        With ``weights_only=True`` (the default) only tensors, numbers, strings and containers
        of them are loaded, and nothing in the file can run code: a checkpoint holding other
        objects raises :class:`~sparkdl.SparkDLError` naming the file and what was refused.
        ``weights_only=False`` unpickles anything, running any code the file holds: use it only
        for checkpoints you saved yourself in a directory nobody else can write to.

        ``into`` (needed for a checkpoint saved with ``sharded=True``): what the sharded tensors
        load into, in place, under the keys they were saved with, e.g.
        ``{"model": msd, "optimizer": osd}`` from ``get_state_dict(model, optimizer)`` of the
        model as it is sharded now; the world size may differ from the one that saved. Every
        rank must call it then (it is collective), and gets the checkpoint with its sharded
        tensors taken from ``into``; pass them on with ``set_state_dict``.
        """
        store = self.checkpoints
        if into is not None:
            if all_ranks:
                raise ConfigError("load_checkpoint: pass into=... or all_ranks=True, not both")
            seq = sharded_ckpt.latest(store)
            return None if seq is None else sharded_ckpt.load(store, seq, into, weights_only=weights_only)
        if all_ranks:
            store = store.child(f"rank-{self.rank}")
        return store.load(weights_only=weights_only)

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Sends ``metrics`` (names to numbers or short strings) to the driver, tagged with this rank.

        The driver keeps them (``sparkdl.launch(...).metrics``, a JSON-lines file in the run's
        directory) and shows them in its progress line. Keys ``epoch``, ``step`` and ``loss``
        feed the progress line. 0-d tensors and numpy scalars are converted to numbers.

        Example::

            ctx.log_metrics({"loss": loss.item(), "epoch": epoch}, step=global_step)
        """
        record: dict[str, Any] = {"time": time.time(), "rank": self.rank, "attempt": self.attempt}
        if step is not None:
            record["step"] = int(step)
        for key, value in metrics.items():
            if not isinstance(key, str):
                raise ConfigError(f"log_metrics: metric names must be strings; got {key!r}")
            if hasattr(value, "item"):
                value = value.item()
            if not isinstance(value, (int, float, str, bool)) or (isinstance(value, str) and len(value) > 200):
                raise ConfigError(
                    f"log_metrics: metric {key!r} must be a number or a string of at most 200 characters; "
                    f"got {type(value).__name__}"
                )
            record[key] = value
        self._send(record)

    def report(self, value: float, step: int) -> bool:
        """Reports the trial's objective ``value`` at ``step`` (an epoch, or a number of steps)
        and returns whether the trial should stop here, pruned (:func:`sparkdl.tune`).

        Every rank must call it, with the same steps, in the same order: rank 0's value is the
        one the study gets and its pruner judges, and every rank waits here for that decision
        (at most ``RunConfig.collective_timeout_s``), so all ranks of the gang leave the same
        step with the same answer and none is left alone in a collective. To stop, raise
        :class:`sparkdl.TrialPruned` (or ``optuna.TrialPruned``) on every rank, or return.
        Outside a search, or when the study does not prune, it records the value as the metric
        ``objective`` and returns False at once.

        Example::

            for epoch in range(epochs):
                loss = train_one_epoch(...)
                if ctx.report(validate(model), step=epoch):
                    raise sparkdl.TrialPruned()
        """
        if hasattr(value, "item"):
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise invalid("report: value", value, "a number (a float, or a 0-d tensor)")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise invalid("report: step", step, "an integer >= 0")
        self._send({"time": time.time(), "rank": self.rank, "attempt": self.attempt, "step": step,
                    OBJECTIVE: float(value), REPORT_KEY: 1})
        pipe = orders.pipe()
        if self.trial is None or not self.trial.pruning or pipe is None:
            return False
        try:
            prune = pipe.decision(step, self.collective_timeout_s)
        except TimeoutError:
            raise SparkDLError(
                f"rank {self.rank} waited {self.collective_timeout_s:g} s (RunConfig.collective_timeout_s) for the "
                f"study's decision on step {step}, which comes once rank 0 reports that step: every rank must call "
                "context().report with the same steps"
            ) from None
        return bool(prune)

    def should_prune(self) -> bool:
        """Whether a decision this rank received so far (from :meth:`report`) said to prune the trial."""
        pipe = orders.pipe()
        return pipe is not None and pipe.last_prune

    def _report_step(self, step: int) -> None:
        """Tells the driver this rank's step (for the progress line and the stragglers), not a metric."""
        self._send({"rank": self.rank, "attempt": self.attempt, "step": int(step), PROGRESS_KEY: 1}, quiet=True)

    def _send(self, record: dict[str, Any], quiet: bool = False) -> None:
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        if len(line) > rankspec.PIPE_ATOMIC_BYTES:
            raise ConfigError(
                f"log_metrics: one call may send at most {rankspec.PIPE_ATOMIC_BYTES} bytes of JSON; "
                "split the metrics over several calls"
            )
        if not rankspec.send_record(line) and not quiet:
            # No driver to send to (the driver-local launcher): keep the metrics in the output.
            print(f"sparkdl metrics {line.decode().strip()}", flush=True)

    @property
    def is_chief(self) -> bool:
        """True on rank 0, the rank whose return value ``run`` returns."""
        return self.rank == 0


def context() -> RunContext:
    """The :class:`RunContext` of the calling rank.

    Example::

        def train():
            ctx = sparkdl.context()
            model = Net().to(ctx.device)
            print(f"rank {ctx.rank} of {ctx.world_size}, attempt {ctx.attempt}")

    Raises:
        NotInRunError: when called outside a function launched by :func:`sparkdl.run`.
    """
    spec = rankspec.read_rank()
    gang = rankspec.read_gang()
    return RunContext(
        rank=spec.rank,
        world_size=spec.world_size,
        local_rank=gang.local_rank,
        local_world_size=gang.local_world_size,
        attempt=gang.attempt,
        run_id=spec.run_id,
        host=spec.host,
        backend=spec.backend,
        gpu_ids=spec.gpu_ids,
        use_cuda=rankspec.read_use_cuda(),
        checkpoint_url=spec.checkpoint_url,
        keep_checkpoints=spec.keep_checkpoints,
        checkpoint_sync=spec.checkpoint_sync,
        checkpoint_finite_only=spec.checkpoint_finite_only,
        checkpoints_refused=gang.checkpoints_refused,
        trial=spec.trial,
        collective_timeout_s=spec.collective_timeout_s,
    )
