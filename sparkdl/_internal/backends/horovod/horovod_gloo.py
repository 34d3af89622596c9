"""Horovod on a sparkdl gang: its Gloo rendezvous server, its ``HOROVOD_*`` environment, a check.

Under ``horovodrun --gloo``, Horovod's launcher starts an HTTP key-value store (the "rendezvous
server") and gives every rank its place in the job through ``HOROVOD_*`` variables; ``hvd.init()``
reads them and meets the other ranks through that store. sparkdl plays the launcher's part: once
the barrier stage has formed, every rank knows its rank, the world size, the address of every
rank (``hosts[r]`` is rank r's host) and where the rendezvous server listens. This module turns
that into what Horovod expects, without ``horovodrun`` and without ssh.

Where the server should live: in the rank-0 process, on the socket that the launcher already
binds to rank 0's own address for the torch backend's store (see ``start_rendezvous_server``'s
``listener``). Its port is then known before the gang's ``allGather``, it lives and dies with the
gang (nothing is left listening after a run, however it ends, and each gang rerun gets a fresh
one), and executors never have to reach the driver's host on a port of its own. Stop it after
``hvd.shutdown()``, not after ``hvd.init()``: ``hvd.add_process_set`` meets through it again.

Nothing here runs at import time, and Horovod itself is imported only inside the functions.
"""

from __future__ import annotations

import ipaddress
import math
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sparkdl._internal.common.errors import BackendUnavailableError, ConfigError

# For annotations inside a class body, where the name ``socket`` is the server's attribute.
_Socket = socket.socket

# Horovod's own default for HOROVOD_GLOO_TIMEOUT_SECONDS.
DEFAULT_GLOO_TIMEOUT_S = 30.0

# How long stop() waits for the server's thread; it stops within one poll interval when healthy.
_STOP_JOIN_S = 5.0
_POLL_INTERVAL_S = 0.1
# What Horovod's rendezvous server reads of each slot (horovod.runner.common.util.hosts.SlotInfo).
_SLOT_FIELDS = ("hostname", "rank", "local_rank", "cross_rank", "size", "local_size", "cross_size")

_INSTALL_HINT = (
    "Horovod 0.28.1 ships as source only and must be built against the installed torch, with "
    "PyTorch and Gloo: `bash \"$(sparkdl conf build-horovod --path)\" /path/to/venv` does it (it "
    "compiles once, caches the wheel and installs it; tools/build-horovod.sh in a sparkdl checkout). "
    "Every executor's Python needs it too. Or choose backend='torch'"
)


@dataclass(frozen=True)
class HorovodSlot:
    """One rank's place in a Horovod job, as ``horovodrun`` would have assigned it.

    ``hostname`` names the rank's local group: ranks with the same hostname form one
    ``hvd.local_*`` group. The ``cross`` group of a rank is the set of ranks, one per local group,
    that share its local rank.
    """

    hostname: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def horovod_slots(hosts: Sequence[str], *, isolated_devices: bool = False) -> list[HorovodSlot]:
    """Every rank's slot, from the host of each rank (``hosts[r]`` is rank r's host).

    Ranks need not be grouped by host: a Spark barrier stage numbers its tasks in partition order,
    so ``["10.0.0.1", "10.0.0.2", "10.0.0.1"]`` is valid and gives ranks 0 and 2 local ranks 0 and
    1 on the first host. Every rank computes the same slots from the same list, so they agree.

    With ``isolated_devices=True`` every rank is its own local group (local rank 0 of 1). Use it
    when each rank sees only the GPUs Spark assigned to it (``CUDA_VISIBLE_DEVICES``), so that the
    usual ``torch.cuda.set_device(hvd.local_rank())`` picks its own device. Gloo then meets every
    rank over TCP, which it does on one host anyway.

    >>> [(s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in horovod_slots(["a", "b", "a"])]
    [(0, 2, 0, 2), (0, 1, 1, 2), (1, 2, 0, 1)]
    """
    if not hosts:
        raise ConfigError("a Horovod job needs at least one rank, but the list of hosts is empty")
    if any(not h for h in hosts):
        raise ConfigError(f"every rank needs a host address, got {list(hosts)!r}")
    # Horovod keys its local groups by this name in the rendezvous URL path: no '/' in it.
    names = [f"{h}-rank{r}" if isolated_devices else h for r, h in enumerate(hosts)]
    if any("/" in n for n in names):
        raise ConfigError(f"host names must not contain '/', got {list(hosts)!r}")

    local_rank: list[int] = []
    seen: dict[str, int] = {}
    for name in names:
        local_rank.append(seen.get(name, 0))
        seen[name] = local_rank[-1] + 1
    # The cross group of local rank k: the hosts that have a rank with local rank k, numbered in
    # the order their rank appears.
    cross_members: dict[int, list[str]] = {}
    for name, lr in zip(names, local_rank, strict=True):
        cross_members.setdefault(lr, []).append(name)

    return [
        HorovodSlot(
            hostname=name,
            rank=r,
            size=len(names),
            local_rank=lr,
            local_size=seen[name],
            cross_rank=cross_members[lr].index(name),
            cross_size=len(cross_members[lr]),
        )
        for r, (name, lr) in enumerate(zip(names, local_rank, strict=True))
    ]


