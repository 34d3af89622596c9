"""``sparkdl.tune`` on a real local[4] Spark: trials are gangs of 2 ranks (gloo, an allreduce every
step), with an Optuna study. Concurrent gangs, a third trial waiting for slots, pruning at the
same step on every rank, a rank SIGKILLed inside a trial, and the driver SIGKILLed mid-search,
then the search called again. The objective is :mod:`tune_objective` (tests/resources)."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import psutil
import pytest
from conftest import REPO, needs_session

import sparkdl

optuna = pytest.importorskip("optuna")
sys.path.insert(0, str(REPO / "tests" / "resources"))
tune_objective = importlib.import_module("tune_objective")
cloudpickle.register_pickle_by_value(tune_objective)
importlib.import_module("pyspark.cloudpickle").register_pickle_by_value(tune_objective)

pytestmark = [pytest.mark.spark]

CFG = sparkdl.RunConfig(start_timeout_s=90, slot_wait_s=30, collective_timeout_s=60, kill_grace_s=30)


def space(trial):  # type: ignore[no-untyped-def]
    return {"lr": trial.suggest_float("lr", 1e-4, 1.0, log=True)}


@pytest.fixture(scope="module")
@needs_session("local[4]")
def four_slots(spark_session):  # type: ignore[no-untyped-def]
    return spark_session("local[4]")


def _study(*lrs: float, pruner=None, storage=None, name=None):  # type: ignore[no-untyped-def]
    study = optuna.create_study(pruner=pruner or optuna.pruners.NopPruner(), storage=storage, study_name=name,
                                load_if_exists=storage is not None)
    for lr in lrs:
        study.enqueue_trial({"lr": lr})
    return study


def _started(log: Path, trial: int, attempt: int = 0) -> float:
    return min(float((log / f"t{trial}-a{attempt}-r{r}.start").read_text().split()[1]) for r in (0, 1))


def _ended(log: Path, trial: int, attempt: int = 0) -> float:
    return max(float((log / f"t{trial}-a{attempt}-r{r}.end").read_text()) for r in (0, 1))


def _pids(log: Path, trial: int) -> list[int]:
    return [int(p.read_text().split()[0]) for p in log.glob(f"t{trial}-a*-r*.start")]


def _gone(pids: list[int], bound_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + bound_s
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    return alive


def test_trials_run_as_concurrent_gangs_a_third_waits_for_slots_and_a_killed_rank_resumes(four_slots, tmp_path) -> None:  # type: ignore[no-untyped-def]
    log = tmp_path / "log"
    log.mkdir()
    study = _study(0.01, 0.1, 0.001)
    # Trial 0's rank 1 is SIGKILLed after its step-1 checkpoint, in the first attempt.
    plan = {"sleep": 0.5, "kill": [0, 0, 1, 1]}
    out = sparkdl.tune(tune_objective.objective, str(log), plan, study=study, search_space=space, n_trials=3,
                       workers_per_trial=2, max_concurrent=3, config=CFG, spark=four_slots,
                       tune_dir=str(tmp_path / "search"))
    assert out is study
    trials = sorted(study.trials, key=lambda t: t.number)
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3
    # Every trial's value, and every step it reported, as an uninterrupted search gives them.
    for t in trials:
        lr = t.params["lr"]
        assert t.value == pytest.approx(tune_objective.loss(lr, tune_objective.STEPS - 1))
        assert t.intermediate_values == {s: pytest.approx(tune_objective.loss(lr, s)) for s in range(tune_objective.STEPS)}
    # Trial 0 reran from its checkpoint (after step 1: at step 2) on both ranks.
    assert [(log / f"t0-r{r}-resumed").read_text().split() for r in (0, 1)] == [["2"], ["2"]]
    assert not list(log.glob("t1-r*-resumed")) and not list(log.glob("t2-r*-resumed"))
    # Four slots hold two gangs of two: trials 0 and 1 ran at once; trial 2 waited for one of them.
    # (Trial 0's first attempt ran until its rerun started.)
    spans = {0: (_started(log, 0), _started(log, 0, attempt=1)), 1: (_started(log, 1), _ended(log, 1))}
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1], spans
    assert _started(log, 2) >= min(_ended(log, 0, attempt=1), _ended(log, 1)) - 0.05, spans
    assert not _gone([p for t in range(3) for p in _pids(log, t)])


def test_a_worse_trial_is_pruned_at_the_same_step_on_every_rank_and_its_ranks_end(four_slots, tmp_path) -> None:  # type: ignore[no-untyped-def]
    log = tmp_path / "log"
    log.mkdir()
    # Trial 0 (lr 0.01) sets the median; trial 1 (lr 1.0) is clearly worse at every step.
    study = _study(0.01, 1.0, pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=1))
    sparkdl.tune(tune_objective.objective, str(log), {}, study=study, search_space=space, n_trials=2,
                 workers_per_trial=2, config=CFG, spark=four_slots, tune_dir=str(tmp_path / "search"))
    good, bad = sorted(study.trials, key=lambda t: t.number)
    assert good.state.name == "COMPLETE"
    assert bad.state.name == "PRUNED"
    # Both ranks were told at the same step, the first after the warm-up, and stopped there: none
    # went on alone into the next step's allreduce (which would have failed the trial).
    assert sorted(p.name for p in log.glob("t1-r*-pruned-at-*")) == ["t1-r0-pruned-at-1", "t1-r1-pruned-at-1"]
    assert not list(log.glob("t1-a*-r*.end"))
    # A pruned trial never resumes: its checkpoints are removed; the completed trial's are kept.
    assert not (tmp_path / "search" / "trial-1" / "checkpoints").exists()
    assert list((tmp_path / "search" / "trial-0" / "checkpoints").glob("ckpt-*.json"))
    assert bad.intermediate_values == {0: pytest.approx(tune_objective.loss(1.0, 0)),
                                       1: pytest.approx(tune_objective.loss(1.0, 1))}
    assert not _gone(_pids(log, 1))


def _held(log: Path) -> int:
    """How many times both ranks of trial 1 reached its hold (step 2)."""
    counts = [len(p.read_text().splitlines()) for p in log.glob("t1-r*-holding")]
    return min(counts) if len(counts) == 2 else 0


def _driver_until_held(log: Path, journal: Path, search: Path, times: int) -> tuple[subprocess.Popen[bytes], list[int]]:
    """A driver process running the search (tune_objective's __main__), once trial 1 is held at
    step 2 for the ``times``-th time; with the pids of trial 1's ranks."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "resources")]),
           "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    driver = subprocess.Popen([sys.executable, str(REPO / "tests" / "resources" / "tune_objective.py"), str(log),
                               str(journal), str(search)], env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    while _held(log) < times:
        if driver.poll() is not None or time.monotonic() > deadline:
            _end_group(driver)
            pytest.fail(f"trial 1 never reached its step 2: {driver.stderr.read().decode()[-3000:] if driver.stderr else ''}")
        time.sleep(0.2)
    pids = [int(p.read_text().splitlines()[-1]) for p in log.glob("t1-r*-holding")]
    return driver, pids


