"""One rank's process as both launchers run it: its pipes, its output relays, its end.

A Spark task (:mod:`sparkdl._internal.task.entry`) and the driver-local launcher
(:mod:`sparkdl._internal.driver.local`) start a rank the same way: :class:`RankProcess` writes the
cloudpickled function into the rank's workdir, starts the process (:func:`~sparkdl._internal.task.spawn.start_rank`)
with a lifeline, a control pipe and a metrics pipe, and copies its stdout, stderr and metrics,
line by line, to a :class:`Sink`: the driver's channel in a Spark task, the driver's monitor
itself on the driver. Once the gang is known, :meth:`RankProcess.tell_gang` sends it down the
control pipe. :meth:`RankProcess.dump_stacks` has the running rank write every thread's Python
stack (for the failure report) and goes on. Whatever happens, :meth:`RankProcess.close` ends the
rank and everything it started.
"""

from __future__ import annotations

import contextlib
import json
import linecache
import os
import re
import select
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from sparkdl._internal.common import proctree
from sparkdl._internal.common.net import iface_for
from sparkdl._internal.rank.main import LIFELINE_FRAME, STACK_SIGNAL
from sparkdl._internal.task.spawn import ProcessHandle, start_rank
from sparkdl._internal.wire import workdir_files
from sparkdl._internal.wire.messages import MAX_LINE_BYTES, Exited
from sparkdl._internal.wire.rankspec import GangSpec, RankSpec, gang_env, rank_env, write_secrets

# How long a rank has to write its stacks once signalled, and the most of them kept.
STACK_DUMP_S = 1.0
MAX_STACK_BYTES = 256 * 1024
_DUMP_SETTLED_S = 0.1
_FRAME = re.compile(r'\s*File "(?P<file>.+)", line (?P<line>\d+) in ')
# The frame of sparkdl's rank process that calls the user's function: its callers are sparkdl's.
_RUNNER = re.compile(r'\s*File ".*[/\\]sparkdl[/\\]_internal[/\\]rank[/\\]main\.py", line \d+ in _run$')


def with_source(dump: str) -> str:
    """faulthandler's dump as the report shows it, made here, on the rank's host, where its files
    are: each frame's source line under it, as in a traceback; the frames of sparkdl's rank process
    that called the user's function, and the thread of the rank's lifeline, left out."""
    out: list[str] = []
    thread_at, skipping = 0, False
    for line in dump.splitlines():
        if not line.startswith(" "):  # a thread's header (or the blank line that ends one)
            thread_at, skipping = len(out), False
        elif skipping:
            continue
        elif len(out) == thread_at + 1 and line.endswith(f" in {LIFELINE_FRAME}"):
            del out[thread_at:]
            skipping = True
            continue
        elif _RUNNER.match(line):
            out.append("  (the frames of sparkdl that called the function are not shown)")
            skipping = True
            continue
        out.append(line)
        frame = _FRAME.match(line)
        if frame is not None:
            linecache.checkcache(frame["file"])
            source = linecache.getline(frame["file"], int(frame["line"])).strip()
            if source:
                out.append(f"    {source}")
    return "\n".join(out)


def _read_dump(path: Path, start: int, timeout: float) -> str:
    """What the rank appended to ``path`` past ``start``, once it stopped growing (or at ``timeout``)."""
    deadline = time.monotonic() + timeout
    size, changed = start, time.monotonic()
    try:
        while (now := time.monotonic()) < deadline:
            if size > start and now - changed >= _DUMP_SETTLED_S:
                break
            time.sleep(0.02)
            grown = path.stat().st_size
            if grown != size:
                size, changed = grown, time.monotonic()
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(min(size - start, MAX_STACK_BYTES)).decode("utf-8", errors="replace")
    except OSError:
        return ""


class Sink(Protocol):
    """Where a rank's output goes. Each method returns False when it cannot deliver."""

    def line(self, stream: str, text: str) -> bool:
        """One whole line of the rank's stdout (``"o"``) or stderr (``"e"``)."""

    def lines(self, stream: str, texts: list[str]) -> bool:
        """Whole lines of one stream that came together, in order."""

    def metric(self, record: dict[str, Any]) -> bool:
        """One record the rank sent with ``context().log_metrics``."""


# A relay sends the lines it read within this long of the first as one batch (a rank printing
# steadily costs the driver one frame per window, not one per line), or sooner once this many
# bytes wait; a quiet stream's line goes after at most the window.
BATCH_S = 0.05
BATCH_BYTES = 256 * 1024
_READ_BYTES = 64 * 1024


