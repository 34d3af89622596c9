"""The driver's cost per rank, for gangs of 64, 256 and 1,024 simulated ranks (tools/driver_load.py):
the real channel, monitor, output sinks and report in this process; the tasks played by a child.

For each N, two gangs: one whose ranks each print a burst of lines and send metrics, then end;
and one whose rank 0 fails while the others are stopped in a collective, which times the report.
Prints, per N: check-in (first connection to last go-ahead) wall and driver CPU time, the
driver's resident memory per rank, the burst relayed (lines/s, driver CPU per line; every line
checked whole, once and in order in its rank's file; a quarter of them alike on every rank, and
the lines the deduplicated console showed; once with one frame a line, the baseline, and once
in frames as a task's relay batches a burst), and the failure report (time from the
failure to a report with every stack, its length). Targets (issue 35): check-in of 1,024 ranks
<= 2 s of driver CPU, <= 1 MiB per rank, report <= 2 s, no lost or doubled line.

    .venv/bin/python benchmarks/bench_driver_scale.py [--ranks 64 256 1024] [--lines 10000]

``--steady 100``: instead, every rank prints 100 lines a second and logs 10 metric records a
second for ``--seconds`` (10): the lines a second offered and written, the driver's share of a
core, and how far behind the last line was written after the last was sent.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))

from driver_load import Load, Measured, drive

from sparkdl._internal.task.rankproc import BATCH_S


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--lines", type=int, default=10_000, help="lines each rank prints in its burst")
    parser.add_argument("--metrics", type=int, default=50, help="metric records each rank sends")
    parser.add_argument("--steady", type=float, metavar="RATE",
                        help="instead: every rank printing RATE lines a second (and 10 metrics a second) for --seconds")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    if args.steady:
        return steady(args.ranks, args.steady, args.seconds)
    print(f"{'ranks':>6} {'check-in s':>11} {'cpu s':>7} {'cpu ms/rank':>12} {'RSS KiB/rank':>13} "
          f"{'lines':>10} {'console':>9} {'lines/s':>9} {'cpu us/line':>12} {'batched/s':>10} {'cpu us/line':>12} "
          f"{'report s':>9} {'report lines':>13}")
    bad = 0
    for n in args.ranks:
        with tempfile.TemporaryDirectory() as burst_dir, tempfile.TemporaryDirectory() as batched_dir, \
                tempfile.TemporaryDirectory() as fail_dir:
            # One frame a line (the baseline), then frames as a task's relay sends a burst.
            burst = drive(Load(n, lines=args.lines, metrics=args.metrics), Path(burst_dir))
            batched = drive(Load(n, lines=args.lines, metrics=args.metrics, batch_s=BATCH_S), Path(batched_dir))
            failed = drive(Load(n, lines=10, metrics=1, fail=True), Path(fail_dir))

        def rates(m: Measured) -> tuple[float, float]:
            return (m.lines / m.relay_s if m.relay_s else 0.0), (m.relay_cpu_s / m.lines * 1e6 if m.lines else 0.0)

        (rate, per_line), (b_rate, b_per_line) = rates(burst), rates(batched)
        print(f"{n:>6} {burst.checkin_s:>11.2f} {burst.checkin_cpu_s:>7.2f} {burst.checkin_cpu_s / n * 1000:>12.2f} "
              f"{burst.rss_per_rank_kib:>13.0f} {burst.lines:>10} {burst.console_lines:>9} {rate:>9.0f} {per_line:>12.1f} "
              f"{b_rate:>10.0f} {b_per_line:>12.1f} {failed.report_s or 0:>9.2f} {failed.report_lines or 0:>13}")
        for problem in burst.problems + batched.problems + failed.problems:
            bad += 1
            print(f"  PROBLEM at {n} ranks: {problem}")
    return 1 if bad else 0


def steady(ranks: list[int], rate: float, seconds: float) -> int:
    """A steady load: what it offers, what the driver wrote, its CPU share, how far behind it ended;
    for each N twice: one frame a line (the baseline: tasks before batching) and frames of what a
    task's relay reads within its window (sparkdl._internal.task.rankproc.BATCH_S), the ratio between them."""
    print(f"{'ranks':>6} {'frames':>13} {'offered lines/s':>16} {'written lines/s':>16} {'metrics':>8} "
          f"{'driver cpu':>11} {'cpu us/line':>12} {'behind at end s':>16} {'console':>9}")
    bad = 0
    for n in ranks:
        per_line: dict[float, float] = {}
        for batch_s in (0.0, BATCH_S):
            with tempfile.TemporaryDirectory() as work:
                m = drive(Load.steady(n, rate, seconds, batch_s=batch_s), Path(work))
            per_line[batch_s] = m.relay_cpu_s / m.lines * 1e6 if m.lines else 0.0
            frames = f"{batch_s * 1000:g} ms batch" if batch_s else "one a line"
            print(f"{n:>6} {frames:>13} {n * rate:>16.0f} {m.lines / m.relay_s:>16.0f} {m.metrics:>8} "
                  f"{m.relay_cpu_s / m.relay_s:>10.0%} {per_line[batch_s]:>12.1f} {m.relay_s - seconds:>16.2f} "
                  f"{m.console_lines:>9}")
            for problem in m.problems:
                bad += 1
                print(f"  PROBLEM at {n} ranks: {problem}")
        if per_line[0.0] and per_line[BATCH_S]:
            print(f"{'':>6} driver CPU per line, batched / one frame a line: {per_line[BATCH_S] / per_line[0.0]:.2f}x")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
