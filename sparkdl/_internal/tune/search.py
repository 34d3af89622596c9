"""``sparkdl.tune``: a hyperparameter search whose trials are ``sparkdl.run`` gangs.

The driver asks the user's Optuna study for trials (the search space runs here, as Optuna users
write it), runs up to ``max_concurrent`` of them at once, each a gang of ``workers_per_trial``
ranks in a Spark job of its own (its own scheduler pool), and starts the next one as soon as one
ends. Rank 0's ``context().report(value, step)`` goes to the study; with a pruner, the decision
goes back to every rank of the gang at that step (:mod:`sparkdl._internal.wire.trial`). A trial
that fails reruns under its ``RunConfig`` like any run, from its own checkpoints; one that keeps
failing is marked FAIL and the search goes on. The study lives wherever the user keeps it (a
journal file or a database on shared storage): calling ``tune`` again with the same study and
``tune_dir`` finishes the same search, resuming the trials its last driver left running.
"""

from __future__ import annotations

import concurrent.futures as futures
import logging
import math
import os
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from sparkdl._internal.ckpt.fence import RunLease
from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import ConfigError, InsufficientSlotsError, SparkDLError
from sparkdl._internal.common.validate import int_at_least, invalid
from sparkdl._internal.driver import cluster
from sparkdl._internal.driver.run import LaunchOptions, launch_with
from sparkdl._internal.fs.storage import filesystem, redact
from sparkdl._internal.spark import spark_api
from sparkdl._internal.spark.session import resolve_session
from sparkdl._internal.tune.trials import (
    ERROR_ATTR,
    RUN_ATTR,
    SEARCH_ATTR,
    Judge,
    Tally,
    first_lines,
    prunes,
    require_optuna,
    search_trials,
)
from sparkdl._internal.wire.trial import Pruned, TrialSpec

if TYPE_CHECKING:
    import optuna
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)


def tune(
    train_fn: Callable[..., Any],
    *args: Any,
    study: optuna.Study,
    search_space: Callable[[optuna.Trial], Mapping[str, Any]],
    n_trials: int,
    workers_per_trial: int,
    max_concurrent: int = 1,
    backend: str = "torch",
    use_gpu: bool | None = None,
    config: RunConfig | None = None,
    spark: SparkSession | None = None,
    tune_dir: str | os.PathLike[str] | None = None,
    **kwargs: Any,
) -> optuna.Study:
    """Searches hyperparameters with an Optuna study; each trial runs ``train_fn(*args, **kwargs)``
    on ``workers_per_trial`` gang-scheduled ranks, as :func:`sparkdl.run` does.

    ``search_space(trial)`` runs on the driver for each new trial: it calls ``trial.suggest_*``
    and returns a dict, which the trial's ranks read as ``sparkdl.context().trial.params``. Up to
    ``max_concurrent`` trials run at once, as concurrent Spark jobs (each in a scheduler pool of
    its own: set ``spark.scheduler.mode=FAIR`` for them to share the slots fairly), never more
    than the cluster's task slots hold; a new trial starts as soon as one ends.

    A trial's value is what its rank 0 returns (a number), else the last value it reported. In
    the ranks, ``ctx.report(value, step)`` (every rank, the same steps) gives rank 0's value to the
    study; with a pruner, it returns the pruner's decision, the same on every rank, and a trial
    told to stop raises :class:`sparkdl.TrialPruned` (or ``optuna.TrialPruned``) on every rank:
    its slots go to the next trial.

    Each trial has its own checkpoint directory, ``<tune_dir>/trial-<number>/checkpoints``
    (removed when the trial ends pruned, kept otherwise): a trial whose rank fails reruns under
    ``config`` (``max_attempts``) from its last checkpoint,
    and a trial that fails on every attempt is marked FAIL in the study (the error in its user
    attribute ``sparkdl.error``) while the search goes on. With the study on shared storage
    (Optuna's ``JournalStorage`` on a file, or a database URL), calling ``tune`` again with the
    same study and ``tune_dir`` after the driver died finishes the same search: finished trials
    are kept, the ones that were running resume from their checkpoints, and new trials are
    asked until the search holds ``n_trials``.

    Example::

        def train(data):
            ctx = sparkdl.context()
            lr = ctx.trial.params["lr"]
            ...
            for epoch in range(10):
                ...
                if ctx.report(val_loss, step=epoch):
                    raise sparkdl.TrialPruned()
            return val_loss

        study = optuna.create_study(pruner=optuna.pruners.MedianPruner(n_warmup_steps=2))
        sparkdl.tune(train, ds, study=study, n_trials=16, workers_per_trial=2, max_concurrent=2,
                     search_space=lambda t: {"lr": t.suggest_float("lr", 1e-4, 1e-1, log=True)})
        print(study.best_params)

    Args:
        train_fn: what each rank of each trial runs (cloudpickled, as for :func:`sparkdl.run`).
        study: the user's Optuna study (its sampler, pruner, direction and storage). One objective.
        search_space: ``trial -> dict`` of the trial's parameters.
        n_trials: the trials the search holds when it ends (those of earlier calls with the same
            ``tune_dir`` count).
        workers_per_trial: ranks of each trial's gang.
        max_concurrent: trials run at once, at most; fewer when the cluster's slots hold fewer gangs.
        backend, use_gpu, config, spark: as for :func:`sparkdl.launch`, for every trial
            (``config.progress`` is off for the trials: the search has its own line).
        tune_dir: the search's directory (trials' checkpoints, its lease), on storage every
            executor reaches. By default ``<runs dir>/tune-<study name>`` (see
            :func:`sparkdl.launch`'s ``checkpoint_dir``).

    Returns:
        The study, every trial of the search told (``study.best_trial``, ``study.trials``).

    Raises:
        ConfigError: bad arguments, a study with several objectives, or Optuna missing; before
            any Spark job.
        InsufficientSlotsError: the cluster has fewer task slots than one trial's gang needs.
    """
    options = _SearchOptions.check(study, search_space, n_trials, workers_per_trial, max_concurrent)
    launch = LaunchOptions(workers_per_trial, backend, use_gpu, replace(config or RunConfig(), progress=False), spark,
                           None)
    return _Search(train_fn, args, kwargs, options, launch, tune_dir).run()