@dataclass(eq=False)
class _Relay:
    """Copies one output stream of the rank process to the sink, in whole lines, never cutting one,
    batching the lines that come within :data:`BATCH_S` of each other; its thread starts when made."""

    _stream: IO[bytes]
    _kind: str
    _sink: Sink
    _ready: threading.Event
    _tail: deque[str]
    _fallback: IO[str] | None
    thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, name=f"sparkdl-relay-{self._kind}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        fd = self._stream.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        pending: list[bytes] = []  # whole lines read and not yet sent, without their newline
        partial: list[bytes] = []  # the pieces of the line being read (a long one comes in many reads)
        size, due, partial_size = 0, None, 0
        try:
            while True:
                wait_ms = None if due is None else max(0, int((due - time.monotonic()) * 1000))
                if poller.poll(wait_ms):
                    chunk = os.read(fd, _READ_BYTES)
                    if not chunk:
                        break
                    *whole, rest = chunk.split(b"\n")
                    if whole:
                        whole[0] = b"".join([*partial, whole[0]])
                        partial, partial_size = [], 0
                        whole = [_last_redraw(line) for line in whole]
                        pending += whole
                        size += sum(map(len, whole))
                        due = due or time.monotonic() + BATCH_S
                    if rest:
                        partial.append(rest)
                        partial_size += len(rest)
                        if b"\r" in rest:
                            partial = [_last_redraw(b"".join(partial))]
                            partial_size = len(partial[0])
                        if partial_size >= MAX_LINE_BYTES:
                            pending.append(b"".join(partial))
                            size += partial_size
                            partial, partial_size = [], 0
                            due = due or time.monotonic() + BATCH_S
                if pending and (size >= BATCH_BYTES or time.monotonic() >= (due or 0)):
                    self._send(pending)
                    pending, size, due = [], 0, None
            self._send(pending + ([b"".join(partial)] if partial else []))
        finally:
            self._stream.close()

    def _send(self, raw: list[bytes]) -> None:
        if not raw:
            return
        self._ready.wait()
        texts = [line.decode("utf-8", errors="replace") for line in raw]
        if self._kind == "m":
            # One JSON object a line, written by context().log_metrics in the rank.
            for text in texts:
                try:
                    record = json.loads(text)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    self._sink.metric(record)
            return
        self._tail.extend(texts)
        sent = self._sink.line(self._kind, texts[0]) if len(texts) == 1 else self._sink.lines(self._kind, texts)
        if not sent and self._fallback is not None:
            # The driver is unreachable: keep the lines in the executor's log instead.
            self._fallback.write("".join(text + "\n" for text in texts))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _last_redraw(line: bytes) -> bytes:
    """What a terminal shows of ``line``: the text after its last carriage return (one that ends
    it, as in ``\r\n``, does not count)."""
    cut = line.rstrip(b"\r").rfind(b"\r")
    return line if cut < 0 else line[cut + 1:]


