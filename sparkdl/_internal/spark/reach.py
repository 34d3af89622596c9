"""Whether a directory is shared by the driver and every executor: a marker the driver writes there
and every task must read back, with the same token, before it does anything with the directory.

A cluster is several hosts, each with disks of its own: a default directory under the driver's
temp dir exists on the driver's host only, and a task on another host that writes "there" writes
on its own disk. Checkpoints written that way are lost to every other host: a rerun would start
from nothing. So a run's checkpoint directory, and the dataset cache that executors write, are
checked before training, on every host that takes part, at the cost of one small file.
"""

from __future__ import annotations

import os
import posixpath
import secrets
import socket
from dataclasses import dataclass, field
from typing import Any

from sparkdl._internal.fs.storage import filesystem, make_dirs, redact
from sparkdl._internal.spark.spark_api import is_remote, of

PREFIX = ".sparkdl-reach-"


@dataclass(frozen=True)
class Marker:
    """A file ``<url>/.sparkdl-reach-<id>`` holding ``token``; plain and picklable.

    ``strict``: a task that does not see it stops the run before training (a directory the user
    named). Otherwise (the default run directory) the run goes on, and its first checkpoint save
    fails instead, with the same message: a run that never saves needs no shared storage.
    """

    url: str
    token: str = field(repr=False)
    strict: bool = True

    @property
    def name(self) -> str:
        return PREFIX + self.token[:16]

    @property
    def path(self) -> str:
        return self._locate()[1]

    def _locate(self) -> tuple[Any, str]:
        """The filesystem of ``url`` and the marker's path in it, from one filesystem lookup."""
        fs, root = filesystem(self.url)
        return fs, posixpath.join(root, self.name)

    @classmethod
    def plant(cls, url: str, *, strict: bool = True) -> Marker:
        """Creates ``url`` when missing and writes a fresh marker into it (on the driver)."""
        marker = cls(url, secrets.token_hex(24), strict)
        fs, path = marker._locate()
        make_dirs(fs, posixpath.dirname(path))
        with fs.open_output_stream(path) as out:
            out.write(marker.token.encode())
        return marker

    def missing(self) -> str | None:
        """None when this host reads the marker back; else what it found instead."""
        try:
            fs, path = self._locate()
            with fs.open_input_stream(path) as f:
                found = f.read(200).decode(errors="replace")
        except FileNotFoundError:
            return f"{redact(self.url)} has no file {self.name} there"
        except Exception as exc:
            return f"reading {redact(self.url)} failed: {type(exc).__name__}: {exc}"
        if found != self.token:
            return f"{redact(self.url)} holds another run's marker: this is another directory of the same name"
        return None

    def remove(self) -> None:
        """Deletes the marker; a directory that is gone already is fine."""
        try:
            fs, path = self._locate()
            fs.delete_file(path)
        except Exception:
            pass


def not_shared(url: str, rank: int, host: str, found: str, *, outcome: str) -> str:
    """Why a checkpoint directory that the task of ``rank`` on ``host`` does not see cannot be
    used, and what to set; ``outcome`` says what it stopped ("sparkdl.run stopped before training")."""
    return (
        f"{outcome}: the checkpoint directory {redact(url)} is not shared by the driver and the executors. "
        f"The driver wrote a marker there, but the task of rank {rank} on {host} does not see it: {found}. "
        "Checkpoints written there would stay on each host's own disk, and a rerun would resume from "
        "nothing. Pass checkpoint_dir= (TorchEstimator: checkpointDir) on storage that the driver and every "
        "executor reach (a shared mount, hdfs://, s3://...), or set spark.sparkdl.runDir to such storage: "
        "runs without checkpoint_dir keep their checkpoints under it, and without it under the driver's "
        "temp dir, which only local modes share"
    )


def host_name() -> str:
    """This host as Spark names it: its SPARK_LOCAL_IP when set, else its host name."""
    return os.environ.get("SPARK_LOCAL_IP") or socket.gethostname()


def probe_executors(spark: Any, marker: Marker) -> list[tuple[str, str]]:
    """``(host, what is missing)`` for each executor host of ``spark`` that does not see ``marker``.

    A Spark job of two tasks per task slot (the default parallelism) reads it back, which Spark
    spreads over the executors; an empty list when all see it. A classic session runs it as an
    RDD job; a Spark Connect client, which has no SparkContext, as
    ``spark.range(n, numPartitions=n).mapInArrow(...)`` (its default parallelism is
    ``spark.default.parallelism``, else what the master URL fixes, else 2).
    """
    if is_remote(spark):
        return _probe_over_connect(spark, marker)
    try:
        sc = spark.sparkContext
        n = 2 * max(1, int(sc.defaultParallelism))
    except Exception:
        return []

    def probe(_: Any) -> list[tuple[str, str | None]]:
        return [(host_name(), marker.missing())]

    seen = sc.parallelize(range(n), n).mapPartitions(probe).collect()
    return sorted({(host, why) for host, why in seen if why is not None})


def _probe_over_connect(spark: Any, marker: Marker) -> list[tuple[str, str]]:
    n = 2 * of(spark).default_parallelism()

    def probe(batches: Any) -> Any:
        import pyarrow as pa

        for _ in batches:  # the task's one row: what matters is where the task runs
            pass
        yield pa.RecordBatch.from_pydict({"host": [host_name()], "missing": [marker.missing()]},
                                         schema=pa.schema([("host", pa.string()), ("missing", pa.string())]))

    seen = spark.range(n, numPartitions=n).mapInArrow(probe, "host string, missing string").collect()
    return sorted({(row.host, row.missing) for row in seen if row.missing is not None})