def _end_group(driver: subprocess.Popen[bytes]) -> None:
    if driver.poll() is None:
        driver.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(driver.pid, signal.SIGKILL)
    driver.wait(30)


def _states(journal: Path) -> list[str]:
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    return [t.state.name for t in sorted(optuna.load_study(study_name="killed", storage=storage).trials,
                                         key=lambda t: t.number)]


def test_a_search_stopped_by_ctrl_c_or_whose_driver_was_killed_resumes_where_it_was(four_slots, tmp_path) -> None:  # type: ignore[no-untyped-def]
    log, journal, search = tmp_path / "log", tmp_path / "study.journal", tmp_path / "search"
    log.mkdir()
    # Ctrl-C (SIGINT) while trial 1 runs: the driver ends its gang and returns, within the bound.
    driver, held = _driver_until_held(log, journal, search, 1)
    try:
        driver.send_signal(signal.SIGINT)
        driver.wait(90)
        assert b"KeyboardInterrupt" in (driver.stderr.read() if driver.stderr else b"")
        assert not _gone(held, 30), "trial 1's ranks outlived the interrupted search"
    finally:
        _end_group(driver)
    assert _states(journal) == ["COMPLETE", "RUNNING", "WAITING"]
    # The search again (trial 1 resumes and is held again), then its driver SIGKILLed.
    driver, held = _driver_until_held(log, journal, search, 2)
    try:
        driver.send_signal(signal.SIGKILL)
        driver.wait(30)
        # The driver's JVM, its executors' workers and the ranks of the trial it ran end without it.
        assert not _gone(held, 60), "trial 1's ranks outlived their driver"
    finally:
        _end_group(driver)
    assert _states(journal) == ["COMPLETE", "RUNNING", "WAITING"]
    (log / "go").touch()
    started_before = {p.name: p.read_text() for p in log.glob("*.start")}
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    study = optuna.load_study(study_name="killed", storage=storage)
    sparkdl.tune(tune_objective.objective, str(log), {}, study=study, search_space=space, n_trials=3,
                 workers_per_trial=2, config=CFG, spark=four_slots, tune_dir=str(search))
    trials = sorted(study.trials, key=lambda t: t.number)
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3
    for t in trials:
        assert t.value == pytest.approx(tune_objective.loss(t.params["lr"], tune_objective.STEPS - 1))
        assert set(t.intermediate_values) == set(range(tune_objective.STEPS))
    # Trial 0 ran once; trial 1 resumed from its step-2 checkpoint each of the two times after the
    # first; trial 2 ran once, in the last call.
    assert {n: p.read_text() for n, p in ((p.name, p) for p in log.glob("t0-*.start"))} == \
        {n: t for n, t in started_before.items() if n.startswith("t0-")}
    assert [(log / f"t1-r{r}-resumed").read_text().split() for r in (0, 1)] == [["2", "2"], ["2", "2"]]
    assert sorted(p.name for p in log.glob("t2-*.start")) == ["t2-a0-r0.start", "t2-a0-r1.start"]
    assert "t2-a0-r0.start" not in started_before


