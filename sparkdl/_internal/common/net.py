"""Addresses and sockets as a Spark task sees them: a task's host, its interface, a Unix peer."""

from __future__ import annotations

import fcntl
import socket
import struct


def host_of(address: str) -> str:
    """The IP of ``host:port`` (or of a bare host), as Spark's task infos give it."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    host = host.strip("[]")
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def iface_for(ip: str) -> str | None:
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


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of a Unix socket, as the kernel tells it."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return int(pid), int(uid)