def horovod_env(
    rank: int,
    hosts: Sequence[str],
    rendezvous_addr: str,
    rendezvous_port: int,
    iface: str | None,
    *,
    timeout_s: float = DEFAULT_GLOO_TIMEOUT_S,
    isolated_devices: bool = False,
) -> dict[str, str]:
    """The ``HOROVOD_*`` variables with which ``hvd.init()`` joins the gang in Gloo mode.

    Set them in the rank's ``os.environ`` before ``hvd.init()``; Horovod's C++ core reads them
    there. They are what ``horovodrun --gloo`` gives each rank.

    Args:
        rank: this process's rank, ``0 <= rank < len(hosts)``.
        hosts: the address of every rank's host, indexed by rank.
        rendezvous_addr, rendezvous_port: where ``start_rendezvous_server`` listens.
        iface: the network interface Gloo's data connections use (for example ``"lo"`` or
            ``"eth0"``): the one that carries this rank's host address. ``None`` leaves Gloo to
            pick from the machine's hostname, which can be an address other hosts cannot reach.
        timeout_s: bound on each of Gloo's rendezvous steps (``HOROVOD_GLOO_TIMEOUT_SECONDS``,
            whole seconds, rounded up).
        isolated_devices: as in ``horovod_slots``; the same value must be given to the server.

    >>> env = horovod_env(1, ["127.0.0.1", "127.0.0.1"], "127.0.0.1", 4000, "lo")
    >>> env["HOROVOD_RANK"], env["HOROVOD_LOCAL_RANK"], env["HOROVOD_CROSS_SIZE"]
    ('1', '1', '1')
    """
    if not 0 <= rank < len(hosts):
        raise ConfigError(f"rank {rank} is outside the gang of {len(hosts)} ranks")
    if not 0 < rendezvous_port < 65536:
        raise ConfigError(f"rendezvous port {rendezvous_port} is not a TCP port")
    if not timeout_s > 0:
        raise ConfigError(f"the Gloo timeout must be positive, got timeout_s={timeout_s}")
    slot = horovod_slots(hosts, isolated_devices=isolated_devices)[rank]
    env = {
        "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
        "HOROVOD_HOSTNAME": slot.hostname,
        # Both explicit: a Horovod built with MPI as well would otherwise default to MPI.
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(max(1, math.ceil(timeout_s))),
    }
    if iface:
        env["HOROVOD_GLOO_IFACE"] = iface
        # As horovodrun does: NCCL (GPU builds) then bootstraps over the same interface.
        env["NCCL_SOCKET_IFNAME"] = iface
    return env


