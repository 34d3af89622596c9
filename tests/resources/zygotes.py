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
    deadline = time.monotonic() + 30
    while True:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect("\0" + address)
            break
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None, "the zygote did not listen"
            time.sleep(0.05)
        finally:
            probe.close()
    try:
        yield address, key, proc
    finally:
        proc.kill()
        proc.wait(timeout=10)
