"""The driver's cost per rank, for gangs of 64, 256 and 1,024 simulated ranks (tools/driver_load.py):
the real channel, monitor, output sinks and report in this process; the tasks played by a child.

For each N, two gangs: one whose ranks each print a burst of lines and send metrics, then end;
and one whose rank 0 fails while the others are stopped in a collective, which times the report.
Prints, per N: check-in (first connection to last go-ahead) wall and driver CPU time, the
driver's resident memory per rank, the burst relayed (lines/s, driver CPU per line; every line
checked whole, once and in order in its rank's file; a quarter of them alike on every rank, and
the lines the deduplicated console showed), and the failure report (time from the
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

from driver_load import Load, drive


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
          f"{'lines':>10} {'console':>9} {'lines/s':>9} {'cpu us/line':>12} {'report s':>9} {'report lines':>13}")
    bad = 0
    for n in args.ranks:
        with tempfile.TemporaryDirectory() as burst_dir, tempfile.TemporaryDirectory() as fail_dir:
            burst = drive(Load(n, lines=args.lines, metrics=args.metrics), Path(burst_dir))
            failed = drive(Load(n, lines=10, metrics=1, fail=True), Path(fail_dir))
        rate = burst.lines / burst.relay_s if burst.relay_s else 0.0
        per_line = burst.relay_cpu_s / burst.lines * 1e6 if burst.lines else 0.0
        print(f"{n:>6} {burst.checkin_s:>11.2f} {burst.checkin_cpu_s:>7.2f} {burst.checkin_cpu_s / n * 1000:>12.2f} "
              f"{burst.rss_per_rank_kib:>13.0f} {burst.lines:>10} {burst.console_lines:>9} {rate:>9.0f} {per_line:>12.1f} "
              f"{failed.report_s or 0:>9.2f} {failed.report_lines or 0:>13}")
        for problem in burst.problems + failed.problems:
            bad += 1
            print(f"  PROBLEM at {n} ranks: {problem}")
    return 1 if bad else 0


def steady(ranks: list[int], rate: float, seconds: float) -> int:
    """A steady load: what it offers, what the driver wrote, its CPU share, how far behind it ended."""
    print(f"{'ranks':>6} {'offered lines/s':>16} {'written lines/s':>16} {'metrics':>8} {'driver cpu':>11} "
          f"{'behind at end s':>16} {'console':>9}")
    bad = 0
    for n in ranks:
        with tempfile.TemporaryDirectory() as work:
            m = drive(Load.steady(n, rate, seconds), Path(work))
        print(f"{n:>6} {n * rate:>16.0f} {m.lines / m.relay_s:>16.0f} {m.metrics:>8} "
              f"{m.relay_cpu_s / m.relay_s:>10.0%} {m.relay_s - seconds:>16.2f} {m.console_lines:>9}")
        for problem in m.problems:
            bad += 1
            print(f"  PROBLEM at {n} ranks: {problem}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
