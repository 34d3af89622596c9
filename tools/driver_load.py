"""The driver of a gang of hundreds, under load: N simulated Spark tasks against the real driver side.

The driver side is sparkdl's own, in this process: the authenticated channel server, the monitor
(records, go-ahead, stack requests), the output sinks (a file per rank, the console), the metrics
log, and the failure report. Only the tasks and their ranks are played, by a child process
(``python tools/driver_load.py --tasks ...``) with one thread per task, each with its own real
connection: it authenticates, checks in (Hello, Gang), takes its go-ahead, says its rank started,
prints a burst of lines and sends metrics, and then ends (Exited 0), or, in a failing gang, rank 0
fails and every other rank answers the driver's request for its stacks with the same stack, as a
gang stopped in one collective does. Spark's scheduling is not played: the tasks connect at once.

:func:`drive` returns what it measured and checked; benchmarks/bench_driver_scale.py prints it for
N = 64, 256, 1,024, and tests/integration/test_driver_scale.py runs N = 256.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.driver.monitor import Monitor
from sparkdl._internal.driver.output import RankOutput, dedupes
from sparkdl._internal.driver.progress import MetricsLog, Progress
from sparkdl._internal.driver.report import build_report
from sparkdl._internal.wire.channel import connect
from sparkdl._internal.wire.messages import (
    DumpStacks,
    Exited,
    Gang,
    GoAhead,
    Hello,
    LogLine,
    LogLines,
    Metric,
    RankState,
    Stacks,
    Started,
    encode,
)
from sparkdl._internal.wire.server import ChannelServer

# What every rank of a failing gang is doing when asked: waiting in one collective.
STACK = (
    "Current thread 0x{tid:x} (most recent call first):\n"
    '  File "/site-packages/torch/distributed/distributed_c10d.py", line 2501 in all_reduce\n'
    '  File "/app/train.py", line 40 in train\n'
    '  File "/site-packages/sparkdl/_internal/rank/main.py", line 120 in main\n'
)
ERROR = "ValueError: bad batch 17"


def line_text(rank: int, i: int, width: int) -> str:
    """Line ``i`` of ``rank``: every 4th the same on every rank (a progress message, a library's
    warning), the others the rank's own."""
    if i % 4 == 0:
        return f"every rank's line {i} " + "x" * width
    return f"rank {rank} line {i} " + "x" * width


class _Console:
    """The driver's stdout during a load: lines counted, not kept."""

    def __init__(self) -> None:
        self.lines = 0

    def write(self, text: str) -> int:
        self.lines += text.count("\n")
        return len(text)

    def flush(self) -> None:
        pass


@dataclass
class Load:
    ranks: int
    lines: int = 100  # a burst of this many lines from every rank, as fast as the tasks send
    rate: float = 0.0  # > 0: instead, the lines come steadily, this many a second from every rank,
    #                    with a metric record every 0.1 s (the lines and metrics counts follow from it)
    width: int = 80
    metrics: int = 20  # log_metrics records from every rank
    fail: bool = False  # rank 0 fails; the others are stopped in a collective
    timeout_s: float = 600.0
    # > 0: the lines go as a task's relay sends them (sparkdl._internal.task.rankproc): those that come
    # within this window in one frame (a burst: frames of up to 64 KiB); 0: one frame a line.
    batch_s: float = 0.0

    @classmethod
    def steady(cls, ranks: int, rate: float, seconds: float, timeout_s: float = 600.0, batch_s: float = 0.0) -> Load:
        """Every rank printing ``rate`` lines a second and logging 10 metric records a second, for ``seconds``."""
        return cls(ranks, lines=round(rate * seconds), metrics=round(10 * seconds), rate=rate, timeout_s=timeout_s,
                   batch_s=batch_s)


@dataclass
class Measured:
    ranks: int
    checkin_s: float = 0.0  # the first connection to the last go-ahead
    checkin_cpu_s: float = 0.0  # the driver's CPU time over it
    rss_per_rank_kib: float = 0.0  # the driver's resident memory added per checked-in rank
    relay_s: float = 0.0  # the burst's start to every line in its rank's file
    relay_cpu_s: float = 0.0
    lines: int = 0
    console_lines: int = 0  # what the console showed (RunConfig.console="auto": deduplicated)
    metrics: int = 0
    report_s: float | None = None  # the failure to a complete report (every stack in)
    report_lines: int | None = None
    report: str | None = None
    problems: list[str] = field(default_factory=list)


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def _wait(cond: threading.Condition, what: Any, deadline: float, name: str, child: subprocess.Popen[str]) -> None:
    with cond:
        while not what():
            left = deadline - time.monotonic()
            if left <= 0 or child.poll() not in (None, 0):
                why = "in time" if left <= 0 else f"(the load generator exited with {child.returncode})"
                raise TimeoutError(f"driver_load: {name} did not happen {why}")
            cond.wait(min(left, 0.5))


