"""The ``zygote`` fixture of the tenant tests (tests/integration/test_tenant.py,
tests/unit/task/test_zygote_tenant.py): a real zygote with a known key, tied to the test process."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def zygote(tmp_path: Path) -> Any:
    """A real zygote with a known key, tied to this test process; ended after the test."""
    key = secrets.token_bytes(32)
    address = f"sparkdl-test-{secrets.token_hex(8)}"
    proc = subprocess.Popen([sys.executable, "-m", "sparkdl._internal.task.zygote", address, str(os.getpid())],
                            stdin=subprocess.PIPE, start_new_session=True)
    assert proc.stdin is not None
    proc.stdin.write(key.hex().encode() + b"\n")
    proc.stdin.close()
    # The zygote binds its address before it imports torch, and its handshake clock starts when it
    # accepts a connection: wait until it serves (it closes a probe that sends it garbage), so that a
    # test timing the handshake deadline does not also time the imports of a busy machine.
    deadline = time.monotonic() + 60
    while True:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect("\0" + address)
            probe.settimeout(max(0.1, deadline - time.monotonic()))
            probe.send(b"not a handshake")
            if probe.recv(64) == b"":
                break
        except OSError:
            pass
        finally:
            probe.close()
        assert time.monotonic() < deadline and proc.poll() is None, "the zygote did not serve within 60 s"
        time.sleep(0.05)
    try:
        yield address, key, proc
    finally:
        proc.kill()
        proc.wait(timeout=10)
