"""The Spark task side of a run: one barrier task per rank.

Each task checks in with the driver over the authenticated channel, rendezvouses with its gang
through ``BarrierTaskContext.allGather``, starts its rank in a process of its own, relays that
process's output to the driver line by line, and streams rank 0's return value back through
Spark. Whatever happens, the rank process and everything it started end with the task.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from sparkdl._channel import ChannelError, FramedConnection, connect
from sparkdl._spawn import RankProcess, start_rank

RESULT_CHUNK_BYTES = 16 * 1024 * 1024
_LOG_PIECE_CHARS = 1024 * 1024


@dataclass(frozen=True)
class TaskPayload:
    """Everything a task needs, as plain values: the only thing shipped from driver to tasks."""

    run_id: str
    secret_hex: str
    driver_host: str
    driver_port: int
    fn_bytes: bytes
    backend: str
    use_gpu: bool
    num_workers: int
    collective_timeout_s: float
    connect_timeout_s: float
    init_process_group: bool
    log_tail_lines: int
    checkpoint_url: str
    keep_checkpoints: int
    prewarm: bool = True


class RankFailed(RuntimeError):
    """Raised in a Spark task whose rank process failed; it fails the task, and Spark reruns the gang."""


def _host_of(address: str) -> str:
    host = address.rsplit(":", 1)[0] if ":" in address else address
    host = host.strip("[]")
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def _iface_for(ip: str) -> str | None:
    """Name of the network interface that holds ``ip`` (Linux), so gloo binds to it alone."""
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None


class _Relay:
    """Copies one output stream of the rank process to the driver, line by line, never cutting one."""

    def __init__(
        self,
        stream: IO[bytes],
        kind: str,
        link: _DriverLink,
        tail: deque[str],
        local_echo: IO[str],
    ) -> None:
        self._stream = stream
        self._kind = kind
        self._link = link
        self._tail = tail
        self._echo = local_echo
        self.thread = threading.Thread(target=self._run, name=f"sparkdl-relay-{kind}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for raw in iter(self._stream.readline, b""):
            self._link.ready.wait()
            line = raw.decode("utf-8", errors="replace")
            if line.endswith("\n"):
                line = line[:-1]
            if self._kind == "m":
                # One JSON object a line, written by context().log_metrics in the rank.
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                self._link.send({"t": "metric", "m": record})
                continue
            self._tail.append(line)
            # Very long lines travel in pieces that the driver joins back into one line.
            pieces = [line[i : i + _LOG_PIECE_CHARS] for i in range(0, len(line), _LOG_PIECE_CHARS)] or [""]
            for i, piece in enumerate(pieces):
                if not self._link.send({"t": "log", "s": self._kind, "l": piece, "more": i < len(pieces) - 1}):
                    # The driver is unreachable: keep the line in the executor's log instead.
                    self._echo.write(line + "\n")
                    break
        self._stream.close()


def task_main(payload: TaskPayload, batches: Iterator[Any]) -> Iterator[Any]:
    """The function of the barrier ``mapInArrow`` stage; yields rank 0's result as Arrow chunks."""
    import pyarrow as pa
    from pyspark import BarrierTaskContext

    for _ in batches:
        pass
    ctx = BarrierTaskContext.get()
    rank = ctx.partitionId()
    host = _host_of(ctx.getTaskInfos()[rank].address)
    secret = bytes.fromhex(payload.secret_hex)
    conn = connect((payload.driver_host, payload.driver_port), secret, payload.connect_timeout_s)
    link = _DriverLink(conn, rank)
    workdir = Path(tempfile.mkdtemp(prefix=f"sparkdl-{payload.run_id}-r{rank}-"))
    listener: socket.socket | None = None
    proc: RankProcess | None = None
    lifeline_w: int | None = None
    control_w: int | None = None
    relays: list[_Relay] = []
    try:
        gpu_ids = _assigned_gpus(ctx, payload, rank)
        (workdir / "payload.pkl").write_bytes(payload.fn_bytes)
        if rank == 0:
            listener = socket.create_server((host, 0), backlog=1024)
        # The rank process starts now, while the gang forms. Importing torch is the longest step
        # of a launch on a warm executor: the rank is forked from a zygote that did it already.
        lifeline_r, lifeline_w = os.pipe()
        control_r, control_w = os.pipe()
        metrics_r, metrics_w = os.pipe()
        env = _base_env(payload, rank, host, gpu_ids)
        fds = {"lifeline": lifeline_r, "control": control_r, "metrics": metrics_w}
        if listener is not None:
            fds["store"] = listener.fileno()
        proc = start_rank(
            str(workdir),
            env,
            fds,
            name=f"sparkdl-rank{rank}",
            prewarm=payload.prewarm,
            timeout_s=payload.connect_timeout_s,
        )
        os.close(lifeline_r)
        os.close(control_r)
        os.close(metrics_w)
        tail: deque[str] = deque(maxlen=max(payload.log_tail_lines, 1))
        assert proc.stdout is not None and proc.stderr is not None
        relays = [
            _Relay(proc.stdout, "o", link, tail, sys.stdout),
            _Relay(proc.stderr, "e", link, tail, sys.stderr),
            _Relay(os.fdopen(metrics_r, "rb"), "m", link, tail, sys.stderr),
        ]

        tid = ctx.taskAttemptId()
        link.send({"t": "hello", "host": host, "task_pid": os.getpid(), "tid": tid})
        port = listener.getsockname()[1] if listener else None
        members = [json.loads(m) for m in ctx.allGather(json.dumps({"host": host, "port": port, "tid": tid}))]
        hosts = [m["host"] for m in members]
        # PySpark tasks cannot see their stage attempt number; the driver numbers attempts by the
        # set of task ids that formed each gang, which every rank of a gang reports identically.
        link.send({"t": "gang", "tids": sorted(m["tid"] for m in members)})
        reply = conn.recv(timeout=payload.connect_timeout_s)
        if not reply or reply.get("go") is not True:
            raise RankFailed(f"sparkdl driver stopped rank {rank}: {(reply or {}).get('reason', 'no reply')}")
        attempt = int(reply["attempt"])
        link.attempt = attempt

        with os.fdopen(control_w, "w") as control:
            control_w = None
            control.write(json.dumps(_gang_env(payload, rank, attempt, host, hosts, members[0]["port"], gpu_ids)))
        if listener is not None:
            # Only the rank 0 process holds the store's socket from here on.
            listener.close()
            listener = None
        link.send({"t": "started", "pid": proc.pid})
        link.ready.set()
        code = proc.wait()
        # Children the rank left behind (DataLoader workers, ...) would hold the pipes open.
        _kill_group(proc.pid)
        for relay in relays:
            relay.thread.join(timeout=10)

        if code != 0:
            error, tb = _read_error(workdir)
            exit_signal = -code if code < 0 else None
            link.send({
                "t": "exit",
                "code": None if exit_signal else code,
                "signal": exit_signal,
                "error": error,
                "traceback": tb,
            })
            how = f"was killed by signal {exit_signal}" if exit_signal else f"exited with code {code}"
            detail = f": {error}" if error else ""
            last = "\n".join(tail)
            raise RankFailed(f"sparkdl rank {rank} (attempt {attempt}) on {host} {how}{detail}\n{last}")

        link.send({"t": "exit", "code": 0, "signal": None})
        if rank == 0:
            yield from _result_batches(pa, workdir / "result.pkl")
    finally:
        link.ready.set()
        for fd in (lifeline_w, control_w):
            if fd is not None:
                os.close(fd)
        if proc is not None:
            _kill_group(proc.pid)
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)
        if listener is not None:
            listener.close()
        conn.close()
        shutil.rmtree(workdir, ignore_errors=True)