def drive(load: Load, workdir: Path) -> Measured:
    """Runs ``load`` against a real driver side; the lines go to ``workdir/logs``, the console to
    a counter (its thread does the work it would do for a terminal)."""
    n = load.ranks
    out = Measured(n)
    # A connection and a thread per rank: lift this process's descriptor limit to its hard limit.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    cfg = RunConfig(progress=False, log_tail_lines=5)
    console = _Console()
    saved, sys.stdout = sys.stdout, console
    output = RankOutput(workdir / "logs", echo=True, dedupe=dedupes(cfg.console, n), world_size=n)
    metrics = MetricsLog(workdir / "metrics.jsonl")
    monitor = Monitor(n, 1, cfg, None, metrics, Progress(1.0, enabled=False), output=output)
    secret = os.urandom(32)
    deadline = time.monotonic() + load.timeout_s
    child: subprocess.Popen[str] | None = None
    try:
        # As the driver makes it (sparkdl/_internal/driver/spark.py): the default handshake limits.
        with ChannelServer("127.0.0.1", secret, monitor.on_message, monitor.on_close,
                           handshake_timeout_s=cfg.handshake_timeout_s) as server:
            rss0, cpu0, t0 = _rss_kib(), time.process_time(), time.monotonic()
            child = subprocess.Popen(
                [sys.executable, __file__, "--tasks", json.dumps({**load.__dict__, "host": server.address[0],
                                                                  "port": server.address[1], "secret": secret.hex()})],
                stdin=subprocess.PIPE, text=True)

            def running() -> bool:
                return len(monitor.records) == n and all(r.state is not RankState.STARTING for r in monitor.records.values())

            _wait(monitor.cond, running, deadline, f"the check-in of {n} ranks", child)
            out.checkin_s, out.checkin_cpu_s = time.monotonic() - t0, time.process_time() - cpu0
            out.rss_per_rank_kib = (_rss_kib() - rss0) / n
            # The burst: every task sends its lines and metrics at once.
            cpu1, t1 = time.process_time(), time.monotonic()
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
            if load.fail:
                def stacked() -> bool:
                    recs = monitor.records
                    return recs[(0, 0)].failed and all(recs[(0, r)].stack for r in range(1, n))

                _wait(monitor.cond, stacked, deadline, "rank 0's failure and every peer's stack", child)
                failed_at = monitor.records[(0, 0)].failed_at
                report, _ = build_report(monitor.sorted_records(), headline="sparkdl.run failed", hint="(the hint)")
                out.report_s = time.monotonic() - (failed_at or 0.0)
                out.report, out.report_lines = report, len(report.splitlines())
                child.stdin.write("end\n")  # the driver stops the attempt: the tasks' connections end
                child.stdin.flush()
            else:
                _wait(monitor.cond, lambda: all(r.state is RankState.SUCCEEDED for r in monitor.records.values()),
                      deadline, f"{n} ranks ending", child)
            left = server.drain(max(1.0, deadline - time.monotonic()))
            if left:
                out.problems.append(f"{left} connection(s) still open after the run")
            undelivered = output.close(max(1.0, deadline - time.monotonic()))
            out.relay_s, out.relay_cpu_s = time.monotonic() - t1, time.process_time() - cpu1
            if undelivered:
                out.problems.append(f"not delivered: {undelivered}")
        child.wait(max(1.0, deadline - time.monotonic()))
        if child.returncode != 0:
            out.problems.append(f"the load generator exited with {child.returncode}")
    finally:
        sys.stdout = saved
        out.console_lines = console.lines
        metrics.close()
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
    _check(load, workdir, monitor, out)
    return out


def _check(load: Load, workdir: Path, monitor: Monitor, out: Measured) -> None:
    """Every line whole and once, in order, in its rank's file; every metric once."""
    for rank in range(load.ranks):
        path = workdir / "logs" / f"rank-{rank}.log"
        got = path.read_text().splitlines() if path.exists() else []
        out.lines += len(got)
        if got != [line_text(rank, i, load.width) for i in range(load.lines)]:
            out.problems.append(f"rank {rank}: {len(got)} of {load.lines} lines, or not as sent")
            break
    out.metrics = len(monitor.metrics.records)
    keys = {(m["rank"], m["step"]) for m in monitor.metrics.records}
    if out.metrics != load.ranks * load.metrics or len(keys) != out.metrics:
        out.problems.append(f"{out.metrics} metric records, {len(keys)} distinct, of {load.ranks * load.metrics}")


