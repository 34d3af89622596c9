"""Ranks as processes on the driver (what TorchDistributor(local_mode=True) and HorovodRunner(np<0)
use) share the Spark launcher's rank start, relay, metrics, progress and policy. No JVM."""

from __future__ import annotations

import sys

import cloudpickle
import pytest

import sparkdl
from sparkdl._internal.driver.local import run_on_driver

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def reports_metrics() -> int:
    ctx = sparkdl.context()
    if ctx.rank == 0:
        ctx.log_metrics({"loss": 0.25, "epoch": 1}, step=3)
    print(f"rank {ctx.rank} of {ctx.world_size} says hi")
    return ctx.world_size


def test_metrics_and_progress_work_on_the_driver_too(no_leaks, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    cfg = sparkdl.RunConfig(progress_interval_s=0.1)
    assert run_on_driver(reports_metrics, (), {}, num_processes=2, config=cfg) == 2
    out, err = capsys.readouterr()
    assert "[rank 0] rank 0 of 2 says hi" in out and "[rank 1] rank 1 of 2 says hi" in out
    # The record reached the driver's progress line, not the rank's output.
    assert "sparkdl progress: attempt 0 | epoch 1 | step 3 | loss 0.25" in err
    assert "sparkdl metrics" not in out


def sleeps() -> None:
    import time

    time.sleep(120)


def test_a_hang_on_the_driver_is_stopped_by_timeout_s(no_leaks) -> None:  # type: ignore[no-untyped-def]
    cfg = sparkdl.RunConfig(timeout_s=2, init_process_group=False)
    with pytest.raises(sparkdl.RunTimeoutError, match=r"took longer than timeout_s=2 s \(RunConfig\.timeout_s\)"):
        run_on_driver(sleeps, (), {}, num_processes=2, config=cfg)


def test_bad_process_counts_are_refused_by_name() -> None:
    with pytest.raises(sparkdl.ConfigError, match=r"the number of processes must be an integer >= 1; got 0"):
        run_on_driver(print, (), {}, num_processes=0)