def start_rendezvous_server(
    bind_addr: str,
    hosts: Sequence[str],
    *,
    listener: socket.socket | None = None,
    isolated_devices: bool = False,
) -> tuple[int, Callable[[], None]]:
    """Starts Horovod's Gloo rendezvous server on one address; returns ``(port, stop)``.

    The server is Horovod's own HTTP key-value store (``horovod.runner.http``), initialised for
    the gang that ``hosts`` describes, serving from a daemon thread of this process. It has no
    authentication: anyone who reaches the port can read and overwrite the gang's rendezvous
    keys. So it listens on ``bind_addr`` only, never on every interface (Horovod's own
    ``RendezvousServer`` binds to all of them), and lives only as long as the run.

    Args:
        bind_addr: the one address to listen on: rank 0's host address, or ``127.0.0.1`` when
            every rank runs on this machine. The wildcard addresses are refused.
        hosts: every rank's host, indexed by rank, as given to ``horovod_env``.
        listener: a TCP socket already bound to ``bind_addr`` (and possibly listening) to serve
            on, for example the one the launcher binds in rank 0's task and passes to the rank
            process. Once started, the server owns it and closes it on ``stop()``; if this call
            raises, it stays open and the caller's. Without it, a free port on ``bind_addr`` is
            bound here.
        isolated_devices: as in ``horovod_slots``.

    ``stop()`` shuts the server down, closes its socket and joins its thread (bounded); it can be
    called more than once.

    >>> port, stop = start_rendezvous_server("127.0.0.1", ["127.0.0.1", "127.0.0.1"])
    >>> stop()
    """
    _check_bind_addr(bind_addr)
    slots = horovod_slots(hosts, isolated_devices=isolated_devices)
    if listener is not None:
        bound = listener.getsockname()[0]
        if _normalise(bound) != _normalise(bind_addr):
            raise ConfigError(
                f"the listener is bound to {bound!r}, not to bind_addr={bind_addr!r}"
            )
    try:
        from horovod.runner.common.util.hosts import SlotInfo
        from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer
    except ImportError as exc:
        raise BackendUnavailableError(
            f"Horovod's rendezvous server cannot be imported ({exc}). {_INSTALL_HINT}"
        ) from exc
    sock = listener or socket.create_server((bind_addr, 0), family=_family(bind_addr))
    # Rank processes start the user's subprocesses; none of them should hold the port open.
    sock.set_inheritable(False)

    class _NarrowServer(RendezvousHTTPServer):
        """Horovod's rendezvous server, serving on a socket bound beforehand."""

        socket: _Socket
        # Handler threads must not keep a finished rank alive.
        daemon_threads = True
        address_family = sock.family

        def server_bind(self) -> None:
            # socketserver made a fresh, unbound socket: replace it with ours. HTTPServer's own
            # server_bind would also call getfqdn(), a reverse DNS lookup that can hang for
            # seconds on a cluster without DNS.
            self.socket.close()
            self.socket = sock
            self.server_address = sock.getsockname()
            self.server_name = str(self.server_address[0])
            self.server_port = int(self.server_address[1])

        def server_activate(self) -> None:
            # A listening socket accepts listen() again; the backlog covers a large gang's
            # simultaneous first requests.
            self.socket.listen(max(128, 2 * len(slots)))

    try:
        httpd: Any = _NarrowServer(sock.getsockname(), RendezvousHandler, False)
        httpd.init([SlotInfo(**{name: getattr(s, name) for name in _SLOT_FIELDS}) for s in slots])
    except BaseException:
        # A socket made here is ours to close; a caller's listener stays the caller's on failure.
        if listener is None:
            sock.close()
        raise
    port = int(httpd.server_port)
    thread = threading.Thread(
        target=httpd.serve_forever,
        kwargs={"poll_interval": _POLL_INTERVAL_S},
        name=f"sparkdl-horovod-rendezvous-{port}",
        daemon=True,
    )
    thread.start()
    lock = threading.Lock()
    stopped = [False]

    def stop() -> None:
        with lock:
            if stopped[0]:
                return
            stopped[0] = True
        # Horovod's RendezvousServer.stop() never closes its socket; this one does.
        httpd.shutdown()
        httpd.server_close()
        thread.join(_STOP_JOIN_S)

    return port, stop


def check_horovod() -> str:
    """Returns Horovod's version when ``horovod.torch`` imports and was built with Gloo.

    Raises BackendUnavailableError, saying how to build it, otherwise. Call it where the ranks
    will run (and on the driver, to fail before any task starts).
    """
    try:
        import horovod
        import horovod.torch as hvd
    except ImportError as exc:
        # Also what a Horovod built against another torch gives: undefined symbols in its
        # extension. tools/build-horovod.sh keys its wheel by the torch version, so it rebuilds.
        raise BackendUnavailableError(
            f"backend='horovod' needs Horovod built with PyTorch and Gloo, but horovod.torch "
            f"cannot be imported here ({exc}). {_INSTALL_HINT}"
        ) from exc
    if not hvd.gloo_built():
        raise BackendUnavailableError(
            f"backend='horovod' needs Horovod's Gloo controller, but Horovod {horovod.__version__} "
            f"was built without it (HOROVOD_WITH_GLOO=1 at build time). {_INSTALL_HINT}"
        )
    return str(horovod.__version__)


def _check_bind_addr(addr: str) -> None:
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError as exc:
        raise ConfigError(
            f"the rendezvous server binds to one IP address, got bind_addr={addr!r}"
        ) from exc
    if ip.is_unspecified:
        # The server has no authentication: listening on every interface would expose it.
        raise ConfigError(
            f"bind_addr={addr!r} means every interface; give the rank's own address, "
            "or 127.0.0.1 when every rank runs on this machine"
        )


def _normalise(addr: str) -> str:
    return str(ipaddress.ip_address(addr))


def _family(addr: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ipaddress.ip_address(addr).version == 6 else socket.AF_INET