# ---- the simulated tasks (the child process) ---------------------------------------------------


def _task(rank: int, spec: dict[str, Any], secret: bytes, go: threading.Event, end: threading.Event) -> None:
    n, width = spec["ranks"], spec["width"]
    conn = connect((spec["host"], spec["port"]), secret, timeout=60)
    try:
        conn.send(encode(Hello(f"sim-host-{rank // 8}", 100_000 + rank, rank), rank=rank, attempt=-1))
        conn.send(encode(Gang(tuple(range(n))), rank=rank, attempt=-1))
        reply = GoAhead.decode(conn.recv(timeout=60))
        assert reply.go and reply.attempt is not None, reply
        attempt = reply.attempt
        conn.send(encode(Started(200_000 + rank), rank=rank, attempt=attempt))
        go.wait()
        if spec["rate"]:
            _steady(conn, rank, attempt, spec)
        elif spec["batch_s"]:
            per_frame = max(1, 64 * 1024 // (width + 1))
            for i in range(0, spec["lines"], per_frame):
                texts = tuple(line_text(rank, j, width) for j in range(i, min(i + per_frame, spec["lines"])))
                conn.send(encode(LogLines("o", texts), rank=rank, attempt=attempt))
            for step in range(spec["metrics"]):
                conn.send(encode(Metric({"step": step, "loss": 1.0 / (step + 1)}), rank=rank, attempt=attempt))
        else:
            for i in range(spec["lines"]):
                conn.send(encode(LogLine("o", line_text(rank, i, width)), rank=rank, attempt=attempt))
            for step in range(spec["metrics"]):
                conn.send(encode(Metric({"step": step, "loss": 1.0 / (step + 1)}), rank=rank, attempt=attempt))
        if not spec["fail"]:
            conn.send(encode(Exited(0, None), rank=rank, attempt=attempt))
        elif rank == 0:
            conn.send(encode(Exited(1, None, ERROR, "Traceback ...", time.time()), rank=rank, attempt=attempt))
        else:
            while (frame := conn.recv(timeout=120)) is not None and not DumpStacks.asked(frame):
                pass
            conn.send(encode(Stacks(200_000 + rank, STACK.format(tid=0x7F0000 + rank)), rank=rank, attempt=attempt))
            end.wait(120)
    finally:
        conn.close()


def _steady(conn: Any, rank: int, attempt: int, spec: dict[str, Any]) -> None:
    """``spec["lines"]`` lines at ``spec["rate"]`` a second, a metric after every tenth of a second's."""
    rate, every, window = spec["rate"], spec["lines"] // spec["metrics"], spec["batch_s"]
    start = time.monotonic()
    pending: list[str] = []
    for i in range(spec["lines"]):
        if (wait := start + i / rate - time.monotonic()) > 0:
            time.sleep(wait)
        pending.append(line_text(rank, i, spec["width"]))
        # With a window: the lines that came within it of the first go together (rate x window of them).
        if not window or i + 1 == spec["lines"] or len(pending) >= rate * window:
            message = LogLine("o", pending[0]) if len(pending) == 1 else LogLines("o", tuple(pending))
            conn.send(encode(message, rank=rank, attempt=attempt))
            pending = []
        if i % every == every - 1:
            step = i // every
            conn.send(encode(Metric({"step": step, "loss": 1.0 / (step + 1)}), rank=rank, attempt=attempt))


def _tasks(spec: dict[str, Any]) -> int:
    secret = bytes.fromhex(spec["secret"])
    go, end = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            _task(rank, spec, secret, go, end)
        except BaseException as exc:  # the driver's wait fails on it; the first are printed
            errors.append(exc)
            if len(errors) <= 5:
                print(f"driver_load: task {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    threading.stack_size(256 * 1024)
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(spec["ranks"])]
    for t in threads:
        t.start()
    for command in sys.stdin:
        if command.strip() == "go":
            go.set()
        elif command.strip() == "end":
            end.set()
            break
        if not spec["fail"]:
            break
    for t in threads:
        t.join(spec["timeout_s"])
    return 1 if errors else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The simulated tasks of tools/driver_load.py (started by drive()).")
    parser.add_argument("--tasks", required=True, help="the load and the driver's address, as JSON")
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    sys.exit(_tasks(json.loads(parser.parse_args().tasks)))
