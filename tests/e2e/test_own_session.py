"""A user's own SparkSession, built without PYSPARK_PYTHON (a Jupyter kernel of a venv, or
``.venv/bin/python script.py`` without activating the venv): its executors run pyspark's default,
``python3`` from PATH, which here is the system Python without pyarrow, torch or sparkdl.

In local modes the executors are on this machine, and sparkdl runs them on the driver's own
interpreter; on a cluster, sparkdl.run fails at once with the executor's own error, the Python it
ran and the setting that fixes it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import standalone_cluster
from conftest import REPO

from sparkdl._internal.driver.cluster import executor_error

ROOT = REPO
SYSTEM_PATH = "/usr/bin:/bin"

pytestmark = [pytest.mark.spark]


def _system_python_lacks_pyarrow() -> None:
    python3 = shutil.which("python3", path=SYSTEM_PATH)
    if python3 is None:
        pytest.skip(f"no python3 on {SYSTEM_PATH}: the situation under test cannot be made here")
    has = subprocess.run([python3, "-c", "import pyarrow"], capture_output=True, timeout=60).returncode == 0
    if has:
        pytest.skip(f"{python3} has pyarrow: a session without PYSPARK_PYTHON would just work here")


def _user_env(**extra: str) -> dict[str, str]:
    """A driver's environment as a user has it who did not activate the venv."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "VIRTUAL_ENV", "SPARK_HOME")}
    env.update(PATH=SYSTEM_PATH, SPARK_LOCAL_IP="127.0.0.1", **extra)
    return env


SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pyspark.sql import SparkSession
    import sparkdl

    spark = (SparkSession.builder.master(sys.argv[1]).config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").getOrCreate())

    def train():
        import torch, torch.distributed as dist
        t = torch.tensor([float(sparkdl.context().rank + 1)])
        dist.all_reduce(t)
        return t.item()

    started = time.monotonic()
    try:
        value = sparkdl.run(train, num_workers=2, config=sparkdl.RunConfig(start_timeout_s=60, timeout_s=120))
        print("VALUE", value)
    except sparkdl.ConfigError as exc:
        print("CONFIGERROR", round(time.monotonic() - started, 1), str(exc).replace("\\n", " "))
    print("PYTHONEXEC", spark.sparkContext.pythonExec)
    spark.stop()
    """
)


def _run_script(tmp_path: Path, master: str, env: dict[str, str]) -> dict[str, str]:
    script = tmp_path / "own_session.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script), master], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    found = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.stdout.splitlines()
             if line.split(" ", 1)[0] in ("VALUE", "CONFIGERROR", "PYTHONEXEC")}
    assert out.returncode == 0 and found, out.stdout[-2000:] + out.stderr[-4000:]
    return found


@pytest.mark.parametrize("master", ["local[2]", "local-cluster[2,1,1024]"])
def test_a_local_session_without_pyspark_python_runs_on_the_drivers_interpreter(
    master: str, tmp_path: Path, no_leaks: None
) -> None:
    _system_python_lacks_pyarrow()
    found = _run_script(tmp_path, master, _user_env())
    assert found.get("VALUE") == "3.0", found
    # The user's session is as it was: its own UDFs still run the Python it chose (the default).
    assert found["PYTHONEXEC"] == "python3"


@pytest.mark.one_stack("modern", "the executors' error is taken out of Spark's wrapper on both stacks by "
                        "test_the_executors_own_python_error_is_taken_out_of_sparks_wrapper")
@pytest.mark.cluster
def test_on_a_cluster_it_fails_at_once_with_the_executors_error_and_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _system_python_lacks_pyarrow()
    # The workers (and so their executors) find the system's python3 first on PATH.
    monkeypatch.setenv("PATH", SYSTEM_PATH + ":" + os.environ.get("PATH", ""))
    cluster = standalone_cluster.StandaloneCluster(1, cores=2, memory="1g", start_timeout_s=60)
    cluster.start()
    try:
        found = _run_script(tmp_path, cluster.master_url, _user_env())
    finally:
        alive = cluster.stop()
        cluster.cleanup()
    assert alive == []
    message = found.get("CONFIGERROR", "")
    assert "ModuleNotFoundError: No module named" in message, found
    assert "'python3'" in message and "spark.pyspark.python" in message and "PYSPARK_PYTHON" in message
    assert "awaitResult" not in message


def test_the_executors_own_python_error_is_taken_out_of_sparks_wrapper(spark: Any) -> None:
    def imports(_: Any) -> Any:
        import no_such_module_of_sparkdl_tests  # type: ignore[import-not-found]  # noqa: F401

        yield 1

    with pytest.raises(Exception) as info:
        spark.sparkContext.parallelize([0], 1).mapPartitions(imports).collect()
    assert executor_error(info.value) == "ModuleNotFoundError: No module named 'no_such_module_of_sparkdl_tests'"
    assert executor_error(RuntimeError("no traceback in here")) is None