@dataclass(frozen=True)
class _SearchOptions:
    study: Any  # optuna.Study
    search_space: Callable[[Any], Mapping[str, Any]]
    n_trials: int
    workers_per_trial: int
    max_concurrent: int

    @classmethod
    def check(cls, study: Any, search_space: Any, n_trials: int, workers_per_trial: int,
              max_concurrent: int) -> _SearchOptions:
        optuna = require_optuna()
        if not isinstance(study, optuna.Study):
            raise invalid("study", study, "an optuna.Study (optuna.create_study(...) or optuna.load_study(...))")
        if len(study.directions) != 1:
            raise ConfigError(f"study has {len(study.directions)} objectives; sparkdl.tune searches one: each "
                              "trial's value is one number (rank 0's return value or its last report)")
        if not callable(search_space):
            raise invalid("search_space", search_space, "a function trial -> dict of parameters")
        int_at_least("n_trials", n_trials, 1)
        int_at_least("workers_per_trial", workers_per_trial, 1)
        int_at_least("max_concurrent", max_concurrent, 1)
        return cls(study, search_space, n_trials, workers_per_trial, max_concurrent)


@dataclass
class _Next:
    """A trial to run: a new one, or one a dead driver left running."""

    trial: Any  # optuna.Trial
    params: dict[str, Any]
    reported: set[int]
    resumed: bool