def test_tune_refuses_bad_arguments_before_any_spark_job(four_slots) -> None:  # type: ignore[no-untyped-def]
    study = _study()
    with pytest.raises(sparkdl.InsufficientSlotsError, match="workers_per_trial=5 needs 5 task slots"):
        sparkdl.tune(tune_objective.objective, "x", {}, study=study, search_space=space, n_trials=1,
                     workers_per_trial=5, spark=four_slots)
    with pytest.raises(sparkdl.ConfigError, match="objectives"):
        sparkdl.tune(tune_objective.objective, study=optuna.create_study(directions=["minimize", "minimize"]),
                     search_space=space, n_trials=1, workers_per_trial=1, spark=four_slots)
    with pytest.raises(sparkdl.ConfigError, match=r"study must be an optuna\.Study"):
        sparkdl.tune(tune_objective.objective, study="s", search_space=space, n_trials=1, workers_per_trial=1)
    assert study.trials == []


def test_a_search_space_that_fails_fails_its_trial_and_stops_the_search(four_slots, tmp_path) -> None:  # type: ignore[no-untyped-def]
    study = _study()

    def broken(trial):  # type: ignore[no-untyped-def]
        return {"lr": trial.suggest_float("lr", 1.0, 0.1)}  # low > high: Optuna refuses it

    with pytest.raises(ValueError):
        sparkdl.tune(tune_objective.objective, "x", {}, study=study, search_space=broken, n_trials=3,
                     workers_per_trial=1, spark=four_slots, tune_dir=str(tmp_path / "search"))
    # Not left RUNNING for a later call to resume: failed, saying why; no other trial was asked.
    assert [t.state.name for t in study.trials] == ["FAIL"]
    assert study.trials[0].user_attrs["sparkdl.error"].startswith("search_space: ValueError")


def test_with_mlflow_the_search_is_a_parent_run_with_a_nested_run_per_trial(four_slots, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)  # MLflow's artifacts go under ./mlruns
    log = tmp_path / "log"
    log.mkdir()
    study = _study(0.01, 0.1, name="logged")
    sparkdl.tune(tune_objective.objective, str(log), {}, study=study, search_space=space, n_trials=2,
                 workers_per_trial=2, max_concurrent=2, config=CFG.replace(mlflow=True), spark=four_slots,
                 tune_dir=str(tmp_path / "search"))
    client = mlflow.tracking.MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name("Default").experiment_id])
    parents = [r for r in runs if r.info.run_name == "sparkdl-tune-logged"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0]
    assert parent.data.metrics["best_value"] == pytest.approx(study.best_value)
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert set(children) == {"trial-0", "trial-1"}
    for number, lr in ((0, 0.01), (1, 0.1)):
        child = children[f"trial-{number}"]
        assert float(child.data.params["lr"]) == pytest.approx(lr)
        assert child.data.tags["sparkdl.trial_state"] == "COMPLETE"
        assert child.data.metrics["value"] == pytest.approx(study.trials[number].value)
        # The trial's run logged into its nested run: rank 0's reports, step by step.
        history = sorted((m.step, m.value) for m in client.get_metric_history(child.info.run_id, "objective"))
        assert history == [(s, pytest.approx(tune_objective.loss(lr, s))) for s in range(tune_objective.STEPS)]


def test_trials_whose_ranks_report_through_the_relay_hub_run_to_their_end_unpruned(four_slots, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from sparkdl._internal.spark.spark_api import CHANNEL_MODE_CONF

    log = tmp_path / "log"
    log.mkdir()
    study = _study(0.01, 1.0, pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=1))
    four_slots.conf.set(CHANNEL_MODE_CONF, "relay")
    try:
        sparkdl.tune(tune_objective.objective, str(log), {}, study=study, search_space=space, n_trials=2,
                     workers_per_trial=2, config=CFG, spark=four_slots, tune_dir=str(tmp_path / "search"))
    finally:
        four_slots.conf.unset(CHANNEL_MODE_CONF)
    # The hub carries no decisions: the ranks were told so and did not wait for any; the reports
    # reached the study at the end of each attempt, with the attempt's record.
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]
    assert not list(log.glob("t1-r*-pruned-at-*"))
    for t in study.trials:
        assert t.intermediate_values == {s: pytest.approx(tune_objective.loss(t.params["lr"], s))
                                         for s in range(tune_objective.STEPS)}
