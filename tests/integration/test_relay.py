"""Runs whose driver the executors cannot reach: the ranks report through Spark itself.

With ``spark.sparkdl.channel=relay`` no task opens the channel to the driver: task 0 runs the
attempt's relay hub, and its signed record of the attempt comes back as rows of the Spark job,
which the driver replays into its monitor (sparkdl._internal.driver.relay). Here on a classic local[2]
session, where the mode is chosen by the conf; tests/e2e/test_connect.py runs it over Spark Connect
with a client the executors really cannot reach. The record's signature and its replay, without
Spark, are in tests/unit/driver/test_relay_record.py.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import cloudpickle
import pytest
from resources.relay_config import FAST

import sparkdl
from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.spark.spark_api import CHANNEL_MODE_CONF, ClassicApi

cloudpickle.register_pickle_by_value(sys.modules[__name__])



# ---- runs on a real local[2] session ------------------------------------------------------------

@pytest.fixture
def relayed(spark: Any) -> Iterator[Any]:
    spark.conf.set(CHANNEL_MODE_CONF, "relay")
    try:
        yield spark
    finally:
        spark.conf.unset(CHANNEL_MODE_CONF)


def greet_then_fail_once(how: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    ctx = sparkdl.context()
    print(f"hello from rank {ctx.rank} on attempt {ctx.attempt}", flush=True)
    ctx.log_metrics({"step": 1, "loss": 0.5 + ctx.rank})
    dist.barrier()
    if ctx.attempt == 0 and ctx.rank == 1:
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError("injected failure on rank 1")
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"attempt": ctx.attempt, "sum": t.item()}


@pytest.mark.spark
@pytest.mark.parametrize("how", ["raise", "sigkill"])
def test_a_relayed_run_reports_tagged_output_and_reruns_after_a_failed_rank(relayed, capfd, no_leaks, how: str) -> None:  # type: ignore[no-untyped-def]
    out = sparkdl.run(greet_then_fail_once, how, num_workers=2, max_attempts=3, config=FAST)
    assert out == {"attempt": 1, "sum": 2.0}
    stdout, stderr = capfd.readouterr()
    for line in ("[rank 0] hello from rank 0 on attempt 0", "[rank 1] hello from rank 1 on attempt 0",
                 "[rank 1, attempt 1] hello from rank 1 on attempt 1"):
        assert line in stdout
    if how == "raise":
        assert "ValueError: injected failure on rank 1" in stderr


def always_fails() -> None:
    ctx = sparkdl.context()
    print(f"working on attempt {ctx.attempt}", flush=True)
    if ctx.rank == 1:
        raise RuntimeError(f"broken on rank {ctx.rank}")
    time.sleep(120)  # rank 0 is here when its peer fails: the hub stops it, with its stack


@pytest.mark.spark
def test_a_relayed_run_that_keeps_failing_gives_the_full_report(relayed, no_leaks) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(sparkdl.RunFailedError) as info:
        sparkdl.run(always_fails, num_workers=2, max_attempts=2, config=FAST.replace(stop_on_repeated_error=False))
    err, report = info.value, str(info.value)
    assert err.attempts == 2 and "failed after 2 attempt(s)" in report
    assert "Attempt 0:" in report and "Attempt 1:" in report
    assert "Root cause: attempt 0, rank 1" in report and "RuntimeError: broken on rank 1" in report
    assert "| working on attempt 0" in report
    # Rank 0's stack, gathered by the hub when rank 1 failed, names where it waited.
    assert "stack of rank 0" in report and "time.sleep(120)" in report


def sleep_forever() -> None:
    print("sleeping", flush=True)
    time.sleep(3600)


@pytest.mark.spark
def test_a_relayed_run_is_bounded_by_timeout_s_in_its_hub(relayed, no_leaks) -> None:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    with pytest.raises(sparkdl.RunTimeoutError, match=r"timeout_s=3 s \(RunConfig.timeout_s\)") as info:
        sparkdl.run(sleep_forever, num_workers=2, config=FAST.replace(timeout_s=3.0))
    assert time.monotonic() - start < 60
    # Where each rank was when the hub stopped them, as on a reachable driver.
    assert str(info.value).count("time.sleep(3600)") == 2, str(info.value)


@pytest.mark.spark
def test_an_unknown_channel_mode_is_refused_naming_the_conf(spark) -> None:  # type: ignore[no-untyped-def]
    spark.conf.set(CHANNEL_MODE_CONF, "carrier-pigeon")
    try:
        with pytest.raises(ConfigError, match=r"spark.sparkdl.channel='carrier-pigeon' is not one of direct, relay"):
            ClassicApi(spark).channel_mode()
    finally:
        spark.conf.unset(CHANNEL_MODE_CONF)
    assert ClassicApi(spark).channel_mode() == "direct"
