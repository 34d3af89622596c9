"""One rank's process as both launchers run it: its pipes, its output relays, its end.

A Spark task (:mod:`sparkdl.task.main`) and the driver-local launcher
(:mod:`sparkdl.driver.local`) start a rank the same way: :class:`RankProcess` writes the
cloudpickled function into the rank's workdir, starts the process (:func:`~sparkdl.task.spawn.start_rank`)
with a lifeline, a control pipe and a metrics pipe, and copies its stdout, stderr and metrics,
line by line, to a :class:`Sink`: the driver's channel in a Spark task, the driver's monitor
itself on the driver. Once the gang is known, :meth:`RankProcess.tell_gang` sends it down the
control pipe. Whatever happens, :meth:`RankProcess.close` ends the rank and everything it
started.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections import deque
from pathlib import Path
from typing import IO, Any, Protocol

from sparkdl import proctree
from sparkdl.rankspec import GangSpec, RankSpec, gang_env, rank_env
from sparkdl.task.net import iface_for
from sparkdl.task.spawn import ProcessHandle, kill_group, start_rank


class Sink(Protocol):
    """Where a rank's output goes. Each method returns False when it cannot deliver."""

    def line(self, stream: str, text: str) -> bool:
        """One whole line of the rank's stdout (``"o"``) or stderr (``"e"``)."""

    def metric(self, record: dict[str, Any]) -> bool:
        """One record the rank sent with ``context().log_metrics``."""


class _Relay:
    """Copies one output stream of the rank process to the sink, line by line, never cutting one."""

    def __init__(self, stream: IO[bytes], kind: str, sink: Sink, ready: threading.Event,
                 tail: deque[str], fallback: IO[str] | None) -> None:
        self._stream = stream
        self._kind = kind
        self._sink = sink
        self._ready = ready
        self._tail = tail
        self._fallback = fallback
        self.thread = threading.Thread(target=self._run, name=f"sparkdl-relay-{kind}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for raw in iter(self._stream.readline, b""):
            self._ready.wait()
            line = raw.decode("utf-8", errors="replace")
            if line.endswith("\n"):
                line = line[:-1]
            if self._kind == "m":
                # One JSON object a line, written by context().log_metrics in the rank.
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    self._sink.metric(record)
                continue
            self._tail.append(line)
            if not self._sink.line(self._kind, line) and self._fallback is not None:
                # The driver is unreachable: keep the line in the executor's log instead.
                self._fallback.write(line + "\n")
        self._stream.close()


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
        self._relays: list[_Relay] = []
        (workdir / "payload.pkl").write_bytes(fn_bytes)
        env = {**os.environ, **rank_env(spec)}
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
                str(workdir), env, fds, name=f"sparkdl-rank{spec.rank}", prewarm=prewarm, timeout_s=start_timeout_s
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

    def tell_gang(self, gang: GangSpec) -> None:
        """Sends the gang to the rank, which has waited for it since it started."""
        fd, self._control_w = self._control_w, None
        if fd is None:
            raise RuntimeError("the gang was already sent to this rank")
        with os.fdopen(fd, "w") as control:
            control.write(json.dumps(gang_env(self.spec, gang)))
        self.ready.set()

    def wait(self, timeout: float | None = None) -> int:
        """The rank's exit code (negative: the signal that killed it), once it and its output ended."""
        code = self._proc.wait(timeout)
        # Children the rank left behind (DataLoader workers, ...) would hold the pipes open. Those
        # outside its group went to the zygote or the task when it died, which end them.
        kill_group(self.pid)
        self.ready.set()
        for relay in self._relays:
            relay.thread.join(timeout=10)
        return code

    def kill(self) -> None:
        """SIGKILLs the rank and all below it: its group, and (the rank being a subreaper) the
        descendants that left the group, as long as the rank lives to hold them."""
        if self._proc.returncode is None:  # not yet reaped: the pid is still the rank's
            proctree.kill_descendants(self.pid)
        kill_group(self.pid)

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
