"""For the hang tests (tests/integration/test_hang_stacks.py, tests/unit/driver/test_hang_report.py):
a rank function that leaves rank 0 blocked in a collective while rank 1 sleeps, and the stack
section of one rank in a failure report. The rank function travels by value, as a notebook's
does; its frames still name this file."""

from __future__ import annotations

import sys
import time

import cloudpickle

import sparkdl

cloudpickle.register_pickle_by_value(sys.modules[__name__])


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
