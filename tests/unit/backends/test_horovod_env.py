"""Unit tests of the Horovod slot layout and environment: no Horovod, no processes, no JVM."""

from __future__ import annotations

import socket
import sys
import types

import pytest

from sparkdl._internal.backends.horovod.horovod_gloo import (
    HorovodSlot,
    check_horovod,
    horovod_env,
    horovod_slots,
    start_rendezvous_server,
)
from sparkdl._internal.common.errors import BackendUnavailableError, ConfigError


def _layout(slots: list[HorovodSlot]) -> list[tuple[int, int, int, int]]:
    return [(s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots]


@pytest.mark.parametrize(
    ("hosts", "expected"),
    [
        (["a"], [(0, 1, 0, 1)]),
        (["a", "a"], [(0, 2, 0, 1), (1, 2, 0, 1)]),
        (["a", "b"], [(0, 1, 0, 2), (0, 1, 1, 2)]),
        # What horovodrun -H a:2,b:2 assigns.
        (["a", "a", "b", "b"], [(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]),
        # A barrier stage may interleave hosts; local ranks count per host in rank order.
        (["a", "b", "a", "b"], [(0, 2, 0, 2), (0, 2, 1, 2), (1, 2, 0, 2), (1, 2, 1, 2)]),
        # Uneven hosts: only host a has a local rank 1, so its cross group has one member.
        (["a", "b", "a"], [(0, 2, 0, 2), (0, 1, 1, 2), (1, 2, 0, 1)]),
    ],
)
def test_slots_match_horovodrun_layout(
    hosts: list[str], expected: list[tuple[int, int, int, int]]
) -> None:
    slots = horovod_slots(hosts)
    assert [s.rank for s in slots] == list(range(len(hosts)))
    assert {s.size for s in slots} == {len(hosts)}
    assert [s.hostname for s in slots] == hosts
    assert _layout(slots) == expected


def test_isolated_devices_make_every_rank_its_own_local_group() -> None:
    slots = horovod_slots(["a", "a", "b"], isolated_devices=True)
    assert _layout(slots) == [(0, 1, 0, 3), (0, 1, 1, 3), (0, 1, 2, 3)]
    assert len({s.hostname for s in slots}) == 3


@pytest.mark.parametrize("hosts", [[], ["a", ""], ["a/b"]])
def test_bad_hosts_are_refused(hosts: list[str]) -> None:
    with pytest.raises(ConfigError):
        horovod_slots(hosts)


def test_env_has_everything_hvd_init_reads() -> None:
    env = horovod_env(2, ["10.0.0.1", "10.0.0.2", "10.0.0.1"], "10.0.0.1", 4321, "eth0",
                      timeout_s=7.5)
    assert env == {
        "HOROVOD_RANK": "2",
        "HOROVOD_SIZE": "3",
        "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "0",
        "HOROVOD_CROSS_SIZE": "1",
        "HOROVOD_HOSTNAME": "10.0.0.1",
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": "4321",
        "HOROVOD_GLOO_TIMEOUT_SECONDS": "8",
        "HOROVOD_GLOO_IFACE": "eth0",
        "NCCL_SOCKET_IFNAME": "eth0",
    }


def test_env_without_iface_leaves_gloo_to_choose() -> None:
    env = horovod_env(0, ["127.0.0.1"], "127.0.0.1", 4321, None)
    assert "HOROVOD_GLOO_IFACE" not in env
    assert "NCCL_SOCKET_IFNAME" not in env


@pytest.mark.parametrize(
    ("rank", "port", "timeout_s"), [(-1, 4321, 30.0), (2, 4321, 30.0), (0, 0, 30.0), (0, 4321, 0.0)]
)
def test_env_refuses_bad_values(rank: int, port: int, timeout_s: float) -> None:
    with pytest.raises(ConfigError):
        horovod_env(rank, ["a", "b"], "127.0.0.1", port, "lo", timeout_s=timeout_s)


@pytest.mark.parametrize("addr", ["0.0.0.0", "::", "", "localhost"])
def test_server_refuses_every_interface_and_names(addr: str) -> None:
    # Checked before Horovod is imported: runs without it.
    with pytest.raises(ConfigError):
        start_rendezvous_server(addr, ["127.0.0.1"])


def test_server_refuses_a_listener_bound_elsewhere() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with pytest.raises(ConfigError):
            start_rendezvous_server("127.0.0.2", ["127.0.0.1"], listener=listener)
        # Still the caller's, and still open.
        assert listener.fileno() >= 0


def test_missing_horovod_names_the_build_script(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes the import fail, as when Horovod is not installed.
    # Submodules already imported (by another test) are found by their full name: hide them too.
    hidden = {"horovod", "horovod.torch", "horovod.runner.http.http_server"}
    for name in hidden | {m for m in sys.modules if m.startswith("horovod.")}:
        monkeypatch.setitem(sys.modules, name, None)
    # The build script ships with sparkdl: the message names the command that finds it.
    with pytest.raises(BackendUnavailableError, match=r"sparkdl conf build-horovod --path"):
        check_horovod()
    with pytest.raises(BackendUnavailableError, match=r"sparkdl conf build-horovod --path"):
        start_rendezvous_server("127.0.0.1", ["127.0.0.1"])


def test_horovod_without_gloo_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch = types.ModuleType("horovod.torch")
    fake_torch.gloo_built = lambda: False  # type: ignore[attr-defined]
    fake = types.ModuleType("horovod")
    fake.__version__ = "0.28.1"  # type: ignore[attr-defined]
    fake.torch = fake_torch  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "horovod", fake)
    monkeypatch.setitem(sys.modules, "horovod.torch", fake_torch)
    with pytest.raises(BackendUnavailableError, match="HOROVOD_WITH_GLOO=1"):
        check_horovod()
