"""The zygote's handshake and key without Spark (issue 17): a real zygote drops a connection that
says nothing by the handshake deadline; a task sends nothing but its nonce to an address held by a
process without the executor's key; the zygote's key file is private, and a shared one is refused.
The attacks of another user, and runs on Spark, are in tests/integration/test_tenant.py.
"""

from __future__ import annotations

import json
import secrets
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from resources import zygotes

import sparkdl
from sparkdl._internal.fs.private import secret_file
from sparkdl._internal.task.spawn import NONCE_BYTES, Zygote, ZygoteError, proof

# The fixture, shared with tests/integration/test_tenant.py.
zygote = zygotes.zygote


def test_a_silent_connection_is_dropped_after_the_handshake_deadline(zygote: Any) -> None:
    address, _, _ = zygote
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect("\0" + address)
    sock.settimeout(15)
    started = time.monotonic()
    assert sock.recv(4096) == b""
    assert time.monotonic() - started < 10
    sock.close()


def test_a_task_sends_nothing_but_a_nonce_to_an_address_held_without_the_key(tmp_path: Path) -> None:
    # A process of this very user listens at the zygote's address but cannot prove the key.
    address = f"sparkdl-test-{secrets.token_hex(8)}"
    fake = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fake.bind("\0" + address)
    fake.listen(1)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.connect("\0" + address)
    server, _ = fake.accept()
    server.settimeout(10)
    with fake, server:
        import threading

        received: list[bytes] = []

        def answer() -> None:
            hello = server.recv(4096)
            received.append(hello)
            nonce = secrets.token_bytes(NONCE_BYTES)
            wrong = proof(secrets.token_bytes(32), b"zygote", bytes.fromhex(json.loads(hello)["hello"]), nonce)
            server.send(json.dumps({"nonce": nonce.hex(), "proof": wrong.hex()}).encode())
            try:
                while data := server.recv(4096):
                    received.append(data)
            except OSError:
                pass

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        with pytest.raises(ZygoteError, match="did not prove"):
            Zygote(client, secrets.token_bytes(32), timeout_s=10)
        thread.join(timeout=10)
    assert len(received) == 1 and set(json.loads(received[0])) == {"hello"}, received


def test_the_zygote_key_file_is_private_and_a_shared_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "k.key"
    key = secret_file(path)
    assert len(key) == 32 and secret_file(path) == key
    assert path.stat().st_mode & 0o777 == 0o600
    path.chmod(0o644)
    with pytest.raises(sparkdl.ConfigError, match="not a private"):
        secret_file(path)
