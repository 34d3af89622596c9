"""The driver side of a run: ``sparkdl.run``.

One run is one or more Spark jobs, each a barrier ``mapInArrow`` stage followed by a shuffle, so
that Spark itself reruns the whole gang when any rank fails (a barrier *result* stage is never
retried). The driver watches every rank over an authenticated channel, bounds every wait, stops
the job when attempts are used up, and turns what it saw into one failure report.
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sparkdl._channel import ChannelServer, FramedConnection, Message
from sparkdl._report import RankRecord, build_report, decide, unrecoverable
from sparkdl.backends import BACKENDS, get_backend
from sparkdl.checkpoint import CheckpointStore
from sparkdl.config import RunConfig
from sparkdl.errors import (
    ConfigError,
    InsufficientSlotsError,
    RunFailedError,
    RunTimeoutError,
    SparkDLError,
)
from sparkdl.metrics import MetricsLog, Progress, RunResult, log_to_mlflow
from sparkdl.worker import TaskPayload, task_main

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

T = TypeVar("T")

_RESULT_SCHEMA = "chunk long, data binary"
_DEFAULT_STAGE_ATTEMPTS = 4


def run(
    fn: Callable[..., T],
    *args: Any,
    num_workers: int,
    backend: str = "torch",
    use_gpu: bool | None = None,
    max_attempts: int | None = None,
    config: RunConfig | None = None,
    spark: SparkSession | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    **kwargs: Any,
) -> T:
    """Runs ``fn(*args, **kwargs)`` on ``num_workers`` gang-scheduled Spark tasks; returns rank 0's value.

    The same as ``launch(...).value``; see :func:`launch` for everything else.

    Example::

        def train(lr):
            ctx = sparkdl.context()
            model = DDP(Net().to(ctx.device))
            ...
            return model.module.state_dict()

        state = sparkdl.run(train, 0.1, num_workers=2)
    """
    result: RunResult = launch(
        fn,
        *args,
        num_workers=num_workers,
        backend=backend,
        use_gpu=use_gpu,
        max_attempts=max_attempts,
        config=config,
        spark=spark,
        checkpoint_dir=checkpoint_dir,
        **kwargs,
    )
    value: T = result.value
    return value


def launch(
    fn: Callable[..., Any],
    *args: Any,
    num_workers: int,
    backend: str = "torch",
    use_gpu: bool | None = None,
    max_attempts: int | None = None,
    config: RunConfig | None = None,
    spark: SparkSession | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    **kwargs: Any,
) -> RunResult:
    """Runs ``fn(*args, **kwargs)`` on ``num_workers`` gang-scheduled Spark tasks.

    Returns a :class:`RunResult`: rank 0's return value (``.value``), the metrics the ranks sent
    with ``context().log_metrics`` (``.metrics``, ``.plot()``), the run's directory and the
    number of attempts. :func:`run` returns just the value.

    Each rank runs in a process of its own with ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` set and, with the torch backend, the
    default process group already created (``dist.init_process_group()`` in ``fn`` is accepted
    too). When any rank fails, Spark reruns the whole gang, up to ``max_attempts`` times in all;
    ``sparkdl.context().attempt`` tells the rank which attempt it is in.

    Example::

        def train(lr):
            ctx = sparkdl.context()
            model = DDP(Net().to(ctx.device))
            ...
            return model.module.state_dict()

        result = sparkdl.launch(train, 0.1, num_workers=2)
        state, history = result.value, result.metrics

    Args:
        fn: the function each rank runs. It and its arguments are cloudpickled; they must not
            capture a SparkSession, SparkContext or DataFrame.
        num_workers: number of ranks, one Spark task slot each.
        backend: ``"torch"`` (torch.distributed) or ``"horovod"``.
        use_gpu: give each rank the GPUs Spark assigned to its task. ``None`` means yes when
            ``spark.task.resource.gpu.amount`` is set.
        max_attempts: runs of the gang allowed in all (overrides ``config.max_attempts``).
        config: bounds and behaviour, see :class:`RunConfig`.
        spark: the session to use; by default the active one, else a new local one.
        checkpoint_dir: where ``context().save_checkpoint`` writes: a local or shared path or
            any URL pyarrow/fsspec reach; every executor must reach it. By default a new
            directory ``<spark.sparkdl.runDir>/<run id>/checkpoints`` (the run directory defaults
            to ``<temp dir>/sparkdl-runs``, which suits local mode). Pass the same directory
            again to resume a run that the driver restarted.

    Raises:
        ConfigError: bad arguments or Spark confs, before any task starts.
        InsufficientSlotsError: the cluster cannot run ``num_workers`` tasks at once.
        RunFailedError: every attempt failed; the message is the per-rank report.
        RunTimeoutError: the gang did not start, or an attempt did not finish, within its bound.
    """
    cfg = config or RunConfig()
    if max_attempts is not None:
        cfg = cfg.replace(max_attempts=max_attempts)
    if not callable(fn):
        raise ConfigError(f"fn must be callable; got {type(fn).__name__}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ConfigError(f"num_workers must be an integer >= 1; got {num_workers!r}")
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r} is unknown; choose one of {', '.join(map(repr, BACKENDS))}")
    fn_bytes = _pickle_payload(fn, args, kwargs)
    get_backend(backend).check_driver()

    session = _resolve_session(spark, num_workers)
    sc = session.sparkContext
    gpu = _resolve_gpu(sc.getConf(), use_gpu)
    _check_cluster(sc, num_workers, cfg)
    stage_attempts = int(sc.getConf().get("spark.stage.maxConsecutiveAttempts", str(_DEFAULT_STAGE_ATTEMPTS)))
    attempts_allowed = cfg.max_attempts if cfg.max_attempts is not None else stage_attempts

    run_id = secrets.token_hex(6)
    run_dir = _run_dir(sc, run_id)
    store = CheckpointStore(checkpoint_dir or f"{run_dir}/checkpoints", keep=cfg.keep_checkpoints)
    metrics = MetricsLog(_local_metrics_path(run_dir, run_id))
    progress = Progress(cfg.progress_interval_s, cfg.progress)
    monitor = _Monitor(num_workers, attempts_allowed, cfg, store, metrics, progress)
    mlflow_on = _mlflow_enabled(sc.getConf(), cfg)
    value: Any = None
    try:
        value = _launch(session, monitor, cfg, backend, gpu, run_id, fn_bytes, store, num_workers, attempts_allowed)
    finally:
        metrics.close()
        progress.finish()
        result = RunResult(
            value=value,
            run_id=run_id,
            run_dir=run_dir,
            checkpoint_dir=store.url,
            attempts=monitor.attempts_seen(),
            records=metrics.records,
            metrics_path=str(metrics.path) if metrics.path else None,
        )
        if mlflow_on:
            # Metrics go to MLflow whether the run succeeded or not; the model only on success.
            try:
                log_to_mlflow(result, num_workers=num_workers, backend=backend, succeeded=monitor.succeeded)
            except Exception as exc:  # a tracking server's trouble must not hide the run's outcome
                print(f"sparkdl: logging to MLflow failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    return result


def _mlflow_enabled(conf: Any, cfg: RunConfig) -> bool:
    wanted = cfg.mlflow
    if wanted is None:
        wanted = str(conf.get("spark.sparkdl.mlflow.enabled", "false")).lower() == "true"
    if not wanted:
        return False
    try:
        import mlflow  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "MLflow logging is on (RunConfig.mlflow or spark.sparkdl.mlflow.enabled) but mlflow is "
            "not installed: pip install mlflow-skinny, or turn it off"
        ) from exc
    return True


def _launch(
    session: SparkSession,
    monitor: _Monitor,
    cfg: RunConfig,
    backend: str,
    gpu: bool,
    run_id: str,
    fn_bytes: bytes,
    store: CheckpointStore,
    num_workers: int,
    attempts_allowed: int,
) -> Any:
    sc = session.sparkContext
    secret = secrets.token_bytes(32)
    with ChannelServer(_driver_bind_host(sc), secret, monitor.on_message, monitor.on_close) as server:
        base_payload = TaskPayload(
            run_id=run_id,
            secret_hex=secret.hex(),
            driver_host=server.address[0],
            driver_port=server.address[1],
            fn_bytes=fn_bytes,
            backend=backend,
            use_gpu=gpu,
            num_workers=num_workers,
            collective_timeout_s=cfg.collective_timeout_s,
            connect_timeout_s=cfg.connect_timeout_s,
            init_process_group=cfg.init_process_group,
            log_tail_lines=cfg.log_tail_lines,
            checkpoint_url=store.url,
            keep_checkpoints=cfg.keep_checkpoints,
            prewarm=cfg.prewarm,
        )
        job_index = 0
        while True:
            outcome = _run_job(session, base_payload, f"sparkdl-{run_id}-{job_index}", monitor, cfg)
            job_index += 1
            if outcome.result is not None:
                import cloudpickle

                monitor.succeeded = True
                return cloudpickle.loads(outcome.result)
            used = monitor.attempts_seen()
            # A new Spark job continues the count when Spark's own stage retries ran out first.
            if outcome.stop_reason is None and monitor.any_rank_started() and used < attempts_allowed:
                continue
            raise _failure(monitor, outcome, attempts_allowed, cfg)


def _run_dir(sc: Any, run_id: str) -> str:
    import tempfile

    runs = sc.getConf().get("spark.sparkdl.runDir", None) or os.path.join(tempfile.gettempdir(), "sparkdl-runs")
    return f"{runs.rstrip('/')}/{run_id}"


def _local_metrics_path(run_dir: str, run_id: str) -> Path:
    """The metrics file: in the run's directory when that is local, else in a local one."""
    import tempfile
    from urllib.parse import urlsplit

    parts = urlsplit(run_dir)
    if len(parts.scheme) <= 1:
        return Path(run_dir) / "metrics.jsonl"
    if parts.scheme == "file":
        return Path(parts.path) / "metrics.jsonl"
    return Path(tempfile.gettempdir()) / "sparkdl-runs" / run_id / "metrics.jsonl"


def _pickle_payload(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    import cloudpickle

    try:
        return bytes(cloudpickle.dumps((fn, args, kwargs), protocol=5))
    except Exception as exc:
        raise ConfigError(
            f"fn or its arguments cannot be pickled for the Spark workers: {type(exc).__name__}: {exc}. "
            "Functions sent to workers must not capture a SparkSession, SparkContext, DataFrame, "
            "lock, open file or socket; pass plain values (paths, a sparkdl.Dataset) instead"
        ) from exc


def _resolve_session(spark: SparkSession | None, num_workers: int) -> SparkSession:
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if spark is not None and active is not None and spark is not active:
        raise ConfigError(
            "the SparkSession passed as spark= is not the active session of this process; "
            "pass the active session (SparkSession.getActiveSession()) or none"
        )
    session = spark or active
    if session is None:
        # PySpark takes its workers' Python from PYSPARK_PYTHON, not from a builder conf: without
        # it, executors would run whatever "python3" is first on PATH, without torch or sparkdl.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        cores = max(num_workers, os.cpu_count() or 1)
        session = (
            SparkSession.builder.master(f"local[{cores}]")
            .appName("sparkdl")
            .config("spark.pyspark.python", sys.executable)
            .config("spark.driver.host", os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"))
            .config("spark.driver.bindAddress", os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"))
            .getOrCreate()
        )
    if type(session).__module__.startswith("pyspark.sql.connect"):
        raise ConfigError(
            "sparkdl.run needs a classic SparkSession (it talks to the SparkContext); "
            "this is a Spark Connect session. Run the driver code on the cluster's driver instead"
        )
    sc = session.sparkContext
    if sc._jsc is None:
        raise ConfigError("the SparkSession has been stopped; create a new one before sparkdl.run")
    return session


def _resolve_gpu(conf: Any, use_gpu: bool | None) -> bool:
    amount = conf.get("spark.task.resource.gpu.amount", None)
    has_task_gpus = amount is not None and float(amount) > 0
    if use_gpu is None:
        return has_task_gpus
    if use_gpu and not has_task_gpus:
        raise ConfigError(
            "use_gpu=True but 'spark.task.resource.gpu.amount' is unset, so Spark assigns no GPU to "
            "tasks. Set spark.task.resource.gpu.amount=1, spark.executor.resource.gpu.amount and "
            "spark.executor.resource.gpu.discoveryScript (conf/spark-defaults.gpu.conf shows them), "
            "or pass use_gpu=False"
        )
    return bool(use_gpu)


def _task_slots(sc: Any) -> int | None:
    """Task slots of the cluster for the default resource profile (cores, GPUs and spark.task.cpus)."""
    try:
        jsc = sc._jsc.sc()
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    except Exception:
        return None


def _busy_slots(sc: Any) -> int:
    tracker = sc.statusTracker()
    busy = 0
    for stage_id in tracker.getActiveStageIds():
        info = tracker.getStageInfo(stage_id)
        if info is not None:
            busy += info.numActiveTasks
    return busy


def _check_cluster(sc: Any, num_workers: int, cfg: RunConfig) -> None:
    conf = sc.getConf()
    master = sc.master
    if not master.startswith("local") and conf.get("spark.dynamicAllocation.enabled", "false") == "true":
        raise ConfigError(
            "Spark's barrier mode, which sparkdl.run uses, does not support dynamic allocation: "
            "set spark.dynamicAllocation.enabled=false for this application"
        )
    deadline = time.monotonic() + cfg.slot_wait_s
    while True:
        total = _task_slots(sc)
        if total is None:
            return
        free = total - _busy_slots(sc)
        if free >= num_workers:
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    task_cpus = conf.get("spark.task.cpus", "1")
    gpu_part = ""
    if conf.get("spark.task.resource.gpu.amount", None):
        gpu_part = (
            f", spark.task.resource.gpu.amount={conf.get('spark.task.resource.gpu.amount')} and "
            f"spark.executor.resource.gpu.amount={conf.get('spark.executor.resource.gpu.amount', 'unset')}"
        )
    raise InsufficientSlotsError(
        f"num_workers={num_workers} needs {num_workers} task slots at once, but the cluster has "
        f"{total} (master {master}, spark.task.cpus={task_cpus}{gpu_part}) of which {free} are free "
        f"after waiting {cfg.slot_wait_s:g} s (RunConfig.slot_wait_s). Lower num_workers, or add "
        "executors or cores (spark.executor.instances, spark.executor.cores, local[N]), or lower "
        "spark.task.cpus",
        required=num_workers,
        available=max(free, 0),
    )


def _driver_bind_host(sc: Any) -> str:
    """The address tasks reach the driver on: loopback in local mode, spark.driver.host otherwise."""
    import socket

    host = sc.getConf().get("spark.driver.host", None) or os.environ.get("SPARK_LOCAL_IP") or "127.0.0.1"
    if sc.master.startswith("local[") or sc.master == "local":
        host = os.environ.get("SPARK_LOCAL_IP", host)
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


class _Outcome:
    def __init__(self) -> None:
        self.result: bytes | None = None
        self.error: BaseException | None = None
        self.stop_reason: str | None = None
        self.timed_out = False


class _Monitor:
    """What the driver knows about every rank of every attempt; fed by the channel's threads."""

    def __init__(
        self,
        num_workers: int,
        max_attempts: int,
        cfg: RunConfig,
        store: CheckpointStore,
        metrics: MetricsLog,
        progress: Progress,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.progress = progress
        self._start_seq: dict[int, int | None] = {}
        self._settled: set[int] = set()
        self.num_workers = num_workers
        self.max_attempts = max_attempts
        self.cfg = cfg
        self.cond = threading.Condition()
        self.records: dict[tuple[int, int], RankRecord] = {}
        self._conn_key: dict[int, tuple[int, int]] = {}
        self._partial: dict[tuple[int, int, str], str] = {}
        self._hellos: dict[int, Message] = {}
        self._gangs: dict[tuple[int, ...], int] = {}
        self.stopping: str | None = None
        self.gave_up: str | None = None
        self.succeeded = False
        self.last_trouble = time.monotonic()
        self.running_since: float | None = None

    def attempts_seen(self) -> int:
        with self.cond:
            return len(self._gangs)

    def any_rank_started(self) -> bool:
        with self.cond:
            return bool(self._gangs)

    def on_message(self, conn: FramedConnection, msg: Message) -> None:
        kind = msg.get("t")
        if kind == "log":
            self._on_log((int(msg["a"]), int(msg["r"])), msg)
            return
        if kind == "metric" and isinstance(msg.get("m"), dict):
            # The frame's rank and attempt are the task's; the record cannot claim others.
            record = {**msg["m"], "rank": int(msg["r"]), "attempt": int(msg["a"])}
            self.metrics.add(record)
            self.progress.update(record)
            return
        with self.cond:
            if kind == "hello":
                self._hellos[id(conn)] = msg
            elif kind == "gang":
                self._on_gang(conn, msg)
            elif kind in ("started", "exit"):
                self._on_rank_event(self.records[(int(msg["a"]), int(msg["r"]))], msg)
            self.cond.notify_all()

    def _on_gang(self, conn: FramedConnection, msg: Message) -> None:
        hello = self._hellos.pop(id(conn), {})
        tids = tuple(int(t) for t in msg["tids"])
        attempt = self._gangs.setdefault(tids, len(self._gangs))
        rank = int(msg["r"])
        refuse = self.stopping or (
            f"attempt {attempt} exceeds max_attempts={self.max_attempts}"
            if attempt >= self.max_attempts
            else None
        )
        if refuse:
            conn.send({"go": False, "reason": refuse})
            return
        rec = RankRecord(attempt=attempt, rank=rank, host=str(hello.get("host", "?")))
        rec.task_pid = hello.get("task_pid")
        self.records[(attempt, rank)] = rec
        self._conn_key[id(conn)] = (attempt, rank)
        conn.send({"go": True, "attempt": attempt})
        if sum(1 for (a, _) in self.records if a == attempt) == self.num_workers:
            self.running_since = time.monotonic()

    def _on_rank_event(self, rec: RankRecord, msg: Message) -> None:
        if msg["t"] == "started":
            rec.pid = msg.get("pid")
            rec.state = "running"
            return
        rec.exit_code = msg.get("code")
        rec.signal = msg.get("signal")
        if rec.exit_code == 0 and rec.signal is None:
            rec.state = "succeeded"
            return
        rec.state = "failed"
        rec.error = msg.get("error")
        rec.traceback = msg.get("traceback")
        rec.failed_at = time.monotonic()
        self._trouble()

    def on_close(self, conn: FramedConnection, reason: str | None) -> None:
        with self.cond:
            self._hellos.pop(id(conn), None)
            key = self._conn_key.pop(id(conn), None)
            if key is None:
                return
            rec = self.records[key]
            if rec.state in ("starting", "running") and self.stopping is None:
                rec.state = "lost"
                rec.failed_at = time.monotonic()
                self._trouble()
            self.cond.notify_all()

    def _trouble(self) -> None:
        # A failure ends the attempt; the clock for the next gang to start runs from here.
        self.last_trouble = time.monotonic()
        self.running_since = None

    def _on_log(self, key: tuple[int, int], msg: Message) -> None:
        stream = str(msg.get("s", "o"))
        pkey = (*key, stream)
        piece = str(msg.get("l", ""))
        if msg.get("more"):
            self._partial[pkey] = self._partial.get(pkey, "") + piece
            return
        line = self._partial.pop(pkey, "") + piece
        with self.cond:
            rec = self.records.get(key)
            if rec is not None and self.cfg.log_tail_lines:
                rec.tail.append(line)
                del rec.tail[: -self.cfg.log_tail_lines]
        if self.cfg.echo_logs:
            attempt, rank = key
            tag = f"[rank {rank}]" if attempt == 0 else f"[rank {rank}, attempt {attempt}]"
            out = sys.stderr if stream == "e" else sys.stdout
            out.write(f"{tag} {line}\n")
            out.flush()

    def failed_attempts(self) -> list[int]:
        return sorted({a for (a, _), r in self.records.items() if r.failed})

    def _latest_checkpoint(self) -> int | None:
        try:
            return self.store.latest()
        except Exception:
            return None

    def _attempt_records(self, attempt: int) -> list[RankRecord]:
        return [r for (a, _), r in self.records.items() if a == attempt]

    def check(self, job_started: float) -> tuple[str, bool] | None:
        """A reason to stop the job now, and whether it is a timeout; None to keep waiting."""
        now = time.monotonic()
        for attempt in range(len(self._gangs)):
            if attempt not in self._start_seq:
                self._start_seq[attempt] = self._latest_checkpoint()
        for attempt in self.failed_attempts():
            if decide(attempt, self.max_attempts) == "stop":
                return f"attempt {attempt} failed and max_attempts={self.max_attempts} are used up", False
            if not self.cfg.stop_on_repeated_error or attempt in self._settled:
                continue
            recs = self._attempt_records(attempt)
            first = min((r.failed_at for r in recs if r.failed_at is not None), default=now)
            terminal = all(r.state in ("succeeded", "failed", "lost") for r in recs)
            if not (terminal or attempt + 1 < len(self._gangs) or now - first > 10.0):
                continue  # wait for the other ranks' outcomes of this attempt
            self._settled.add(attempt)
            progressed = self._latest_checkpoint() != self._start_seq.get(attempt)
            why = unrecoverable(recs, self._attempt_records(attempt - 1), progressed=progressed)
            if why is not None:
                self.gave_up = why
                return f"not rerunning the gang: {why} (RunConfig.stop_on_repeated_error)", False
        if self.running_since is None:
            waiting = now - max(self.last_trouble, job_started)
            if waiting > self.cfg.start_timeout_s:
                here = len(self._hellos)
                return (
                    f"only {here} of {self.num_workers} ranks started within "
                    f"start_timeout_s={self.cfg.start_timeout_s:g} s (RunConfig.start_timeout_s); "
                    "the cluster's task slots may be busy with other jobs",
                    True,
                )
        elif self.cfg.timeout_s is not None and now - self.running_since > self.cfg.timeout_s:
            return (
                f"the attempt ran longer than timeout_s={self.cfg.timeout_s:g} s (RunConfig.timeout_s)",
                True,
            )
        return None


def _run_job(
    session: SparkSession, payload: TaskPayload, group: str, monitor: _Monitor, cfg: RunConfig
) -> _Outcome:
    from pyspark import InheritableThread

    sc = session.sparkContext
    outcome = _Outcome()
    done = threading.Event()
    n = payload.num_workers

    def job() -> None:
        try:
            sc.setJobGroup(group, f"sparkdl.run: {n} ranks", interruptOnCancel=True)
            df: Any = (
                session.range(0, n, 1, n)
                .mapInArrow(functools.partial(task_main, payload), _RESULT_SCHEMA, barrier=True)
                .repartition(1)
            )
            if hasattr(df, "toArrow"):
                table = df.toArrow()
                chunks = sorted(
                    zip(table.column("chunk").to_pylist(), table.column("data").to_pylist(), strict=True)
                )
            else:  # pyspark 3.5
                batches = df._collect_as_arrow()
                chunks = sorted(
                    pair
                    for b in batches
                    for pair in zip(b.column(0).to_pylist(), b.column(1).to_pylist(), strict=True)
                )
            if not chunks:
                raise SparkDLError("rank 0 finished but sent no return value back (internal error)")
            outcome.result = b"".join(data for _, data in chunks)
        except BaseException as exc:
            outcome.error = exc
        finally:
            done.set()
            with monitor.cond:
                monitor.cond.notify_all()

    started = time.monotonic()
    thread = InheritableThread(target=job, name=f"sparkdl-job-{group}", daemon=True)
    thread.start()
    try:
        with monitor.cond:
            while not done.is_set():
                verdict = monitor.check(started)
                if verdict is not None:
                    outcome.stop_reason, outcome.timed_out = verdict
                    monitor.stopping = outcome.stop_reason
                    break
                monitor.cond.wait(timeout=0.25)
    except BaseException:
        # Ctrl-C in a notebook or console: stop the gang before giving control back.
        monitor.stopping = "the driver was interrupted"
        sc.cancelJobGroup(group)
        done.wait(cfg.kill_grace_s)
        raise
    if outcome.stop_reason is not None:
        sc.cancelJobGroup(group)
        done.wait(cfg.kill_grace_s)
        outcome.result = None
    else:
        thread.join()
    return outcome


def _spark_error_text(exc: BaseException | None) -> str | None:
    if exc is None:
        return None
    text = str(exc)
    match = re.search(r"(RankFailed|SparkException|Exception)[:\s].*", text)
    return match.group(0) if match else text


def _failure(monitor: _Monitor, outcome: _Outcome, max_attempts: int, cfg: RunConfig) -> SparkDLError:
    records = sorted(monitor.records.values(), key=lambda r: (r.attempt, r.rank))
    spark_error = _spark_error_text(outcome.error)
    if not records:
        text = str(outcome.error)
        if "No module named 'sparkdl'" in text:
            return ConfigError(
                "the executors' Python cannot import sparkdl: install sparkdl where the executors "
                "run, or point spark.pyspark.python (PYSPARK_PYTHON) at an environment that has it"
            )
        if outcome.timed_out and outcome.stop_reason:
            return RunTimeoutError(
                f"sparkdl.run stopped: {outcome.stop_reason}", attempts=0, root_cause=outcome.stop_reason
            )
        return RunFailedError(
            f"sparkdl.run failed before any rank started: {spark_error}", attempts=0, root_cause=str(spark_error)
        )
    attempts = monitor.attempts_seen()
    if outcome.timed_out and outcome.stop_reason:
        headline = f"sparkdl.run stopped on attempt {attempts - 1}: {outcome.stop_reason}."
        hint = "Raise the bound named above if the run needs longer."
        report, root = build_report(records, headline=headline, hint=hint, spark_error=None)
        return RunTimeoutError(report, attempts=attempts, root_cause=outcome.stop_reason)
    headline = f"sparkdl.run failed after {attempts} attempt(s) of the gang (max_attempts={max_attempts})."
    if monitor.gave_up:
        headline += (
            f" It stopped early: {monitor.gave_up}. To rerun anyway, set "
            "RunConfig(stop_on_repeated_error=False)."
        )
    hint = (
        "Fix the root cause above; to allow more reruns of the gang, raise max_attempts "
        f"(now {max_attempts})."
    )
    report, root = build_report(records, headline=headline, hint=hint)
    return RunFailedError(report, attempts=attempts, root_cause=root)
