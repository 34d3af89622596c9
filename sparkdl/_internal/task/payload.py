"""What the driver ships to every task of a gang: :class:`TaskPayload`."""

from __future__ import annotations

from dataclasses import dataclass, field

from sparkdl._internal.spark.reach import Marker
from sparkdl._internal.wire.rankspec import RunSpec
from sparkdl._internal.wire.relay_record import HubFactory


@dataclass(frozen=True)
class TaskPayload:
    """Everything a task needs, as plain values: the only thing shipped from driver to tasks."""

    run: RunSpec
    fn_bytes: bytes
    secret_hex: str = field(repr=False)  # never in a log line or a traceback's locals
    driver_host: str
    driver_port: int
    # The address the ranks listen on (TCPStore, gloo): loopback in local mode, else None for the
    # task's own address as Spark gives it.
    rank_host: str | None = None
    # The driver's marker in the checkpoint directory: every task must read it back before its
    # rank starts (a directory on the driver's own disk is not where other hosts' ranks write).
    checkpoints: Marker | None = None
    # How the task reports (sparkdl._internal.spark.spark_api.CHANNEL_MODES): "direct" to the driver, "relay"
    # through the hub in task 0 and Spark's result rows, "auto" direct when it reaches the driver.
    channel: str = "direct"
    # With "relay"/"auto": what task 0 starts as the gang's hub (sparkdl._internal.driver.relay.Hub,
    # a driver-side class shipped by the driver, as the task may not import it), and the attempt
    # number it gives the gang.
    hub: HubFactory | None = None
    first_attempt: int = 0