class RankProcess:
    """One started rank: ``pid``, ``tail`` (its last output lines), ``tell_gang``, ``wait``, ``close``."""

    def __init__(
        self,
        spec: RankSpec,
        workdir: Path,
        fn_bytes: bytes,
        sink: Sink,
        *,
        store: socket.socket | None,
        prewarm: bool,
        start_timeout_s: float,
        tail_lines: int,
        on_driver: bool = False,
        fallback_out: IO[str] | None = None,
        fallback_err: IO[str] | None = None,
    ) -> None:
        self.spec = spec
        self.workdir = workdir
        # Output lines wait for this: the attempt they belong to is known only once the gang formed.
        self.ready = threading.Event()
        self.tail: deque[str] = deque(maxlen=max(tail_lines, 1))
        self._lifeline_w: int | None = None
        self._control_w: int | None = None
        self._told = False  # the gang went down the control pipe
        self._relays: list[_Relay] = []
        self._dump_lock = threading.Lock()
        workdir_files.write_payload(workdir, fn_bytes)
        write_secrets(spec, workdir)
        env = {**os.environ, **rank_env(spec, workdir)}
        iface = iface_for(spec.host)
        if iface is not None:
            env.setdefault("GLOO_SOCKET_IFNAME", iface)
        lifeline_r, self._lifeline_w = os.pipe()
        control_r, self._control_w = os.pipe()
        metrics_r, metrics_w = os.pipe()
        fds = {"lifeline": lifeline_r, "control": control_r, "metrics": metrics_w}
        if store is not None:
            fds["store"] = store.fileno()
        try:
            self._proc: ProcessHandle = start_rank(
                str(workdir), env, fds, name=f"sparkdl-rank{spec.rank}", prewarm=prewarm, timeout_s=start_timeout_s,
                on_driver=on_driver,
            )
        except BaseException:
            for fd in (metrics_r, self._lifeline_w, self._control_w):
                os.close(fd)
            raise
        finally:
            for fd in (lifeline_r, control_r, metrics_w):
                os.close(fd)
        self.pid = self._proc.pid
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self._relays = [
            _Relay(self._proc.stdout, "o", sink, self.ready, self.tail, fallback_out),
            _Relay(self._proc.stderr, "e", sink, self.ready, self.tail, fallback_err),
            _Relay(os.fdopen(metrics_r, "rb"), "m", sink, self.ready, self.tail, None),
        ]

    def tell_gang(self, gang: GangSpec, job_env: dict[str, str] | None = None) -> None:
        """Sends the gang to the rank, which has waited for it since it started; ``job_env``:
        variables only known once the gang formed (an MPI job's, :mod:`sparkdl._internal.backends.horovod.mpi`)."""
        fd = self._control_w
        if fd is None or self._told:
            raise RuntimeError("the gang was already sent to this rank")
        self._told = True
        _write_all(fd, (json.dumps({**(job_env or {}), **gang_env(self.spec, gang)}) + "\n").encode())
        # The pipe stays open for the driver's later orders (a trial's decisions), which must
        # never block the lane: a rank that does not read them loses them, and nothing else.
        os.set_blocking(fd, False)
        self.ready.set()

    def order(self, line: bytes) -> bool:
        """Writes one line (at most PIPE_BUF bytes: whole or not at all) down the rank's control
        pipe, after its gang; False when it did not go (the pipe is full or closed)."""
        fd = self._control_w
        if fd is None or not self._told:
            return False
        try:
            return os.write(fd, line) == len(line)
        except OSError:
            return False

    def wait(self, timeout: float | None = None) -> int:
        """The rank's exit code (negative: the signal that killed it), once it and its output ended."""
        code = self._proc.wait(timeout)
        # Children the rank left behind (DataLoader workers, ...) would hold the pipes open. Those
        # outside its group went to the zygote or the task when it died, which end them.
        proctree.kill_group(self.pid)
        self.ready.set()
        for relay in self._relays:
            relay.thread.join(timeout=10)
        return code

    def exited(self, code: int, lost: str | None = None) -> Exited:
        """How the rank ended, as both launchers report it: exit ``code`` (from :meth:`wait`) and,
        when it failed, the error and traceback it wrote (``error.json``) or else ``lost``, what its
        backend's job said of it, and when it failed."""
        if code == 0:
            return Exited(0, None)
        ended = time.time()
        error, tb, failed_at = workdir_files.read_error(self.workdir)
        exit_signal = -code if code < 0 else None
        return Exited(None if exit_signal else code, exit_signal, error or lost, tb, failed_at or ended)

    def dump_stacks(self, timeout: float = STACK_DUMP_S) -> str | None:
        """Every thread's Python stack of the running rank, innermost frame first, with source
        lines; None when the rank has ended, cannot dump (not yet set up), or wrote nothing in
        ``timeout`` s. The rank goes on running."""
        path = workdir_files.stacks_path(self.workdir)
        with self._dump_lock:
            try:
                start = path.stat().st_size  # no file yet: the rank has no handler for the signal
                if self._proc.returncode is not None:  # reaped: the pid may be another's by now
                    return None
                os.kill(self.pid, STACK_SIGNAL)
            except OSError:
                return None
            text = _read_dump(path, start, timeout)
        return with_source(text) if text.strip() else None

    def running(self) -> bool:
        """Whether the rank has not ended (nor been reaped) yet."""
        return self._proc.returncode is None

    def kill(self) -> None:
        """SIGKILLs the rank and all below it: its group, and (the rank being a subreaper) the
        descendants that left the group, as long as the rank lives to hold them."""
        if self._proc.returncode is None:  # not yet reaped: the pid is still the rank's
            proctree.kill_descendants(self.pid)
        proctree.kill_group(self.pid)

    def close(self) -> None:
        """Ends the rank and everything it started; safe to call more than once."""
        self.ready.set()
        for name in ("_lifeline_w", "_control_w"):
            fd = getattr(self, name)
            if fd is not None:
                setattr(self, name, None)
                os.close(fd)
        self.kill()
        with contextlib.suppress(Exception):
            self._proc.wait(timeout=5)
