"""Ranks as processes on the driver alone, without Spark tasks: for development and notebooks.

This backs ``HorovodRunner(np=-N)`` and ``TorchDistributor(local_mode=True)``. Each rank is the
same rank process as on a cluster (``python -m sparkdl._rank``), with the same environment,
lifeline and clean-up, so code that runs here runs on the cluster too. There is no gang rerun
on the driver: a failure ends the run with the same report as ``sparkdl.run``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from sparkdl._report import RankRecord, build_report
from sparkdl.config import RunConfig
from sparkdl.errors import ConfigError, RunFailedError, RunTimeoutError
from sparkdl.worker import TaskPayload, _base_env, _gang_env, _kill_group, _read_error

_HOST = "127.0.0.1"


def _echo(stream: IO[bytes], rank: int, out: IO[str], record: RankRecord, tail_lines: int, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").removesuffix("\n")
        with lock:
            record.tail.append(line)
            del record.tail[:-tail_lines]
            out.write(f"[rank {rank}] {line}\n")
            out.flush()
    stream.close()


def run_on_driver(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    num_processes: int,
    backend: str = "torch",
    gpu_ids: list[str] | None = None,
    config: RunConfig | None = None,
) -> Any:
    """Runs ``fn`` on ``num_processes`` local rank processes; returns rank 0's return value.

    ``gpu_ids``: the driver's GPU addresses to hand out, one per rank, or None for CPU.
    """
    import cloudpickle

    from sparkdl.backends import get_backend
    from sparkdl.launch import _pickle_payload

    cfg = config or RunConfig()
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ConfigError(f"the number of processes must be an integer >= 1; got {num_processes!r}")
    if gpu_ids is not None and len(gpu_ids) < num_processes:
        raise ConfigError(
            f"{num_processes} processes need {num_processes} GPUs on the driver, but "
            f"spark.driver.resource.gpu lists {len(gpu_ids)} ({gpu_ids}); lower the number of processes"
        )
    get_backend(backend).check_driver()
    fn_bytes = _pickle_payload(fn, args, kwargs)
    run_id = secrets.token_hex(6)
    payload = TaskPayload(
        run_id=run_id, secret_hex="", driver_host=_HOST, driver_port=0, fn_bytes=fn_bytes,
        backend=backend, use_gpu=gpu_ids is not None, num_workers=num_processes,
        collective_timeout_s=cfg.collective_timeout_s, connect_timeout_s=cfg.connect_timeout_s,
        init_process_group=cfg.init_process_group, log_tail_lines=cfg.log_tail_lines,
        checkpoint_url=os.path.join(tempfile.gettempdir(), "sparkdl-runs", run_id, "checkpoints"),
        keep_checkpoints=cfg.keep_checkpoints,
    )
    root = Path(tempfile.mkdtemp(prefix=f"sparkdl-local-{run_id}-"))
    listener = socket.create_server((_HOST, 0), backlog=1024)
    hosts = [_HOST] * num_processes
    procs: list[subprocess.Popen[bytes]] = []
    lifelines: list[int] = []
    records = [RankRecord(attempt=0, rank=r, host=_HOST) for r in range(num_processes)]
    threads: list[threading.Thread] = []
    lock = threading.Lock()
    try:
        for rank in range(num_processes):
            workdir = root / f"rank-{rank}"
            workdir.mkdir()
            (workdir / "payload.pkl").write_bytes(fn_bytes)
            mine = [gpu_ids[rank]] if gpu_ids is not None else []
            env = _base_env(payload, rank, _HOST, mine)
            gang = _gang_env(payload, rank, 0, _HOST, hosts, listener.getsockname()[1], mine)
            lifeline_r, lifeline_w = os.pipe()
            control_r, control_w = os.pipe()
            # The gang is known before the rank starts: its control message is waiting for it.
            with os.fdopen(control_w, "w") as control:
                control.write(json.dumps(gang))
            env.update(SPARKDL_LIFELINE_FD=str(lifeline_r), SPARKDL_CONTROL_FD=str(control_r))
            pass_fds = [lifeline_r, control_r]
            if rank == 0:
                pass_fds.append(listener.fileno())
                env["SPARKDL_STORE_FD"] = str(listener.fileno())
            proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "sparkdl._rank", str(workdir)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env=env, pass_fds=pass_fds, start_new_session=True,
            )
            os.close(lifeline_r)
            os.close(control_r)
            lifelines.append(lifeline_w)
            procs.append(proc)
            records[rank].pid = proc.pid
            records[rank].state = "running"
            for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                assert stream is not None
                t = threading.Thread(target=_echo, args=(stream, rank, out, records[rank], max(cfg.log_tail_lines, 1), lock), daemon=True)
                t.start()
                threads.append(t)
        listener.close()
        return _wait(procs, records, root, cfg, threads, cloudpickle)
    finally:
        for fd in lifelines:
            os.close(fd)
        for proc in procs:
            _kill_group(proc.pid)
            proc.wait(timeout=10)
        listener.close()
        shutil.rmtree(root, ignore_errors=True)


def _wait(
    procs: list[subprocess.Popen[bytes]],
    records: list[RankRecord],
    root: Path,
    cfg: RunConfig,
    threads: list[threading.Thread],
    cloudpickle: Any,
) -> Any:
    started = time.monotonic()
    exited_at: dict[int, float] = {}

    def watch(rank: int, proc: subprocess.Popen[bytes]) -> None:
        proc.wait()
        # The exit time itself, not when the loop below notices: the root cause is the first to exit.
        exited_at[rank] = time.monotonic()

    for rank, proc in enumerate(procs):
        threading.Thread(target=watch, args=(rank, proc), daemon=True).start()
    while True:
        failed = False
        for rank, proc in enumerate(procs):
            rec = records[rank]
            if rank not in exited_at or rec.state != "running":
                continue
            code = proc.returncode
            if code == 0:
                rec.state = "succeeded"
                continue
            rec.state = "failed"
            rec.failed_at = exited_at[rank]
            rec.signal, rec.exit_code = (-code, None) if code < 0 else (None, code)
            rec.error, rec.traceback = _read_error(root / f"rank-{rank}")
            failed = True
        if all(r.state == "succeeded" for r in records):
            for t in threads:
                t.join(timeout=10)
            with open(root / "rank-0" / "result.pkl", "rb") as f:
                return cloudpickle.load(f)
        timed_out = cfg.timeout_s is not None and time.monotonic() - started > cfg.timeout_s
        if failed or timed_out:
            # One rank down means the others would wait on it: stop them, then report.
            time.sleep(0.5)
            for proc in procs:
                _kill_group(proc.pid)
            for t in threads:
                t.join(timeout=10)
            if timed_out and not failed:
                why = f"the run on the driver took longer than timeout_s={cfg.timeout_s:g} s (RunConfig.timeout_s)"
                report, _ = build_report(records, headline=f"sparkdl stopped: {why}.", hint="Raise timeout_s if the run needs longer.")
                raise RunTimeoutError(report, attempts=1, root_cause=why)
            report, root_line = build_report(
                records,
                headline=f"the run on the driver failed ({len(procs)} local processes; no reruns on the driver).",
                hint="Fix the root cause above; on a cluster, sparkdl.run reruns failed gangs.",
            )
            raise RunFailedError(report, attempts=1, root_cause=root_line)
        time.sleep(0.05)