class _Search:
    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: _SearchOptions,
                 launch: LaunchOptions, tune_dir: str | os.PathLike[str] | None) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.options, self.launch = options, launch
        self.study = options.study
        cfg = launch.config
        self.tasks = launch.num_workers // cfg.processes_per_task if launch.num_workers % cfg.processes_per_task == 0 \
            else launch.num_workers  # launch refuses a gang that is no multiple, by name
        self.session = resolve_session(launch.spark, self.tasks)
        self.api = spark_api.of(self.session)
        conf = self.api.confs()
        self.concurrent = self._concurrency()
        root = cluster.runs_root(conf, default_fs=self.api.default_fs(), user=self.api.spark_user())
        self.tune_dir = os.fspath(tune_dir) if tune_dir is not None else \
            f"{root.rstrip('/')}/tune-{re.sub(r'[^A-Za-z0-9_.-]', '_', self.study.study_name)}"
        self.mlflow = cluster.mlflow_enabled(conf, cfg)
        self.pruning = prunes(self.study)
        # Set when the search stops early (Ctrl-C, an error of the search itself): the running
        # trials' gangs end, and the trials stay RUNNING, for a later call to resume.
        self._stop = threading.Event()

    def _concurrency(self) -> int:
        total = self.api.task_slots()
        if total is None:
            return self.options.max_concurrent
        if total < self.tasks:
            raise InsufficientSlotsError(
                f"workers_per_trial={self.launch.num_workers} needs {self.tasks} task slots at once, but the cluster "
                f"has {total} (master {self.api.master}): lower workers_per_trial, or add executors or cores",
                required=self.tasks, available=total,
            )
        fits = total // self.tasks
        if fits < self.options.max_concurrent:
            log.warning("sparkdl tune: the cluster's %d task slots hold %d gang(s) of %d at once: %d trial(s) run at "
                        "a time, not max_concurrent=%d", total, fits, self.tasks, fits, self.options.max_concurrent)
        return min(fits, self.options.max_concurrent)

    def run(self) -> Any:
        optuna = require_optuna()
        lease = RunLease(self.tune_dir, f"tune-{secrets.token_hex(4)}", self.launch.config.checkpoint_lease_s)
        lease.acquire()  # a second driver on the same search is refused, naming this one
        parent: str | None = None
        try:
            parent = self._mlflow_parent()
            mine = search_trials(self.study, self.tune_dir)
            left = deque(t for t in mine if t.state == optuna.trial.TrialState.RUNNING)
            new = max(0, self.options.n_trials - len(mine))
            tally = Tally(total=len(mine) + new, direction_max=self.study.direction == optuna.study.StudyDirection.MAXIMIZE)
            for t in mine:
                if t.state.is_finished():
                    tally.complete += t.state == optuna.trial.TrialState.COMPLETE
                    tally.pruned += t.state == optuna.trial.TrialState.PRUNED
                    tally.failed += t.state == optuna.trial.TrialState.FAIL
            if left:
                log.warning("sparkdl tune: resuming %d trial(s) of %s that a driver left running: %s", len(left),
                            redact(self.tune_dir), ", ".join(str(t.number) for t in left))
            pool = futures.ThreadPoolExecutor(self.concurrent, thread_name_prefix="sparkdl-trial")
            running: dict[futures.Future[None], int] = {}
            try:
                slots = list(range(self.concurrent))
                while left or new or running:
                    while slots and (left or new):
                        if left:
                            nxt = self._resume(optuna, left.popleft())
                        else:
                            nxt = self._ask()
                            new -= 1
                        slot = slots.pop(0)
                        running[pool.submit(self._trial, nxt, slot, tally, parent)] = slot
                    done, _ = futures.wait(running, return_when=futures.FIRST_COMPLETED)
                    for fut in done:
                        slots.append(running.pop(fut))
                        fut.result()  # what a trial cannot handle (a bug, an interrupt) ends the search
            except BaseException:
                # Ctrl-C, or a trial's unexpected error: every running gang ends before this returns
                # (each within RunConfig.kill_grace_s), as a single run's does.
                self._stop.set()
                futures.wait(running, timeout=2 * self.launch.config.kill_grace_s + 10)
                raise
            finally:
                pool.shutdown(wait=False, cancel_futures=True)
        finally:
            lease.release()
            self._mlflow_end(parent)
        return self.study

    # ---- trials ----------------------------------------------------------------------------

    def _ask(self) -> _Next:
        trial = self.study.ask()
        trial.set_user_attr(SEARCH_ATTR, self.tune_dir)
        return _Next(trial, self._params(trial), set(), resumed=False)

    def _resume(self, optuna: Any, frozen: Any) -> _Next:
        # The same Optuna trial, RUNNING since its driver died: its suggest_* calls give back the
        # values it had, and its steps reported before count as reported.
        trial = optuna.trial.Trial(self.study, frozen._trial_id)
        return _Next(trial, self._params(trial), set(frozen.intermediate_values), resumed=True)

    def _params(self, trial: Any) -> dict[str, Any]:
        """What the search space gives ``trial``; a space that raises or gives no dict fails the
        trial (not left RUNNING, for a later call to resume) and stops the search."""
        try:
            params = self.options.search_space(trial)
            if not isinstance(params, Mapping):
                raise invalid("search_space(trial)", params, "a dict of the trial's parameters")
        except BaseException as exc:
            trial.set_user_attr(ERROR_ATTR, first_lines(f"search_space: {type(exc).__name__}: {exc}"))
            self.study.tell(trial, state=_state("FAIL"))
            raise
        return dict(params)

    def _trial(self, nxt: _Next, slot: int, tally: Tally, parent: str | None) -> None:
        trial = nxt.trial
        self.api.scheduler_pool(f"sparkdl-tune-{slot}")
        judge = Judge(trial, self.pruning, nxt.reported)
        spec = TrialSpec(trial.number, nxt.params, self.pruning)
        checkpoints = f"{self.tune_dir.rstrip('/')}/trial-{trial.number}/checkpoints"
        # The session is passed on: a Spark Connect session is the active one only in the thread that made it.
        options = replace(self.launch, spark=self.session, checkpoint_dir=checkpoints)
        if self._stop.is_set():
            return  # the search stopped before this trial's turn: it stays as it was
        tally.started(trial.number, nxt.resumed)
        child = self._mlflow_child(parent, trial.number, nxt.params)
        state, value = "FAIL", None
        try:
            try:
                result = self._launch(options, spec, judge)
            except KeyboardInterrupt:
                state = "RUNNING"  # the search was stopped: the trial resumes when tune is called again
                raise
            except SparkDLError as exc:
                trial.set_user_attr(ERROR_ATTR, first_lines(str(exc)))
                log.warning("sparkdl tune: trial %d failed, the search goes on: %s", trial.number,
                            first_lines(str(exc), 500))
                self.study.tell(trial, state=_state("FAIL"))
                return
            trial.set_user_attr(RUN_ATTR, result.run_id)
            # Pruned as Optuna counts it: the trial ended by raising TrialPruned. (A trial whose
            # ranks heard no decision, through the relay hub, ran to its end: its value stands.)
            if isinstance(result.value, Pruned):
                state = "PRUNED"
                self.study.tell(trial, state=_state("PRUNED"))
                _remove(checkpoints)  # a pruned trial never resumes: its checkpoints are only disk
                return
            value = _number(result.value if result.value is not None else judge.last)
            if value is None:
                trial.set_user_attr(ERROR_ATTR, f"rank 0 returned {type(result.value).__name__}, not a number, and "
                                                "reported no value (context().report)")
            state = "COMPLETE" if value is not None and not math.isnan(value) else "FAIL"
            self.study.tell(trial, value if state == "COMPLETE" else None, state=_state(state))
        finally:
            # An interrupt leaves the trial RUNNING: calling tune again resumes it.
            tally.ended(trial.number, state, value)
            self._mlflow_child_end(child, state, value)

    def _launch(self, options: LaunchOptions, spec: TrialSpec, judge: Judge) -> Any:
        """The trial's run; while another application holds the slots, it waits for them (its
        own trials never do: the search runs no more gangs than the slots hold), up to
        ``RunConfig.start_timeout_s``."""
        deadline = time.monotonic() + options.config.start_timeout_s
        while True:
            try:
                return launch_with(self.fn, self.args, self.kwargs, options, trial=spec, judge=judge, stop=self._stop)
            except InsufficientSlotsError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(1.0)

    # ---- MLflow: a parent run for the search, a nested run per trial --------------------------

    def _mlflow_parent(self) -> str | None:
        if not self.mlflow:
            return None
        import mlflow

        run = mlflow.start_run(run_name=f"sparkdl-tune-{self.study.study_name}",
                               nested=mlflow.active_run() is not None)
        mlflow.log_params({"sparkdl.tune_dir": self.tune_dir, "sparkdl.workers_per_trial": self.launch.num_workers,
                           "sparkdl.max_concurrent": self.concurrent})
        return str(run.info.run_id)

    def _mlflow_end(self, parent: str | None) -> None:
        if parent is None:
            return
        import mlflow

        try:
            best = self.study.best_trial
            mlflow.log_metric("best_value", float(best.value))
            mlflow.log_params({f"best.{k}": v for k, v in best.params.items()})
        except (ValueError, TypeError):  # no trial completed
            pass
        mlflow.end_run()

    def _mlflow_child(self, parent: str | None, number: int, params: dict[str, Any]) -> str | None:
        if parent is None:
            return None
        import mlflow

        # In this trial's thread: launch_with logs the run into it (the active run of this thread).
        run = mlflow.start_run(run_name=f"trial-{number}", parent_run_id=parent)
        mlflow.log_params({"trial": number, **params})
        return str(run.info.run_id)

    def _mlflow_child_end(self, child: str | None, state: str, value: float | None) -> None:
        if child is None:
            return
        import mlflow

        if value is not None:
            mlflow.log_metric("value", value)
        mlflow.set_tag("sparkdl.trial_state", state)
        mlflow.end_run(status="FINISHED" if state in ("COMPLETE", "PRUNED") else "FAILED")


def _remove(url: str) -> None:
    """Removes a directory of checkpoints, warning (not failing the search) when it cannot."""
    try:
        fs, path = filesystem(url)
        fs.delete_dir(path)
    except Exception as exc:
        log.warning("sparkdl tune: could not remove %s: %s: %s", redact(url), type(exc).__name__, exc)


def _number(value: Any) -> float | None:
    """A trial's value as a float (numbers, 0-d tensors and numpy scalars); None when it is none."""
    if hasattr(value, "item") and not isinstance(value, bool):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _state(name: str) -> Any:
    return getattr(require_optuna().trial.TrialState, name)
