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


# A driver of its own, so that the test sees its zygote end with it: RUNS runs of NPROCS ranks each
# print where rank 0 came from, then the driver waits for a line on stdin before it exits.
_DRIVER = r"""
import json, os, sys
import psutil
from sparkdl import RunConfig
from sparkdl._internal.driver.local import run_on_driver

def origin():
    parent = psutil.Process(os.getppid())
    return {"parent": parent.pid, "parent_name": parent.name()}

prewarm, runs, nprocs = sys.argv[1] == "1", int(sys.argv[2]), int(sys.argv[3])
for _ in range(runs):
    cfg = RunConfig(prewarm=prewarm, init_process_group=False, progress=False)
    print(json.dumps(run_on_driver(origin, (), {}, num_processes=nprocs, config=cfg)), flush=True)
sys.stdin.readline()
"""


def _origin_from_rank0(out: str) -> list[dict[str, object]]:
    import json

    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("prewarm", [True, False])
def test_ranks_on_the_driver_fork_from_a_zygote_that_ends_with_the_driver(prewarm: bool, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import time

    import psutil

    # Without prewarm each rank is a fresh interpreter (about 2 s of CPU): one run of one rank.
    runs, nprocs = (2, 2) if prewarm else (1, 1)
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, "1" if prewarm else "0", str(runs), str(nprocs)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tmp_path,
    )
    try:
        assert driver.stdout is not None and driver.stdin is not None
        seen = [_origin_from_rank0(driver.stdout.readline()) for _ in range(runs)]
        assert all(len(r) == 1 for r in seen), seen
        first, last = seen[0][0], seen[-1][0]
        if not prewarm:  # RunConfig(prewarm=False): a fresh interpreter, the driver's own child
            assert first["parent"] == driver.pid and first["parent_name"] != "sparkdl-zygote"
            return
        # Both runs forked from one zygote (torch imported once), a child of the driver.
        assert first["parent"] == last["parent"] != driver.pid, seen
        assert first["parent_name"] == "sparkdl-zygote"
        zygote = psutil.Process(int(first["parent"]))  # type: ignore[call-overload]
        assert zygote.ppid() == driver.pid and str(driver.pid) in zygote.cmdline()
        driver.stdin.write("done\n")
        driver.stdin.flush()
        assert driver.wait(timeout=60) == 0
        gone, _ = psutil.wait_procs([zygote], timeout=15)  # it watches the driver (pidfd, or a 1 s poll)
        assert gone, f"the driver's zygote (pid {zygote.pid}) outlived its driver"
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=30)
        deadline = time.monotonic() + 15
        for proc in psutil.process_iter(["name", "cmdline"]):
            if proc.info["name"] == "sparkdl-zygote" and str(driver.pid) in (proc.info["cmdline"] or []):
                psutil.wait_procs([proc], timeout=max(0.0, deadline - time.monotonic()))