class _DriverLink:
    """The task's end of the channel: thread-safe sends tagged with rank and attempt."""

    def __init__(self, conn: FramedConnection, rank: int) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._ok = True
        self.rank = rank
        self.attempt = -1
        # Output lines wait for this: the attempt they belong to is known only once the gang formed.
        self.ready = threading.Event()

    def send(self, message: dict[str, Any]) -> bool:
        if not self._ok:
            return False
        message.update(r=self.rank, a=self.attempt)
        try:
            with self._lock:
                self._conn.send(message)
            return True
        except (OSError, ChannelError):
            self._ok = False
            return False


def _assigned_gpus(ctx: Any, payload: TaskPayload, rank: int) -> list[str]:
    if not payload.use_gpu:
        return []
    resources = ctx.resources()
    if "gpu" not in resources or not resources["gpu"].addresses:
        raise RankFailed(
            f"use_gpu=True but Spark assigned no GPU to the task of rank {rank}: set "
            "spark.task.resource.gpu.amount and spark.executor.resource.gpu.amount"
        )
    return list(resources["gpu"].addresses)


def _result_batches(pa: Any, path: Path) -> Iterator[Any]:
    with open(path, "rb") as f:
        index = 0
        while True:
            chunk = f.read(RESULT_CHUNK_BYTES)
            if not chunk and index > 0:
                return
            yield pa.RecordBatch.from_arrays(
                [pa.array([index], pa.int64()), pa.array([chunk], pa.binary())],
                names=["chunk", "data"],
            )
            index += 1


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _read_error(workdir: Path) -> tuple[str | None, str | None]:
    try:
        info = json.loads((workdir / "error.json").read_text())
        return info.get("error"), info.get("traceback")
    except (OSError, ValueError):
        return None, None


