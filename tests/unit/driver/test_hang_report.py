"""The hang report without a JVM: ranks on the driver (the local launcher) blocked in a collective
or asleep tell where, by their Python stacks; the root cause is the earliest failure by its host's
clock; the stack messages and the failure time survive the wire; a long stack keeps its innermost
frames and is capped. The same on Spark is in tests/integration/test_hang_stacks.py.
"""

from __future__ import annotations

import time

import pytest
from resources.hang_ranks import _stack_of, rank_1_naps_while_rank_0_all_reduces

import sparkdl
from sparkdl._internal.driver.local import run_on_driver
from sparkdl._internal.driver.report import RankRecord, build_report, root_cause, trim_stack
from sparkdl._internal.wire.messages import DumpStacks, Exited, Stacks, decode, encode


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


def test_a_gang_of_1024_stopped_in_one_collective_reads_as_one_entry_with_one_stack() -> None:
    t, wall = time.monotonic(), 1_790_000_000.0

    def waiting(rank: int, where: str = "all_reduce") -> str:
        # The same place in every rank; the thread ids differ, as they do.
        return (f"Current thread 0x{0x7F0000 + rank:08x} (most recent call first):\n"
                f'  File "/torch/distributed/distributed_c10d.py", line 2501 in {where}\n'
                '  File "/app/train.py", line 40 in train\n')

    records = [RankRecord(attempt=0, rank=0, host="h0", pid=100, exit_code=1, state="failed",  # type: ignore[arg-type]
                          failed_at=t, failed_wall=wall, error="ValueError: bad batch 17", tail=["boom"])]
    for rank in range(1, 1024):
        records.append(RankRecord(attempt=0, rank=rank, host=f"h{rank // 8}", pid=100 + rank, state="running",  # type: ignore[arg-type]
                                  stack=waiting(rank, "barrier" if rank == 512 else "all_reduce"),
                                  stack_when="before it was stopped"))
    report, root = build_report(records, headline="failed", hint="fix it")
    lines = report.splitlines()
    assert root.startswith("attempt 0, rank 0 on h0 (pid 100)")
    assert len(lines) < 40, report
    # One entry and one stack for the 1,022 alike, the odd one out on its own, the root cause first.
    assert "  rank 0 on h0 (pid 100): exited with code 1: ValueError: bad batch 17  <- first failure of this attempt" in lines
    group = next(line for line in lines if line.startswith("  ranks "))
    assert group.startswith("  ranks 1-511, 513-1023 (1022 ranks on 128 hosts"), group
    assert report.count("in all_reduce") == 1 and report.count("in barrier") == 1
    assert any(line.startswith("  rank 512 on h64 (pid 612)") for line in lines), report


def test_a_ranks_stack_leaves_out_the_frames_of_sparkdl_that_called_the_function() -> None:
    import sparkdl._internal.rank.main as rank_main
    from sparkdl._internal.task.rankproc import with_source

    # As faulthandler writes it in the rank: the user's frames, then the rank process's own,
    # whose file is where this install keeps it (found by its module, wherever it moves).
    dump = ("Current thread 0x0001 (most recent call first):\n"
            '  File "/app/train.py", line 40 in train\n'
            f'  File "{rank_main.__file__}", line 221 in _run\n'
            f'  File "{rank_main.__file__}", line 183 in main\n')
    shown = with_source(dump)
    assert "/app/train.py" in shown and "the frames of sparkdl that called the function are not shown" in shown
    assert rank_main.__file__ not in shown
