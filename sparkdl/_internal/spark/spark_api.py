"""What sparkdl asks of a Spark session, for a classic session and for a Spark Connect one.

A classic session has a ``SparkContext``: its confs, its status tracker (free and busy task
slots), job groups, the executors' Python. A Spark Connect client has none of that: only the
session's confs (``spark.conf``), tags on its operations (``addTag``/``interruptTag``) and
DataFrames. :func:`of` wraps either in a :class:`SparkApi`; what Connect cannot tell is None
(the callers then skip the check it fed, and the docs say which).

This is a leaf: pyspark is only touched through the session it is given.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
from collections.abc import Iterator
from typing import Any, Protocol
from urllib.parse import urlsplit

from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.spark import confs

# Where the ranks' channel back to the driver listens, when the default address is not the one
# the executors reach this driver (or Spark Connect client) at.
CHANNEL_HOST_CONF = confs.CHANNEL_HOST.name
# How the ranks report to the driver: "direct" (live, over the channel to this driver), "relay"
# (through Spark itself, at the end of each attempt: sparkdl._internal.driver.relay), "auto" (direct when
# the executors reach this driver, else relay). Default: direct on a classic session, whose
# executors reach its driver by construction; auto on Spark Connect.
CHANNEL_MODE_CONF = confs.CHANNEL.name
CHANNEL_MODES = ("direct", "relay", "auto")
LOOPBACK = "127.0.0.1"


def is_remote(session: Any) -> bool:
    """Whether ``session`` is a Spark Connect client session."""
    return type(session).__module__.startswith("pyspark.sql.connect")


def of(session: Any) -> SparkApi:
    """The :class:`SparkApi` of a classic or a Spark Connect session."""
    return ConnectApi(session) if is_remote(session) else ClassicApi(session)


def is_local_master(master: str) -> bool:
    """Whether the tasks run in the driver's JVM (``local``, ``local[N]``, ``local[N, F]``)."""
    return master == "local" or master.startswith("local[")


