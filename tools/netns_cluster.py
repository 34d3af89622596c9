"""A Spark standalone cluster of "real hosts" on one Linux machine, made of namespaces (needs root).

A bridge ``sdlbr<hex>`` in the root namespace holds ``.1`` of a random 10.200-250.x.0/24: the
driver's address (a driver program runs in the root namespace). The master (``.2``) and worker i
(``.10+i``) each run in a network namespace of their own (loopback and one veth to the bridge; no
default route, nothing else reachable) and a mount namespace of their own whose /tmp and /dev/shm
are private tmpfs: hosts share neither. Paths under /tmp that hosts need (this repository, the
venv, Spark, the shared dir, ``keep``) are bound back into each private /tmp. ``cluster.shared``
(default: a fresh dir under /var/tmp) is seen by every host at the same path, like an NFS mount.
``hide`` covers paths on every host with an empty directory (hosts with nothing installed: the
driver's venv and this checkout hidden, Spark itself moved to /tmp/spark where it lay in them).

    with NetnsCluster(workers=2) as cluster:  # a test: see tests/cluster/test_netns_tool.py
        subprocess.run([sys.executable, "job.py"], env=cluster.driver_env())  # + driver_conf()
        cluster.link_down(cluster.hosts[0])  # a network partition of worker 0

From a shell (Ctrl-C stops it all): ``.venv/bin/python tools/netns_cluster.py --workers 2``.
What a cluster whose owner was SIGKILLed left behind is removed by the next start() or ``--sweep``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

try:
    from standalone_cluster import ClusterError, conf_dir_env, spark_home
except ImportError:  # loaded by path, without tools/ on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from standalone_cluster import ClusterError, conf_dir_env, spark_home

MASTER_PORT, WEBUI_PORT, WORKER_PORT, WORKER_WEBUI_PORT = 7077, 8080, 7078, 8081
WORK_DIR = "/tmp/spark-work"  # each worker's work dir, in its private /tmp
ROOT = Path(__file__).resolve().parent.parent


def _ip(*argv: str, check: bool = True) -> str:
    out = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise ClusterError(f"ip {shlex.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


@dataclass(eq=False)
class Host:
    """One host: network namespace ``name``, ``address`` on the bridge, the daemon that runs there."""

    name: str
    address: str
    role: str  # "master" or "worker-<i>"
    veth: str  # the bridge-side end of the host's veth
    log: Path
    proc: subprocess.Popen[bytes] | None = None


HostRef = Host | int | str  # a Host, a worker's index, or a netns name


class NetnsCluster:
    """A master and ``workers`` workers (``cores`` and ``memory`` each), each a host of its own.
    ``python``: the executors' Python (default this one); ``shared``: storage all hosts see (kept
    on stop when given); ``keep``: more paths under /tmp the hosts must still see; ``worker_opts``:
    extra SPARK_WORKER_OPTS (e.g. -Dspark.worker.resource.gpu.amount=2); ``hide``: paths no host
    may see (each covered by an empty read-only directory). A relative ``python`` is resolved in
    each executor's working directory (``./env/bin/python`` of an archive shipped with the job)."""

    def __init__(
        self, workers: int = 2, *, cores: int = 1, memory: str = "1g", python: str | None = None,
        shared: str | Path | None = None, start_timeout_s: float = 90.0, daemon_memory: str = "256m",
        tmp_size: str = "2g", keep: list[str | Path] | None = None, worker_opts: list[str] | None = None,
        hide: list[str | Path] | None = None,
    ) -> None:
        if not 1 <= workers <= 200:
            raise ValueError(f"workers must be 1..200, not {workers}")
        self.cores, self.memory, self.python = cores, memory, python or sys.executable
        self.start_timeout_s, self.daemon_memory, self.tmp_size = start_timeout_s, daemon_memory, tmp_size
        self.keep, self.worker_opts = [Path(p) for p in keep or []], list(worker_opts or [])
        hidden = {Path(os.path.realpath(p)) for p in hide or []}
        self.hide = sorted(p for p in hidden if not any(p != q and p.is_relative_to(q) for q in hidden))
        self.token = secrets.token_hex(3)
        self.bridge = f"sdlbr{self.token}"
        self.dir = Path("/var/tmp") / f"sparkdl-netns-{self.token}"  # conf and logs
        self.own_shared = shared is None
        self.shared = self.dir / "shared" if shared is None else Path(shared).resolve()
        self.home, self.prefix = spark_home(), ""
        # Where the hosts run Spark from: its own path, or /tmp/spark (private) where that is hidden.
        real_home = Path(os.path.realpath(self.home))
        self.host_home = Path("/tmp/spark") if any(real_home.is_relative_to(p) for p in self.hide) else self.home
        self.master = self._host("master", 2, "m")
        self.hosts = [self._host(f"worker-{i}", 10 + i, f"w{i}") for i in range(workers)]
        self._netns: list[str] = []  # what start() made, for stop() to remove
        self._links: list[str] = []
        self._dirs: list[Path] = []

    def _host(self, role: str, last: int, tag: str) -> Host:
        return Host(f"sdl{self.token}-{tag}", f".{last}", role, f"sdlv{self.token}{tag}",
                    self.dir / "logs" / f"{role}.log")

    @property
    def all_hosts(self) -> list[Host]:
        return [self.master, *self.hosts]

    @property
    def driver_host(self) -> str:
        """The bridge's address in the root namespace, where a driver program binds."""
        return f"{self.prefix}.1"

    @property
    def master_url(self) -> str:
        return f"spark://{self.master.address}:{MASTER_PORT}"

    @property
    def webui_url(self) -> str:
        return f"http://{self.master.address}:{WEBUI_PORT}"

    @property
    def spark_submit(self) -> str:
        return str(self.home / "bin" / "spark-submit")

    @staticmethod
    def available() -> str | None:
        """Why a cluster cannot be made here (a reason for pytest.skip), or None when it can."""
        if not sys.platform.startswith("linux") or os.geteuid() != 0:
            return f"network and mount namespaces need root (this is uid {os.geteuid()})"
        if missing := [t for t in ("ip", "unshare", "nsenter", "mount", "ss") if shutil.which(t) is None]:
            return f"missing tools: {', '.join(missing)} (iproute2, util-linux)"
        # A bridge and a veth in a throwaway namespace: root that lacks the capabilities fails here.
        probe = subprocess.run(
            ["unshare", "-m", "-n", "--propagation", "private", "sh", "-c",
             "ip link add sdlprobe type bridge && ip link add sdlpa type veth peer name sdlpb"],
            capture_output=True, text=True, timeout=30)
        if probe.returncode != 0:
            return f"cannot make namespaces, bridges or veths here: {probe.stderr.strip()}"
        return None

    def start(self) -> NetnsCluster:
        """Makes the network, starts the master and workers; returns once all are ALIVE."""
        if reason := self.available():
            raise ClusterError(reason)
        sweep_stale()
        atexit.register(self.stop)
        try:
            for d in (self.dir, self.dir / "conf", self.dir / "logs", *([self.shared] if self.own_shared else [])):
                d.mkdir()
                self._dirs.append(d)
                d.chmod(0o755)
                if d == self.dir:  # first, so that another process's sweep never finds the dir without it
                    (self.dir / "owner").write_text(_owner_id(os.getpid()))
            self.shared.mkdir(parents=True, exist_ok=True)
            self._make_network()
            for host in self.all_hosts:
                self._launch(host)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _make_network(self) -> None:
        used = _ip("-o", "addr", "show", check=False) + _ip("route", "show", "table", "all", check=False)
        free = [f"10.{a}.{b}" for a in range(200, 251) for b in range(256) if f"10.{a}.{b}." not in used]
        if not free:
            raise ClusterError("no 10.200-250.x.0/24 is free")
        self.prefix = secrets.choice(free)
        for h in self.all_hosts:  # ".2" -> "10.a.b.2"
            h.address = f"{self.prefix}.{h.address.rsplit('.', 1)[-1]}"
        _ip("link", "add", self.bridge, "type", "bridge")
        self._links.append(self.bridge)
        _ip("addr", "add", f"{self.driver_host}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for h in self.all_hosts:
            _ip("netns", "add", h.name)
            self._netns.append(h.name)
            _ip("link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.name)
            self._links.append(h.veth)
            for argv in (["link", "set", h.veth, "master", self.bridge, "up"], ["-n", h.name, "link", "set", "lo", "up"],
                         ["-n", h.name, "addr", "add", f"{h.address}/24", "dev", "eth0"],
                         ["-n", h.name, "link", "set", "eth0", "up"]):
                _ip(*argv)

    def kept_paths(self) -> list[Path]:
        """The paths under /tmp that every host still sees, bound back into its private /tmp."""
        tmp = Path(os.path.realpath("/tmp"))
        python = [Path(self.python).parent.parent, Path(self.python).resolve().parent.parent] \
            if os.path.isabs(self.python) else []  # a relative one is in the executors' working dirs
        wanted = {ROOT, Path(sys.prefix), Path(sys.base_prefix), *python, self.home, self.shared, self.dir, *self.keep}
        under = {Path(os.path.realpath(p)) for p in wanted if Path(os.path.realpath(p)).is_relative_to(tmp)}
        if tmp in under:
            raise ClusterError(f"cannot give the hosts a /tmp of their own: one of {sorted(wanted)} is /tmp")
        return sorted(p for p in under if not any(p != q and p.is_relative_to(q) for q in under))

    def _launch(self, host: Host) -> None:
        tmp = os.path.realpath("/tmp")
        # In the host's mount namespace: cd into the real /tmp, cover /tmp with a tmpfs, bind the
        # kept paths back from the covered dir (cwd; mount -c: no canonicalizing past the tmpfs).
        fs = f"-t tmpfs -o mode=1777,size={self.tmp_size} sdltmp-{self.token}-{host.role}"
        lines = ["set -e", f"cd {shlex.quote(tmp)}", f"mount {fs} {shlex.quote(tmp)}", f"mount {fs} /dev/shm"]
        for path in self.kept_paths():
            rel = shlex.quote("./" + str(path.relative_to(tmp)))
            lines += [f"mkdir -p {shlex.quote(str(path))}", f"mount -c --rbind {rel} {shlex.quote(str(path))}"]
        if self.host_home != self.home:  # Spark lies in a hidden path: bound to /tmp/spark first
            lines += [f"mkdir -p {self.host_home}", f"mount --rbind {shlex.quote(str(self.home))} {self.host_home}"]
        for path in self.hide:
            quoted = shlex.quote(str(path))  # (one under /tmp is already gone with the private /tmp)
            lines.append(f"if [ -d {quoted} ]; then mount -t tmpfs -o ro,mode=755,size=4k sdlhide-{self.token} {quoted}; fi")
        lines += [f"mkdir -p {WORK_DIR}", "cd /", 'exec "$@"']
        if host is self.master:
            args = ["org.apache.spark.deploy.master.Master", "--host", host.address,
                    "--port", str(MASTER_PORT), "--webui-port", str(WEBUI_PORT)]
        else:
            args = ["org.apache.spark.deploy.worker.Worker", "--host", host.address,
                    "--port", str(WORKER_PORT), "--webui-port", str(WORKER_WEBUI_PORT),
                    "--cores", str(self.cores), "--memory", self.memory, "--work-dir", WORK_DIR,
                    self.master_url]
        argv = ["ip", "netns", "exec", host.name, "unshare", "-m", "--propagation", "private",
                "sh", "-c", "\n".join(lines), "sh", str(self.host_home / "bin" / "spark-class"), *args]
        with open(host.log, "wb") as out:
            # ip netns exec and unshare exec, no fork: proc.pid becomes the daemon's JVM.
            host.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env=self._daemon_env(host), cwd=self.dir, start_new_session=True)

    def _daemon_env(self, host: Host) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("SPARK_LOCAL_HOSTNAME", "SPARK_PUBLIC_DNS")}
        env.update(
            SPARK_HOME=str(self.host_home), SPARK_LOCAL_IP=host.address, SPARK_DAEMON_MEMORY=self.daemon_memory,
            # The master's REST submission server (port 6066) is not needed.
            SPARK_MASTER_OPTS=f"{os.environ.get('SPARK_MASTER_OPTS', '')} -Dspark.master.rest.enabled=false".strip(),
            SPARK_WORKER_OPTS=" ".join([os.environ.get("SPARK_WORKER_OPTS", ""), *self.worker_opts]).strip(),
            PYSPARK_PYTHON=self.python, PYSPARK_DRIVER_PYTHON=self.python,
            TMPDIR="/tmp",
        )
        return conf_dir_env(env, self.home, self.dir / "conf")

    def status(self) -> dict[str, Any] | None:
        """The master's status page as JSON (fetched over the bridge), or None while it does not answer."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"{self.webui_url}/json/", timeout=2) as resp:
                return dict(json.loads(resp.read()))
        except (OSError, ValueError):
            return None

    def alive_workers(self) -> set[str]:
        """The addresses of the workers the master has ALIVE."""
        workers = (self.status() or {}).get("workers") or []
        return {str(w.get("host")) for w in workers if isinstance(w, dict) and w.get("state") == "ALIVE"}

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        want = {h.address for h in self.hosts}
        while True:
            if dead := [f"{h.role} ({h.name})" for h in self.all_hosts if h.proc is not None and h.proc.poll() is not None]:
                raise ClusterError(f"{', '.join(dead)} exited while starting\n{self.log_tails()}")
            if want <= (alive := self.alive_workers()):
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"the cluster was not up after {self.start_timeout_s:g} s: workers ALIVE "
                                   f"{sorted(alive)} of {sorted(want)}\n{self.log_tails()}")
            time.sleep(0.25)

    def log_tails(self, lines: int = 15) -> str:
        text = {h: h.log.read_text(errors="replace").splitlines() if h.log.exists() else [] for h in self.all_hosts}
        return "\n".join(f"--- {h.role} {h.log} (last {lines} lines)\n" + "\n".join(text[h][-lines:]) for h in text)

    def driver_env(self) -> dict[str, str]:
        """The environment of a driver program in the root namespace (spark-submit or python)."""
        return conf_dir_env({**os.environ, "SPARK_HOME": str(self.home), "SPARK_LOCAL_IP": self.driver_host,
                             "PYSPARK_PYTHON": self.python, "PYSPARK_DRIVER_PYTHON": self.python},
                            self.home, self.dir / "conf")

    def driver_conf(self) -> dict[str, str]:
        """Spark confs for a driver in the root namespace: this master, bound on the bridge."""
        return {"spark.master": self.master_url, "spark.driver.host": self.driver_host,
                "spark.driver.bindAddress": self.driver_host, "spark.ui.enabled": "false",
                "spark.ui.showConsoleProgress": "false", "spark.pyspark.python": self.python,
                "spark.cores.max": str(self.cores * len(self.hosts))}

    def host(self, ref: HostRef) -> Host:
        """A host by Host, worker index or netns name (the master's too)."""
        if isinstance(ref, int):
            return self.hosts[ref]
        found = [h for h in self.all_hosts if ref is h or ref in (h.name, h.role, h.address)]
        if not found:
            raise KeyError(ref)
        return found[0]

    def enter(self, ref: HostRef) -> list[str]:
        """The command prefix that runs a program inside a host (its network and mount namespaces)."""
        host = self.host(ref)
        if host.proc is None or host.proc.poll() is not None:  # its mount namespace is gone with it
            raise ClusterError(f"{host.role} ({host.name}) is down: its daemon does not run")
        return ["nsenter", "--target", str(host.proc.pid), "--mount", "--net", "--"]

    def exec(self, ref: HostRef, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        """subprocess.run of ``argv`` inside a host; captures text output and times out in 60 s by
        default. ``cwd`` is a path in the host (nsenter would start in its /)."""
        cwd = kw.pop("cwd", None)
        cmd = [*self.enter(ref), *(["sh", "-c", 'cd "$0" && exec "$@"', str(cwd)] if cwd else []), *argv]
        kw = {"capture_output": True, "text": True, "timeout": 60, **kw}
        result: subprocess.CompletedProcess[str] = subprocess.run(cmd, **kw)
        return result

    def pids(self, ref: HostRef) -> list[int]:
        """Every process in a host's network namespace (``ip netns pids``)."""
        return _netns_pids(self.host(ref).name)

    def listeners(self, ref: HostRef) -> list[tuple[str, int, int, str]]:
        """TCP listeners in a host's namespace: (address, port, pid, command line)."""
        out = subprocess.run(["ip", "netns", "exec", self.host(ref).name, "ss", "-ltnpH"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        found = []
        for line in out.splitlines():  # LISTEN 0 50 [::ffff:10.1.2.3]:7077 [::]:* users:(("java",pid=9,fd=3))
            addr, _, port = line.split()[3].rpartition(":")
            addr = addr.strip("[]").split("%")[0].removeprefix("::ffff:")
            for pid in map(int, re.findall(r"pid=(\d+)", line)):
                with contextlib.suppress(OSError):
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                    found.append((addr, int(port), pid, cmd))
        return found

    def link_down(self, ref: HostRef) -> None:
        """Cuts a host off the network (its bridge port goes down); link_up() puts it back."""
        _ip("link", "set", self.host(ref).veth, "down")

    def link_up(self, ref: HostRef) -> None:
        """Puts a host back on the network."""
        _ip("link", "set", self.host(ref).veth, "up")

    def kill_host(self, ref: HostRef, timeout_s: float = 10.0) -> list[int]:
        """SIGKILLs every process of a host (its daemon, executors, Python workers, ...); the host
        stays down. Returns the pids still there after ``timeout_s`` (none, normally)."""
        return self._signal([self.host(ref)], signal.SIGKILL, timeout_s)

    def _signal(self, hosts: list[Host], sig: int, timeout_s: float) -> list[int]:
        """Signals every process of ``hosts`` until each has ended or ``timeout_s`` passed."""
        def reap() -> None:  # the daemons are this process's children
            for h in hosts:
                _ = h.proc and h.proc.poll()
        return _signal_namespaces([h.name for h in hosts if h.name in self._netns], sig, timeout_s, reap)

    def restart_host(self, ref: HostRef) -> None:
        """Starts a worker whose processes were killed (kill_host) again, with a fresh private /tmp,
        and returns once the master has it ALIVE. A worker that runs is left as it is."""
        host = self.host(ref)
        if host is self.master:
            raise ClusterError("restart_host restarts workers; a cluster without its master is stopped and started anew")
        if host.proc is not None and host.proc.poll() is None:
            return
        # The master refuses a worker at the address of one it still has ALIVE: it drops the old
        # one when its connection closes, which the kill caused.
        deadline = time.monotonic() + self.start_timeout_s
        while host.address in self.alive_workers():
            if time.monotonic() > deadline:
                raise ClusterError(f"the master still has {host.role} ({host.address}) ALIVE "
                                   f"{self.start_timeout_s:g} s after its processes ended")
            time.sleep(0.25)
        self._launch(host)
        self._wait_ready()

    @property
    def running(self) -> bool:
        """Whether the cluster was started and not stopped since."""
        return bool(self._netns)

    def stop(self) -> list[int]:
        """Ends every process of every host (and with them the mount namespaces and their mounts),
        removes what start() made. Idempotent; returns the pids that would not die (none, normally)."""
        hosts = [*reversed(self.hosts), self.master]
        left = self._signal(hosts, signal.SIGTERM, 8.0) and self._signal(hosts, signal.SIGKILL, 10.0)
        for proc in (h.proc for h in hosts if h.proc is not None):
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait(timeout=10)
        while self._links:  # the veths (both ends, synchronously: not left to netns del), the bridge
            _ip("link", "del", self._links.pop(), check=False)
        while self._netns:
            _ip("netns", "del", self._netns.pop(), check=False)
        while self._dirs:
            shutil.rmtree(self._dirs.pop(), ignore_errors=True)
        atexit.unregister(self.stop)
        return left

    def __enter__(self) -> NetnsCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _signal_namespaces(names: list[str], sig: int, timeout_s: float,
                       reap: Callable[[], None] = lambda: None) -> list[int]:
    """Signals every process in the network namespaces ``names`` until each has ended (gone, or a
    zombie) or ``timeout_s`` passed; returns those left. A process leaves its namespace early in its
    exit, while a JVM's threads still unwind, so those signalled are watched until they end."""
    signalled: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while True:
        pids = {pid for ns in names for pid in _netns_pids(ns)}
        left = sorted(pids | {pid for pid in signalled if not _ended(pid)})
        if not left or time.monotonic() > deadline:
            return left
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        signalled |= pids
        time.sleep(0.1)
        reap()


def _netns_pids(name: str) -> list[int]:
    """Every process in the network namespace ``name`` (``ip netns pids``; none if it is gone)."""
    return [int(p) for p in _ip("netns", "pids", name, check=False).split()]


def _ended(pid: int) -> bool:
    """Whether a process has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return True


def _owner_id(pid: int) -> str:
    """A process's pid and start time (a pid alone may be reused), or "" when it does not run."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return f"{pid} {stat.rpartition(')')[2].split()[19]}"  # field 22, starttime


_STARTING_S = 30.0  # a cluster's directory without its owner file this young is being made, not left


def sweep_stale() -> list[str]:
    """Removes what clusters whose owner died without stop() (SIGKILL, a restarted machine) left:
    processes in their namespaces, the namespaces, veths, bridge and /var/tmp dir. Returns their
    tokens. A cluster whose owner still runs is never touched."""
    swept = []
    names = _ip("netns", "list", check=False).split()
    links = re.findall(r"^\d+: (sdl(?:br|v)[0-9a-f]{6}\w*)[@:]", _ip("-o", "link", "show", check=False), re.M)
    tokens = {m.group(1) for n in [*names, *links] if (m := re.match(r"sdl(?:br|v)?([0-9a-f]{6})", n))}
    tokens |= {d.name.rsplit("-", 1)[1] for d in Path("/var/tmp").glob("sparkdl-netns-*")}
    for token in sorted(tokens):
        owner = Path(f"/var/tmp/sparkdl-netns-{token}/owner")
        with contextlib.suppress(OSError, ValueError):
            recorded = owner.read_text()
            if recorded and _owner_id(int(recorded.split()[0])) == recorded:
                continue  # alive
        with contextlib.suppress(OSError):
            if not owner.exists() and time.time() - owner.parent.stat().st_mtime < _STARTING_S:
                continue  # being made by another process: its owner is written right after the dir
        ours = [n for n in names if n.startswith(f"sdl{token}-")]
        _signal_namespaces(ours, signal.SIGKILL, 10.0)
        for link in [link for link in links if token in link]:
            _ip("link", "del", link, check=False)
        for ns in ours:
            _ip("netns", "del", ns, check=False)
        shutil.rmtree(f"/var/tmp/sparkdl-netns-{token}", ignore_errors=True)
        swept.append(token)
    return swept


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Runs a Spark standalone cluster of namespace hosts until Ctrl-C (root).")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cores", type=int, default=1, help="cores per worker")
    p.add_argument("--memory", default="1g", help="memory per worker")
    p.add_argument("--python", default=sys.executable, help="executors' Python (default: %(default)s)")
    p.add_argument("--shared", help="storage all hosts share (default: a fresh dir under /var/tmp)")
    p.add_argument("--sweep", action="store_true",
                   help="only remove what clusters whose owner died left behind (start() does it too)")
    args = p.parse_args(argv)
    if reason := NetnsCluster.available():
        print(f"cannot start: {reason}", file=sys.stderr)
        return 2
    if args.sweep:
        print(f"swept: {' '.join(sweep_stale()) or 'nothing'}")
        return 0
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored (&)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt), NetnsCluster(
        args.workers, cores=args.cores, memory=args.memory, python=args.python, shared=args.shared
    ) as c:
        print(f"master {c.master_url} (web UI {c.webui_url})")
        for h in c.all_hosts:
            print(f"  {h.role:9} {h.address:15} netns {h.name}, a shell there: nsenter -t {h.proc and h.proc.pid} -m -n")
        print(f"driver address (bridge {c.bridge} in this namespace): {c.driver_host}\nshared dir: {c.shared}")
        confs = " ".join(f"--conf {k}={shlex.quote(v)}" for k, v in c.driver_conf().items() if k != "spark.master")
        print(f"submit from this namespace:\n  SPARK_LOCAL_IP={c.driver_host} PYSPARK_PYTHON={c.python} "
              f"{c.spark_submit} --master {c.master_url} {confs} job.py\nCtrl-C stops everything", flush=True)
        while True:
            time.sleep(1)
    print("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
