"""Horovod's MPI controller on a sparkdl gang: Open MPI's processes, each started by a gang's task.

``RunConfig(horovod_controller="mpi")`` runs the gang's ranks as one MPI job, formed without ssh
and without a second scheduler, inside the barrier stage:

* every task (or, for ranks on the driver, the driver) holds an :class:`Endpoint` for its rank:
  an authenticated channel on the task's own address, whose port travels with the gang's
  addresses, and a Unix socket for the rank's MPI proxy;
* rank 0's task runs ``mpirun`` (:class:`Mpirun`) over one MPI node per rank, named
  ``sparkdl-rank<r>``, with sparkdl's agent as its remote shell (``plm_rsh_agent``). For each node
  the agent (``python -m sparkdl._internal.backends.horovod.mpi_proxy agent``) asks that rank's task, over the channel
  and with the run's secret, to start Open MPI's daemon (``orted``) with mpirun's arguments; the
  task starts it as its own child, and ends it with itself;
* the daemon starts the rank's proxy (``python -m sparkdl._internal.backends.horovod.mpi_proxy rank``), which hands its
  environment (the ``OMPI_*``/``PMIX_*`` variables that place a process in the job) to its task
  over the Unix socket. The task checks that the proxy is its own daemon's child and gives those
  variables to the rank process (already running, forked from the zygote with torch imported)
  together with the gang. ``hvd.init()`` then joins the job as that MPI process: Open MPI's local
  server admits a client by its user, not by its parent;
* the proxy lives exactly as long as the rank: the task tells it the rank's exit code and it ends
  with it (a signal as that signal), so mpirun sees each rank end as it would its own process.
  When mpirun or a daemon ends the job first, the proxy's socket closes and the task ends its rank.

Every process of the job is below a task (mpirun and the agents below rank 0's task, each daemon
and proxy below its rank's task), so a task's end ends them. The run's secret travels in a 0600
file in rank 0's workdir, never on a command line. Open MPI's own traffic (mpirun to daemons,
rank to rank) is not authenticated; it stays on the interface of the gang's addresses.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from sparkdl._internal.common import proctree
from sparkdl._internal.common.net import iface_for, peer_credentials
from sparkdl._internal.wire.channel import FramedConnection, Message
from sparkdl._internal.wire.server import ChannelServer

# The proxy's environment names its Unix socket here; rank 0's agents find their config here.
PROXY_ENV = "SPARKDL_MPI_PROXY"
AGENT_ENV = "SPARKDL_MPI_AGENT"
# What of the proxy's environment the rank takes: what places a process in an Open MPI job.
JOB_PREFIXES = ("OMPI_", "PMIX_", "OPAL_", "ORTE_")
# The daemons a task agrees to start for an agent: Open MPI 4's, and nothing else.
DAEMONS = ("orted",)
_OUTPUT_TAIL = 40
_STOP_S = 5.0


def node_name(rank: int) -> str:
    """The MPI node of a rank: every rank is a node of its own, as every task sees only its own
    GPUs (so ``hvd.local_rank()`` is 0 and ``set_device(hvd.local_rank())`` picks the task's)."""
    return f"sparkdl-rank{rank}"


class Endpoint:
    """One rank's part of the MPI job, held by the process that owns the rank (its Spark task).

    ``port``: where rank 0's agent asks this task to start its daemon; :meth:`join` waits for the
    rank's proxy and returns the variables the rank needs; :meth:`ended` passes the rank's end on
    to the proxy; :meth:`close` ends the daemon and everything below it.
    """

    def __init__(self, host: str, secret: bytes, rank: int, workdir: Path, *, handshake_timeout_s: float) -> None:
        self.rank = rank
        self._workdir = workdir
        self._lock = threading.Lock()
        self._daemon: subprocess.Popen[bytes] | None = None
        self._proxy: socket.socket | None = None
        self._closed = False
        self.lost: str | None = None  # why the job ended this rank, when it did
        self.failed: str | None = None  # why this task could not start its daemon
        self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.address = f"sparkdl-mpi-{os.getpid()}-{rank}-{os.urandom(8).hex()}"
        self._unix.bind("\0" + self.address)  # abstract: nothing left on disk
        self._unix.listen(4)
        self._server = ChannelServer(host, secret, self._on_message, self._on_close, handshake_timeout_s)
        self._server.__enter__()
        self.port = self._server.address[1]
        self._iface = iface_for(host)

    def _on_message(self, conn: FramedConnection, message: Message) -> None:
        argv = message.get("daemon")
        refusal = None
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            refusal = "the request names no daemon to start"
        elif os.path.basename(argv[0]) not in DAEMONS:
            refusal = f"refused to start {argv[0]!r}: a task starts Open MPI's daemon only"
        with self._lock:
            if refusal is None and (self._closed or self._daemon is not None):
                refusal = f"rank {self.rank}'s task has started its daemon already, or has ended"
            if refusal is not None:
                conn.send({"out": f"sparkdl: {refusal}", "exit": 1})
                return
            assert isinstance(argv, list)
            # Kept as this task's child, not daemonized: it ends with the task.
            argv = [a for a in argv if a != "--daemonize"]
            env = {**os.environ, PROXY_ENV: self.address, **_iface_mca(self._iface), **_session_dir(self._workdir)}
            try:
                self._daemon = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
            except OSError as exc:
                self.failed = (f"cannot start Open MPI's daemon {argv[0]!r} in rank {self.rank}'s task: {exc}; "
                               "install Open MPI 4 (openmpi-bin) on every executor")
                conn.send({"out": f"sparkdl: {self.failed}", "exit": 127})
                return
            daemon = self._daemon
        threading.Thread(target=_relay_daemon, args=(daemon, conn), name="sparkdl-mpi-daemon", daemon=True).start()

    def _on_close(self, conn: FramedConnection, reason: str | None) -> None:
        # The agent is gone (mpirun ended it, or ended): its daemon has nobody to report to.
        with self._lock:
            daemon = self._daemon
        if daemon is not None and daemon.poll() is None:
            proctree.kill_group(daemon.pid)

    def join(self, timeout_s: float, alive: Callable[[], str | None] = lambda: None) -> dict[str, str]:
        """The variables that make the rank this rank of the MPI job, once its proxy checked in.

        ``alive`` returns why waiting is pointless (mpirun ended), else None; TimeoutError after
        ``timeout_s``, RuntimeError when the proxy is not this task's or not this rank's.
        """
        deadline = time.monotonic() + timeout_s
        self._unix.settimeout(0.2)
        while True:
            why = self.failed or alive()
            if why is not None:
                raise RuntimeError(why)
            try:
                conn, _ = self._unix.accept()
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"Open MPI did not start rank {self.rank}'s process within {timeout_s:g} s "
                        "(RunConfig.connect_timeout_s)") from None
        pid, uid = peer_credentials(conn)
        with self._lock:
            daemon = self._daemon.pid if self._daemon is not None else None
        if uid != os.getuid() or daemon is None or proctree.parent_of(pid) != daemon:
            conn.close()
            raise RuntimeError(f"a process (pid {pid}, uid {uid}) that is not the child of rank "
                               f"{self.rank}'s MPI daemon connected to its proxy address")
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        with conn.makefile("rb") as f:
            env = json.loads(f.readline() or b"{}")
        conn.settimeout(None)
        job = {k: str(v) for k, v in env.items() if k.startswith(JOB_PREFIXES)}
        if job.get("OMPI_COMM_WORLD_RANK") != str(self.rank):
            conn.close()
            raise RuntimeError(f"Open MPI placed rank {job.get('OMPI_COMM_WORLD_RANK')} where sparkdl's "
                               f"rank {self.rank} runs")
        self._proxy = conn
        return {**job, **_iface_mca(self._iface)}

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Calls ``on_lost(why)`` (from a thread of its own) when the job ends the proxy first."""
        proxy = self._proxy
        if proxy is None:
            return

        def wait() -> None:
            with contextlib.suppress(OSError):
                proxy.recv(1)  # the proxy sends nothing more: this returns when it ends
            with self._lock:
                if self._closed or self._proxy is None:
                    return  # the rank ended first: ended() told the proxy
                self._proxy = None
            self.lost = ("Open MPI ended this rank's MPI process: mpirun stopped the job (another rank "
                         "ended, or a daemon was lost; mpirun's lines are in rank 0's log)")
            on_lost(self.lost)

        threading.Thread(target=wait, name="sparkdl-mpi-proxy", daemon=True).start()

    def ended(self, code: int) -> None:
        """Tells the proxy that the rank ended with ``code`` (negative: the signal); it exits so."""
        with self._lock:
            proxy, self._proxy = self._proxy, None
        if proxy is not None:
            with contextlib.suppress(OSError):
                proxy.sendall(json.dumps({"code": code}).encode() + b"\n")
            proxy.close()

    def wait_daemon(self, timeout_s: float) -> None:
        """Waits (at most ``timeout_s``) for mpirun to end this task's daemon, as it does once every
        rank's process ended."""
        with self._lock:
            daemon = self._daemon
        if daemon is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.wait(timeout_s)

    def close(self) -> None:
        """Ends the daemon and all below it, and stops listening; safe to call again."""
        with self._lock:
            self._closed = True
            daemon, proxy, self._proxy = self._daemon, self._proxy, None
        if proxy is not None:
            proxy.close()
        if daemon is not None:
            proctree.kill_group(daemon.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.wait(_STOP_S)
        self._server.close()
        self._unix.close()


def _relay_daemon(daemon: subprocess.Popen[bytes], conn: FramedConnection) -> None:
    """The daemon's output to the agent (so into mpirun's), then its exit code."""
    assert daemon.stdout is not None
    with contextlib.suppress(OSError, ValueError):
        for raw in daemon.stdout:
            conn.send({"out": raw.decode("utf-8", errors="replace").rstrip("\n")})
    code = daemon.wait()
    with contextlib.suppress(OSError, ValueError):
        conn.send({"exit": code})


def _iface_mca(iface: str | None) -> dict[str, str]:
    """Open MPI's traffic on the interface of this task's address alone (Gloo's rule too)."""
    if iface is None:
        return {}
    return {"OMPI_MCA_oob_tcp_if_include": iface, "OMPI_MCA_btl_tcp_if_include": iface}


def _session_dir(workdir: Path) -> dict[str, str]:
    """Open MPI keeps its session files (PMIx's shared segments among them) under TMPDIR: in the
    task's workdir, they go with it even when a daemon is killed before it could clean up."""
    base = workdir / "ompi"
    base.mkdir(mode=0o700, exist_ok=True)
    return {"TMPDIR": str(base)}


class Mpirun:
    """``mpirun`` of one attempt, in rank 0's task: one node per rank, sparkdl's agent as its shell.

    ``nodes[r]`` is ``(host, port)`` of rank r's :class:`Endpoint`. mpirun's output goes to
    ``log`` line by line (and its last lines are kept for an error); :meth:`ended` says why it
    ended early, :meth:`close` ends it and everything it started.
    """

    def __init__(self, workdir: Path, nodes: Sequence[tuple[str, int]], secret: bytes, host: str, *,
                 timeout_s: float, log: Callable[[str], object]) -> None:
        self._log = log
        self.tail: list[str] = []
        config = workdir / "mpi-agent.json"
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"key": secret.hex(), "timeout_s": timeout_s,
                       "nodes": {node_name(r): [h, p] for r, (h, p) in enumerate(nodes)}}, f)
        hostfile = workdir / "mpi-hosts"
        hostfile.write_text("".join(f"{node_name(r)} slots=1\n" for r in range(len(nodes))))
        agent = f"{sys.executable} -m sparkdl._internal.backends.horovod.mpi_proxy agent"
        argv = [
            "mpirun", "--hostfile", str(hostfile), "-np", str(len(nodes)), "--bind-to", "none",
            "-mca", "plm_rsh_agent", agent,
            # mpirun starts every daemon itself (no tree), through a task, kept in the foreground.
            "-mca", "plm_rsh_no_tree_spawn", "1",
            # Node names are sparkdl's labels, never looked up in DNS.
            "-mca", "if_base_do_not_resolve", "1",
            # No topology shared through a mapping at a fixed address: in a sandbox (gVisor) the
            # daemon crashed writing it, 2 launches in 6. Each rank reads the topology itself.
            "-mca", "rtc_hwloc_vmhole", "none",
            *(["--allow-run-as-root"] if os.geteuid() == 0 else []),
            sys.executable, "-u", "-m", "sparkdl._internal.backends.horovod.mpi_proxy", "rank",
        ]
        env = {**os.environ, AGENT_ENV: str(config), **_iface_mca(iface_for(host)), **_session_dir(workdir)}
        try:
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, env=env, cwd=workdir, start_new_session=True)
        except OSError as exc:
            raise RuntimeError(f"cannot start mpirun in rank 0's task: {exc}; install Open MPI 4 (openmpi-bin) "
                               "on every executor") from exc
        self._relay = threading.Thread(target=self._read, name="sparkdl-mpirun", daemon=True)
        self._relay.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for raw in self._proc.stdout:
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.tail = [*self.tail[-_OUTPUT_TAIL + 1 :], line]
            self._log(f"[mpirun] {line}")

    def ended(self) -> str | None:
        """Why mpirun ended, with its last lines, when it has; else None."""
        code = self._proc.poll()
        if code is None:
            return None
        self._relay.join(timeout=1)
        last = "\n".join(self.tail[-10:])
        return f"mpirun exited with code {code} before every rank joined the MPI job:\n{last}"

    def wait(self, timeout_s: float) -> int | None:
        """mpirun's exit code, once every rank's proxy ended (None after ``timeout_s``)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self._proc.wait(timeout_s)
        return None

    def close(self) -> None:
        if self._proc.poll() is None:
            proctree.kill_descendants(self._proc.pid)
        proctree.kill_group(self._proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(_STOP_S)
        self._relay.join(timeout=1)


def join_job(endpoint: Endpoint, rank: int, nodes: Sequence[tuple[str, int]], workdir: Path, secret: bytes,
             host: str, timeout_s: float, log: Callable[[str], object]) -> tuple[dict[str, str], Mpirun | None]:
    """Once the gang formed: rank 0 starts mpirun; every rank waits for its proxy. Returns the
    rank's job variables and, in rank 0, the mpirun to close with the task. RuntimeError or
    TimeoutError (their message for the report) when the rank cannot join within ``timeout_s``."""
    mpirun = Mpirun(workdir, nodes, secret, host, timeout_s=timeout_s, log=log) if rank == 0 else None
    try:
        return endpoint.join(timeout_s, mpirun.ended if mpirun is not None else lambda: None), mpirun
    except BaseException:
        if mpirun is not None:
            mpirun.close()
        raise


def join_local(endpoints: Sequence[Endpoint], host: str, workdir: Path, secret: bytes, timeout_s: float,
               log: Callable[[str], object]) -> tuple[list[dict[str, str]], Mpirun]:
    """Ranks that one process owns (on the driver): one mpirun, every endpoint joined in turn."""
    mpirun = Mpirun(workdir, [(host, e.port) for e in endpoints], secret, host, timeout_s=timeout_s, log=log)
    try:
        return [e.join(timeout_s, mpirun.ended) for e in endpoints], mpirun
    except BaseException:
        mpirun.close()
        raise
