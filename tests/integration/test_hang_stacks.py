"""A hang tells where it hangs: the failure report of a run on Spark carries each live rank's
Python stack, and names the earliest failure by the time it happened on its host. The same with
ranks on the driver, and the report's parts, are in tests/unit/driver/test_hang_report.py."""

from __future__ import annotations

import sys
import time

import cloudpickle
import pytest
from resources.hang_ranks import _stack_of, rank_1_naps_while_rank_0_all_reduces

import sparkdl

# The rank functions travel by value, as a notebook's do; their frames still name this file.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

CFG = sparkdl.RunConfig(start_timeout_s=60, slot_wait_s=2, connect_timeout_s=20, kill_grace_s=20,
                        log_tail_lines=40)


@pytest.mark.fault
def test_a_collective_timeout_reports_where_the_other_rank_was(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    with pytest.raises(sparkdl.RunFailedError) as info:
        sparkdl.run(rank_1_naps_while_rank_0_all_reduces, 120.0, num_workers=2, max_attempts=1,
                    config=CFG.replace(collective_timeout_s=3.0))
    report = str(info.value)
    assert time.monotonic() - start < 60
    # Rank 0 waited in the collective and failed there: its own traceback says so.
    assert "Root cause: attempt 0, rank 0" in report
    assert "all_reduce" in report and "failed at " in report and " UTC (its host's clock)" in report
    # Rank 1 still ran: its stack, asked for when rank 0 failed, shows the user's sleep.
    rank1 = _stack_of(report, 1)
    assert "when rank 0 failed" in rank1
    assert "in rank_1_naps_while_rank_0_all_reduces" in rank1 and "time.sleep(nap_s)" in rank1
    # Innermost first; the function's callers inside sparkdl are left out.
    assert "sparkdl/_internal/rank/main.py" not in rank1 and "frames of sparkdl that called the function" in rank1


def nap_on_rank_0() -> None:
    time.sleep(120)


def nap_on_rank_1() -> None:
    time.sleep(120)


def both_nap() -> None:
    if sparkdl.context().rank == 0:
        nap_on_rank_0()
    else:
        nap_on_rank_1()


@pytest.mark.fault
def test_timeout_s_reports_every_running_ranks_stack(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    with pytest.raises(sparkdl.RunTimeoutError, match=r"timeout_s=3 s") as info:
        sparkdl.run(both_nap, num_workers=2, config=CFG.replace(timeout_s=3.0))
    assert time.monotonic() - start < 60
    report = str(info.value)
    for rank in (0, 1):
        stack = _stack_of(report, rank)
        assert "when the run was stopped" in stack
        assert f"in nap_on_rank_{rank}" in stack and "time.sleep(120)" in stack
        assert f"nap_on_rank_{1 - rank}" not in stack
        assert "in both_nap" in stack  # the caller too: frames are innermost first, then outward
