"""A hang tells where it hangs: the failure report carries each live rank's Python stack, and
names the earliest failure by the time it happened on its host."""

from __future__ import annotations

import sys
import time

import cloudpickle
import pytest

import sparkdl
from sparkdl.driver.local import run_on_driver
from sparkdl.driver.report import RankRecord, build_report, root_cause, trim_stack
from sparkdl.wire.messages import DumpStacks, Exited, Stacks, decode, encode

# The rank functions travel by value, as a notebook's do; their frames still name this file.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

CFG = sparkdl.RunConfig(start_timeout_s=60, slot_wait_s=2, connect_timeout_s=20, kill_grace_s=20,
                        log_tail_lines=40)


def _stack_of(report: str, rank: int) -> str:
    """The stack section of ``rank`` in the report: its label and its ``| `` lines."""
    lines = report.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(f"    stack of rank {rank} (pid ")]
    assert len(starts) == 1, f"no single stack section for rank {rank} in:\n{report}"
    section = [lines[starts[0]]]
    for line in lines[starts[0] + 1:]:
        if not line.startswith("    | "):
            break
        section.append(line)
    return "\n".join(section)


def rank_1_naps_while_rank_0_all_reduces(nap_s: float) -> None:
    import torch
    import torch.distributed as dist

    if sparkdl.context().rank == 1:
        time.sleep(nap_s)  # rank 1 is off in its own code
    dist.all_reduce(torch.ones(1))


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
    assert "sparkdl/rank/main.py" not in rank1 and "frames of sparkdl that called the function" in rank1


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


@pytest.mark.fault
def test_the_driver_local_launcher_reports_a_rank_blocked_inside_a_collective(no_leaks) -> None:  # type: ignore[no-untyped-def]
    cfg = sparkdl.RunConfig(timeout_s=10.0, collective_timeout_s=120.0, progress=False)
    with pytest.raises(sparkdl.RunTimeoutError) as info:
        run_on_driver(rank_1_naps_while_rank_0_all_reduces, (120.0,), {}, num_processes=2, config=cfg)
    report = str(info.value)
    # faulthandler needs no GIL: the rank blocked in gloo's all_reduce answers too.
    rank0 = _stack_of(report, 0)
    assert "distributed_c10d.py" in rank0 and " in all_reduce\n" in rank0
    assert "dist.all_reduce(torch.ones(1))" in rank0  # the user's line that called it
    rank1 = _stack_of(report, 1)
    assert "time.sleep(nap_s)" in rank1 and " in all_reduce\n" not in rank1
    assert "sparkdl_lifeline" not in report  # sparkdl's own watcher thread is left out


def test_the_root_cause_is_the_earliest_failure_by_its_hosts_clock_not_by_arrival() -> None:
    t, wall = time.monotonic(), 1_790_000_000.0
    heard_first = RankRecord(attempt=0, rank=0, host="h0", pid=10, exit_code=1, state="failed",  # type: ignore[arg-type]
                             failed_at=t + 1, failed_wall=wall + 0.5,
                             error="RuntimeError: Connection closed by peer")
    happened_first = RankRecord(attempt=0, rank=1, host="h1", pid=11, exit_code=1, state="failed",  # type: ignore[arg-type]
                                failed_at=t + 2, failed_wall=wall + 0.2, error="ValueError: bad batch",
                                tail=["boom"])
    records = [heard_first, happened_first]
    assert root_cause(records) is happened_first
    report, root = build_report(records, headline="failed", hint="fix it")
    assert root.startswith("attempt 0, rank 1 on h1 (pid 11)")
    assert "rank 1 on h1 (pid 11): exited with code 1: ValueError: bad batch  <- first failure" in report
    assert "failed at 2026-09-21 14:13:20.200 UTC (its host's clock)" in report
    assert "failed at 2026-09-21 14:13:20.500 UTC (its host's clock)" in report
    # Without the hosts' times, the driver's order stands.
    for rec in records:
        rec.failed_wall = None
    assert root_cause(records) is heard_first
    # A first failure that carries no host time (a lost task) is not reordered either.
    happened_first.failed_wall = wall
    assert root_cause(records) is heard_first


def test_the_stack_messages_and_the_failure_time_survive_the_wire() -> None:
    for message in (Stacks(4242, 'Current thread 0x1 (most recent call first):\n  File "f.py", line 1 in g'),
                    Stacks(None, None), Exited(1, None, "ValueError: bad", "tb", 1_790_000_000.25)):
        env = decode(encode(message, rank=1, attempt=2))
        assert (env.rank, env.attempt, env.message) == (1, 2, message)
    assert DumpStacks.asked(DumpStacks().encode()) and not DumpStacks.asked({"go": True, "attempt": 0})


def test_a_long_stack_keeps_the_innermost_frames_of_each_thread_and_is_capped() -> None:
    frames = "\n".join(f'  File "/app/deep.py", line {n} in level_{n}' for n in range(40))
    dump = f"Thread 0x0002 (most recent call first):\n{frames}\n\nCurrent thread 0x0001 (most recent call first):\n" \
           '  File "/app/main.py", line 7 in main\n'
    lines = trim_stack(dump, frames=5, max_lines=100)
    assert lines[0].startswith("Current thread")  # the thread the signal reached: the main one
    assert "level_0" in "\n".join(lines) and "level_4" in "\n".join(lines)
    assert "level_5" not in "\n".join(lines) and "  ... 35 outer frame(s) not shown" in lines
    assert len(trim_stack(dump, frames=40, max_lines=10)) == 11