def _base_env(payload: TaskPayload, rank: int, host: str, gpu_ids: list[str]) -> dict[str, str]:
    """The rank process's environment at start, before the gang has formed."""
    env = dict(os.environ)
    env.update({
        # Set before torch starts, so the rank sees exactly the GPUs Spark assigned to its task.
        "CUDA_VISIBLE_DEVICES": ",".join(gpu_ids),
        "PYTHONUNBUFFERED": "1",
        "SPARKDL_RUN_ID": payload.run_id,
        "SPARKDL_RANK": str(rank),
        # The Python worker running this rank's Spark task (a forked rank's parent is the zygote).
        "SPARKDL_TASK_PID": str(os.getpid()),
        "SPARKDL_WORLD_SIZE": str(payload.num_workers),
        "SPARKDL_HOST": host,
        "SPARKDL_BACKEND": payload.backend,
        "SPARKDL_GPU_IDS": ",".join(gpu_ids),
        "SPARKDL_COLLECTIVE_TIMEOUT_S": str(payload.collective_timeout_s),
        "SPARKDL_INIT_PROCESS_GROUP": "1" if payload.init_process_group else "0",
        "SPARKDL_CHECKPOINT_DIR": payload.checkpoint_url,
        "SPARKDL_KEEP_CHECKPOINTS": str(payload.keep_checkpoints),
    })
    iface = _iface_for(host)
    if iface is not None:
        env.setdefault("GLOO_SOCKET_IFNAME", iface)
    return env


def _gang_env(
    payload: TaskPayload,
    rank: int,
    attempt: int,
    host: str,
    hosts: list[str],
    master_port: int,
    gpu_ids: list[str],
) -> dict[str, str]:
    """What the rank learns once the gang has formed; sent to it over its control pipe."""
    if gpu_ids:
        # Each rank sees exactly its own GPUs, so its device is cuda:0 and LOCAL_RANK indexes them.
        local_rank, local_world = 0, 1
    else:
        local_rank, local_world = hosts[:rank].count(host), hosts.count(host)
    return {
        "MASTER_ADDR": hosts[0],
        "MASTER_PORT": str(master_port),
        "RANK": str(rank),
        "WORLD_SIZE": str(payload.num_workers),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world),
        "SPARKDL_LOCAL_RANK": str(local_rank),
        "SPARKDL_LOCAL_WORLD_SIZE": str(local_world),
        "SPARKDL_ATTEMPT": str(attempt),
        "SPARKDL_HOSTS": ",".join(hosts),
    }