def master_slots(master: str, task_cpus: int) -> int | None:
    """Task slots a master URL itself fixes (``local[4]``, ``local-cluster[2,2,1024]``), else None."""
    cpus = max(1, task_cpus)
    if master == "local":
        return 1 // cpus
    if m := re.fullmatch(r"local\[(\d+)(?:,\s*\d+)?\]", master):
        return int(m.group(1)) // cpus
    if m := re.fullmatch(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]", master):
        return int(m.group(1)) * (int(m.group(2)) // cpus)  # a task runs within one worker's cores
    return None


class Confs(Protocol):
    """A session's confs, read one at a time."""

    def get(self, key: str, default: Any = None) -> Any: ...


class SparkApi:
    """One session, seen through what sparkdl needs; see the classic and Connect subclasses."""

    remote = False

    def __init__(self, session: Any) -> None:
        self.session = session

    # ---- confs and identity ------------------------------------------------------------------

    def confs(self) -> Confs:
        """The session's confs (for ``.get(key, default)``)."""
        raise NotImplementedError

    def default_fs(self) -> str | None:
        """Hadoop's default file system (``fs.defaultFS``), as far as the session's confs say."""
        value = self.confs().get("spark.hadoop.fs.defaultFS", None)
        return str(value) if value else None

    def spark_user(self) -> str | None:
        """The user Spark runs this application as, when the session says."""
        return None

    @property
    def master(self) -> str:
        return str(self.confs().get("spark.master", "") or "")

    @property
    def local(self) -> bool:
        return is_local_master(self.master)

    def default_parallelism(self) -> int:
        """Spark's default number of partitions: spark.default.parallelism, else the master's slots."""
        conf = self.confs()
        given = conf.get("spark.default.parallelism", None)
        if given:
            return max(1, int(given))
        return max(1, master_slots(self.master, 1) or 2)

    # ---- slots ---------------------------------------------------------------------------------

    def task_slots(self) -> int | None:
        """Task slots of the cluster for the default resource profile, or None when unknown."""
        return master_slots(self.master, int(self.confs().get("spark.task.cpus", "1") or 1))

    def busy_slots(self, except_tag: str | None = None) -> int | None:
        """Slots running stages hold now (less those of ``except_tag``'s jobs), None when unknown."""
        return None

    def free_slots(self, tag: str) -> int | None:
        total, busy = self.task_slots(), self.busy_slots(except_tag=tag)
        return None if total is None or busy is None else max(total - busy, 0)

    def executor_hosts(self) -> list[str]:
        return []

    # ---- jobs ------------------------------------------------------------------------------

    def scheduler_pool(self, pool: str) -> None:
        """In this thread: the jobs it submits (and those of threads it starts) go to scheduler
        pool ``pool`` (with ``spark.scheduler.mode=FAIR``, concurrent jobs share the slots
        pool by pool). Spark Connect has no local properties: nothing happens there."""

    def tag_jobs(self, tag: str, description: str) -> None:
        """In the thread that submits them: the next jobs carry ``tag`` (:meth:`cancel` stops them)."""
        raise NotImplementedError

    def untag_jobs(self, tag: str) -> None:
        """In the same thread: jobs submitted from now on no longer carry ``tag``."""

    def cancel(self, tag: str) -> None:
        """Cancels the running jobs of ``tag`` and kills their tasks."""
        raise NotImplementedError

    def server_down(self) -> str | None:
        """Why the Spark Connect server cannot be reached now (one TCP connect), None when it can
        or for a classic session (its driver is this process)."""
        return None

    def abandon(self) -> None:
        """The Spark Connect server is gone, and the session with it: its client stops retrying."""

    @contextlib.contextmanager
    def executor_python(self) -> Iterator[None]:
        """While a run builds its stages: the executors' Python, where the driver chooses it."""
        yield

    @property
    def python_exec(self) -> str:
        return str(self.confs().get("spark.pyspark.python", None) or "the executors' python3")

    # ---- the channel -------------------------------------------------------------------------

    def channel_host(self) -> str:
        """The address the ranks' tasks reach this driver's channel at."""
        raise NotImplementedError

    default_channel_mode = "direct"

    def channel_mode(self) -> str:
        """spark.sparkdl.channel: "direct", "relay" or "auto" (see :data:`CHANNEL_MODE_CONF`); read
        from the session's runtime conf, so ``spark.conf.set`` chooses it for the next run."""
        mode = str(self.session.conf.get(CHANNEL_MODE_CONF, None) or self.default_channel_mode).strip().lower()
        if mode not in CHANNEL_MODES:
            raise ConfigError(
                f"{CHANNEL_MODE_CONF}={mode!r} is not one of {', '.join(CHANNEL_MODES)}: \"direct\" when the "
                "executors reach this driver (live logs), \"relay\" when they cannot (logs and the failure "
                "report come back through Spark at the end of each attempt), \"auto\" to let the tasks find out"
            )
        return mode


class _ClassicConfs:
    """A classic session's confs for ``.get(key, default)``: Spark's from the SparkContext, and sparkdl's
    own (``spark.sparkdl.*``) from the session's runtime conf first, so that ``spark.conf.set`` chooses
    them for the next run, as it does on Spark Connect (whose confs are all runtime ones)."""

    def __init__(self, session: Any, conf: Any) -> None:
        self._session, self._conf = session, conf

    def get(self, key: str, default: Any = None) -> Any:
        if key.startswith(confs.PREFIX):
            value = self._session.conf.get(key, None)
            if value is not None:
                return value
        return self._conf.get(key, default)


class ClassicApi(SparkApi):
    """A session with a ``SparkContext`` in this process."""

    def __init__(self, session: Any) -> None:
        super().__init__(session)
        self.sc = session.sparkContext

    def confs(self) -> Confs:
        return _ClassicConfs(self.session, self.sc.getConf())

    def default_fs(self) -> str | None:
        # The Hadoop configuration: core-site.xml (HADOOP_CONF_DIR) and spark.hadoop.* together.
        value = self.sc._jsc.hadoopConfiguration().get("fs.defaultFS")
        return str(value) if value else None

    def spark_user(self) -> str | None:
        return str(self.sc.sparkUser())

    @property
    def master(self) -> str:
        return str(self.sc.master)

    def default_parallelism(self) -> int:
        return max(1, int(self.sc.defaultParallelism))

    def task_slots(self) -> int | None:
        try:
            jsc = self.sc._jsc.sc()
            profile = jsc.resourceProfileManager().defaultResourceProfile()
            return int(jsc.maxNumConcurrentTasks(profile))
        except Exception:
            return None

    def busy_slots(self, except_tag: str | None = None) -> int | None:
        try:
            tracker = self.sc.statusTracker()
            own: set[int] = set()
            if except_tag is not None:
                for job_id in tracker.getJobIdsForGroup(except_tag):
                    job = tracker.getJobInfo(job_id)
                    if job is not None:
                        own.update(job.stageIds)
            busy = 0
            for stage_id in tracker.getActiveStageIds():
                info = tracker.getStageInfo(stage_id) if stage_id not in own else None
                if info is not None:
                    busy += info.numActiveTasks
            return busy
        except Exception:  # the status tracker of a stopping context
            return None

    def executor_hosts(self) -> list[str]:
        try:
            summaries = self.sc._jsc.sc().statusStore().executorList(True)
            found = [summaries.apply(i) for i in range(summaries.size())]
            pairs = [(str(e.id()), str(e.hostPort()).rsplit(":", 1)[0]) for e in found]
        except Exception:
            return []
        executors = {host for ident, host in pairs if ident != "driver"}
        return sorted(executors or {host for _, host in pairs})

    def scheduler_pool(self, pool: str) -> None:
        self.sc.setLocalProperty("spark.scheduler.pool", pool)

    def tag_jobs(self, tag: str, description: str) -> None:
        self.sc.setJobGroup(tag, description, interruptOnCancel=True)

    def cancel(self, tag: str) -> None:
        self.sc.cancelJobGroup(tag)

    def default_python(self) -> bool:
        """Whether the Python workers run pyspark's default, ``python3`` from PATH: nobody set
        PYSPARK_PYTHON (a notebook kernel of a venv, ``.venv/bin/python script.py``)."""
        return "PYSPARK_PYTHON" not in os.environ and getattr(self.sc, "pythonExec", None) == "python3"

    @contextlib.contextmanager
    def executor_python(self) -> Iterator[None]:
        """This interpreter (which has sparkdl, torch and pyarrow) when the executors are on this
        machine (``local``, ``local-cluster``) and nobody chose another; elsewhere nothing changes."""
        if not (self.master.startswith("local") and self.default_python()):
            yield
            return
        chosen = self.sc.pythonExec
        self.sc.pythonExec = self.sc.getConf().get("spark.pyspark.python", None) or sys.executable
        try:
            yield
        finally:
            self.sc.pythonExec = chosen

    @property
    def python_exec(self) -> str:
        return str(self.sc.pythonExec)

    def channel_host(self) -> str:
        """Loopback in local mode (nothing of a local run is for other hosts), else
        spark.sparkdl.channelHost, else spark.driver.host (as an address)."""
        conf = self.confs()
        if chosen := conf.get(CHANNEL_HOST_CONF, None):
            return str(chosen)
        if self.local:
            return LOOPBACK
        host = conf.get("spark.driver.host", None) or os.environ.get("SPARK_LOCAL_IP") or LOOPBACK
        try:
            return socket.gethostbyname(host)
        except OSError:
            return str(host)


class ConnectApi(SparkApi):
    """A Spark Connect client session: the driver is a server elsewhere, reached over gRPC."""

    remote = True
    default_channel_mode = "auto"

    def __init__(self, session: Any) -> None:
        super().__init__(session)
        self._confs: dict[str, str] | None = None

    def confs(self) -> Confs:
        if self._confs is None:  # one round trip for all of them
            self._confs = dict(self.session.conf.getAll)
        return self._confs

    def tag_jobs(self, tag: str, description: str) -> None:
        self.session.addTag(tag)

    def untag_jobs(self, tag: str) -> None:
        self.session.removeTag(tag)

    def cancel(self, tag: str) -> None:
        self.session.interruptTag(tag)

    def server_down(self) -> str | None:
        host, port = self.server
        try:
            with socket.create_connection((host, port), timeout=2):
                return None
        except OSError as exc:
            return f"the Spark Connect server at {host}:{port} does not answer ({exc.strerror or exc})"

    def abandon(self) -> None:
        # The server's state went with it: the session cannot go on, even on a restarted server
        # (its client refuses a changed server-side session). Closing its channel ends the calls
        # that pyspark would otherwise retry for minutes, which would also hold up the exit.
        self.session.client.close()

    @property
    def server(self) -> tuple[str, int]:
        """The Connect server's host and port, from the client's ``sc://`` URL."""
        # The client's channel builder has the endpoint it connected to, "host:port" ("[::1]:port").
        endpoint = str(getattr(getattr(self.session.client, "_builder", None), "endpoint", ""))
        parts = urlsplit(f"//{endpoint}")
        return parts.hostname or LOOPBACK, parts.port or 15002

    def channel_host(self) -> str:
        """spark.sparkdl.channelHost, else the address of this machine on its route to the Connect
        server (the executors are near the server; the client may be a laptop or a notebook
        service they cannot reach, which the tasks then find out)."""
        if chosen := self.confs().get(CHANNEL_HOST_CONF, None):
            return str(chosen)
        host, port = self.server
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((socket.gethostbyname(host), port))  # no packet: the kernel picks the source
                return str(probe.getsockname()[0])
        except OSError:
            return LOOPBACK
