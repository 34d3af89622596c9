"""The jobs in jobs/ without a JVM: their options (``--help``, ``--conf``, ``--defaults``), the
properties format of their defaults file, the shipped defaults, which the command line overrides,
and the private default location of their data and model. The training job end to end is in
tests/e2e/test_jobs.py.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

JOBS = REPO / "jobs"

pytestmark = pytest.mark.both_stacks(
    "the jobs, imported by name (tests/stack_rule.py does not follow them), parse through sparkdl._internal.spark.session and import pyspark"
)


@pytest.fixture
def jobs(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The jobs' modules, imported the way a job script imports its neighbours."""
    import importlib

    monkeypatch.syspath_prepend(str(JOBS))
    for name in ("_common", "etl", "train", "inference", "images"):
        sys.modules.pop(name, None)
    monkeypatch.delenv("SPARKDL_CONF_DIR", raising=False)

    class Jobs:
        common = importlib.import_module("_common")
        etl = importlib.import_module("etl")
        train = importlib.import_module("train")
        inference = importlib.import_module("inference")
        images = importlib.import_module("images")

    yield Jobs
    for name in ("_common", "etl", "train", "inference", "images"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("job", ["etl", "train", "inference", "images"])
def test_help_names_the_spark_submit_options(job: str) -> None:
    out = subprocess.run([sys.executable, str(JOBS / f"{job}.py"), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for option in ("--master", "--conf KEY=VALUE", "--properties-file", "--defaults", "--num-workers"):
        assert option in out.stdout
    # Defaults shown in the help come from conf/sparkdl-defaults.conf.
    if job == "train":
        assert "(default: 8)" in out.stdout  # sparkdl.train.epochs


def test_properties_format(tmp_path: Path, jobs: Any) -> None:
    path = tmp_path / "x.conf"
    path.write_text(
        "# comment\n! also a comment\n\n"
        "spark.a   1\n"
        "spark.b=two words\n"
        "spark.c : -Dx=1 -Dy=2\n"
        "spark.d\tvalue\n"
    )
    assert jobs.common.read_properties(path) == {
        "spark.a": "1", "spark.b": "two words", "spark.c": "-Dx=1 -Dy=2", "spark.d": "value",
    }


def test_shipped_defaults_are_valid_for_every_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, jobs: Any) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the temp dir the defaults go under
    etl = jobs.etl.parse_args([])
    train = jobs.train.parse_args([])
    inference = jobs.inference.parse_args([])
    # Data, model and predictions: this user's private directory, resolved when the job runs.
    mine = tmp_path / f"sparkdl-{os.getuid()}"
    assert etl.data == train.data == inference.data == str(mine / "jobs" / "digits")
    assert train.model == inference.model == str(mine / "jobs" / "model")
    assert inference.output == str(mine / "jobs" / "predictions")
    for directory in (mine, mine / "jobs"):
        info = directory.lstat()
        assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    assert etl.overwrite is True and etl.test_fraction == 0.2
    assert (train.epochs, train.batch_size, train.lr, train.num_workers) == (8, 32, 0.05, 2)
    assert inference.batch_size == 1024  # sparkdl.inference.batch-size, not train's
    assert train.master is None and train.conf == []
    images = jobs.images.parse_args([])
    assert images.images == str(mine / "jobs" / "digit-images") and images.pipeline == str(mine / "jobs" / "image-pipeline")
    assert (images.epochs, images.image_size, images.min_accuracy, images.num_workers) == (5, 16, 0.85, 2)


def test_a_default_location_that_is_not_private_ends_the_job_and_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, jobs: Any
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = tmp_path / f"sparkdl-{os.getuid()}"
    mine.mkdir()
    mine.chmod(0o777)  # as if created by someone else's umask, or on purpose
    with pytest.raises(SystemExit) as exc:
        jobs.train.parse_args([])
    assert str(mine) in str(exc.value.code) and "--data" in str(exc.value.code)
    assert list(mine.iterdir()) == []
    # A path the user gave is theirs to choose, and inference needs DATA only without --input.
    args = jobs.inference.parse_args(["--model", str(mine / "m"), "--output", str(mine / "o"), "--input", str(mine / "t")])
    assert (args.model, args.output, args.data) == (str(mine / "m"), str(mine / "o"), None)
    assert list(mine.iterdir()) == []


def test_command_line_wins_over_job_keys_which_win_over_shared_keys(tmp_path: Path, jobs: Any) -> None:
    conf = tmp_path / "mine.conf"
    conf.write_text(
        "sparkdl.jobs.num-workers 3\nsparkdl.jobs.data /d\nsparkdl.jobs.model /m\n"
        "sparkdl.jobs.epochs 2\nsparkdl.train.epochs 4\nsparkdl.etl.overwrite false\n"
    )
    args = jobs.train.parse_args(["--defaults", str(conf), "--conf", "spark.x=1", "--conf", "spark.y=a=b"])
    assert (args.epochs, args.num_workers, args.data) == (4, 3, "/d")
    assert args.conf == [("spark.x", "1"), ("spark.y", "a=b")]
    args = jobs.train.parse_args(["--defaults", str(conf), "--epochs", "6", "--num-workers", "1"])
    assert (args.epochs, args.num_workers) == (6, 1)
    assert jobs.etl.parse_args(["--defaults", str(conf)]).overwrite is False


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("sparkdl.train.epoch 3", "jobs/train.py has no option --epoch"),
        ("spark.executor.memory 2g", "unknown key 'spark.executor.memory'"),
        ("sparkdl.train.epochs many", "'many' is not valid"),
        ("sparkdl.etl.overwrite yes", "expected true or false"),
    ],
)
def test_bad_defaults_are_named(tmp_path: Path, jobs: Any, capsys: pytest.CaptureFixture[str], line: str, message: str) -> None:
    conf = tmp_path / "bad.conf"
    conf.write_text(f"sparkdl.jobs.data /d\nsparkdl.jobs.model /m\n{line}\n")
    job = jobs.etl if "etl" in line else jobs.train
    with pytest.raises(SystemExit) as exc:
        job.parse_args(["--defaults", str(conf)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and str(conf) in err


def test_bad_conf_option_is_a_usage_error(jobs: Any, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        jobs.train.parse_args(["--conf", "no-equals-sign"])
    assert "--conf takes KEY=VALUE" in capsys.readouterr().err
