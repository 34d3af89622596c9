"""The RunConfig of the relay tests (tests/integration/test_relay.py, and the driver's monitor of
tests/unit/driver/test_relay_record.py): every wait bounded."""

from __future__ import annotations

import sparkdl

FAST = sparkdl.RunConfig(start_timeout_s=60, connect_timeout_s=20, kill_grace_s=20)
