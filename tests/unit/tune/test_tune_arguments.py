"""sparkdl.tune's arguments are checked before any Spark session or job (no JVM here), and its
progress line counts what a user expects."""

from __future__ import annotations

import io
import sys

import pytest

import sparkdl
from sparkdl._internal.tune.trials import Tally

optuna = pytest.importorskip("optuna")


def space(trial):  # type: ignore[no-untyped-def]
    return {"lr": trial.suggest_float("lr", 1e-3, 1.0)}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"n_trials": 0}, "n_trials must be an integer >= 1; got 0"),
        ({"workers_per_trial": 0}, "workers_per_trial must be an integer >= 1; got 0"),
        ({"max_concurrent": 2.5}, "max_concurrent must be an integer >= 1; got 2.5"),
        ({"search_space": {"lr": 0.1}}, "search_space must be a function trial -> dict of parameters"),
        ({"study": "my-study"}, "study must be an optuna.Study"),
        ({"study": "two objectives"}, "study has 2 objectives; sparkdl.tune searches one"),
    ],
)
def test_bad_arguments_are_refused_by_name_before_any_spark_session(changes, message) -> None:  # type: ignore[no-untyped-def]
    kwargs = {"study": optuna.create_study(), "search_space": space, "n_trials": 2, "workers_per_trial": 1,
              "max_concurrent": 1, **changes}
    if kwargs["study"] == "two objectives":
        kwargs["study"] = optuna.create_study(directions=["minimize", "maximize"])
    with pytest.raises(sparkdl.ConfigError) as exc:
        sparkdl.tune(print, **kwargs)
    assert message in str(exc.value)
    assert "pyspark.sql.session" not in sys.modules or not _active_session()


def _active_session() -> bool:
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession() is not None


def test_without_optuna_tune_says_how_to_install_it(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna raises ImportError
    with pytest.raises(sparkdl.ConfigError, match=r"pip install 'sparkdl\[tune\]'"):
        sparkdl.tune(print, study=object(), search_space=space, n_trials=1, workers_per_trial=1)


def test_the_progress_line_counts_trials_and_keeps_the_best_of_the_studys_direction() -> None:
    out = io.StringIO()
    tally = Tally(total=4, direction_max=False, out=out)
    for n in range(3):
        tally.started(n, resumed=False)
    tally.ended(0, "COMPLETE", 0.5)
    tally.ended(1, "PRUNED", None)
    tally.ended(2, "COMPLETE", 0.25)
    tally.started(3, resumed=True)
    tally.ended(3, "FAIL", None)
    lines = out.getvalue().splitlines()
    assert lines[-1] == "sparkdl tune: trial 3 failed: 0 running, 4 of 4 finished (1 pruned, 1 failed); best 0.25 (trial 2)"
    assert "trial 3 resumed: 1 running" in lines[-2]
    maximize = Tally(total=2, direction_max=True, out=io.StringIO())
    maximize.ended(0, "COMPLETE", 0.5)
    maximize.ended(1, "COMPLETE", 0.25)
    assert (maximize.best, maximize.best_trial) == (0.5, 0)
    # A trial the search stopped (Ctrl-C) is neither finished nor failed: it resumes.
    stopped = Tally(total=1, direction_max=False, out=io.StringIO())
    stopped.started(0, resumed=False)
    stopped.ended(0, "RUNNING", None)
    assert (stopped.failed, stopped.running) == (0, 0)
