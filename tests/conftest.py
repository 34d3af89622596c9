"""Shared fixtures and the rules of the suite.

Where a test goes (the folder decides its tier and markers; see docs/contributing.md, "Where a test goes"):

- ``tests/unit/<package path>/``: no JVM and no Spark session (a guard fails a unit test that
  starts either); mirrors ``sparkdl/``.
- ``tests/integration/``: one Spark session in this process (``local[N]``), marked ``spark``.
- ``tests/cluster/``: several executor JVMs (``local-cluster``, standalone, namespaced hosts),
  marked ``spark`` and ``cluster``.
- ``tests/e2e/``: whole programs (jobs, notebooks, the CLI, Spark Connect clients), marked
  ``spark`` and ``e2e``.

Spark allows one SparkContext per process. Tests ask for the session they need through
``spark_session(master, conf)``; a request for the same master and confs reuses the running
session, another stops it and starts the new one. Fixtures that start a session say which with
``@needs_session(label)``, and the tests run grouped by it: the unit tier, then each session's
tests (local[N] first), then those that start no session here, so that each starts once.

Tests may run in parallel (``pytest -n 2``, pytest-xdist): each worker has its own Spark session,
temp dirs and ports, and every process a worker starts carries its tag (``SPARKDL_TEST_TAG``), so
that leak checks count only what this worker started. Tests that must not share a worker's
neighbour, or that share something expensive (one Connect server, one namespaced cluster), are
kept on one worker by an ``xdist_group``.

Unit tests that cannot behave differently on the two stacks run on one of them when tools/test
runs both (``tests/stack_rule.py``); each stack's summary says which and why. ``tools/test --full``
runs all on both.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
# tools/ (standalone_cluster.py, netns_cluster.py, connect_server.py) and tests/ (resources/,
# stack_rule.py) are not packages: tests in every tier import their modules by name.
for _path in (REPO / "tools", TESTS):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import stack_rule  # noqa: E402

# Everything stays on loopback, and executors use this interpreter (the project's .venv).
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable

# Every JVM the tests start (the sessions' drivers and executors, standalone and namespaced
# daemons, spark-submit, the notebooks' and the Connect server's) compiles with C1 only and
# collects with the serial GC: they live seconds to minutes, and on a 2-core machine C2's compiler
# threads and G1's cost more than they give back (the cluster tests: the executors' CPU 225 s ->
# 130 s, wall 389-403 s -> 244-326 s). Benchmarks run outside pytest, with Java's defaults.
# SPARKDL_TEST_JVM_OPTS="" keeps Java's defaults here too.
JVM_OPTS = os.environ.get("SPARKDL_TEST_JVM_OPTS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
if JVM_OPTS and JVM_OPTS not in os.environ.get("JAVA_TOOL_OPTIONS", ""):
    os.environ["JAVA_TOOL_OPTIONS"] = f"{os.environ.get('JAVA_TOOL_OPTIONS', '')} {JVM_OPTS}".strip()
# ... and maps Spark's classes from an archive made once per Java and pyspark install
# (tests/resources/jvm_archive.py: a session's start 10 -> 6 s of CPU). SPARKDL_TEST_JVM_ARCHIVE=0: none.
JVM_ARCHIVE = os.environ.get("SPARKDL_TEST_JVM_ARCHIVE", "1") != "0"

# Every process this test process starts inherits the tag (JVMs, Python workers, zygotes, ranks,
# MPI daemons, servers): what another worker, or another stack's run, started is not ours.
TEST_TAG_ENV = "SPARKDL_TEST_TAG"
TEST_TAG = f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}-{secrets.token_hex(3)}"
os.environ[TEST_TAG_ENV] = TEST_TAG

TIERS = ("unit", "integration", "cluster", "e2e")
_PARALLEL_ORDER = ("cluster", "e2e", "integration", "unit")
_TIER_MARKS = {"unit": ("unit",), "integration": ("spark",), "cluster": ("spark", "cluster"), "e2e": ("spark", "e2e")}
# Modules that share one expensive thing, or look at the whole machine, run on one worker.
_SHARED_GROUPS = {
    "connect": ("test_connect.py", "test_connect_ml.py", "test_connect_relay.py", "test_cli_connect.py"),
    "netns": ("test_netns_hosts.py", "test_netns_tool.py"),
}


def tier_of(path: Path) -> str:
    """The tier of a test file: the folder under tests/ it sits in."""
    rel = Path(path).resolve().relative_to(TESTS)
    if len(rel.parts) < 2 or rel.parts[0] not in TIERS:
        raise pytest.UsageError(
            f"{rel}: every test file lives in one of tests/{{{','.join(TIERS)}}}/ (see 'Where a test goes' in docs/contributing.md)"
        )
    return rel.parts[0]


# The stack that runs the namespaced hosts (tests/cluster/test_netns_hosts.py) for both when both
# run; the other runs the loopback standalone cluster's jobs instead (tests/cluster/test_standalone.py).
NETNS_STACK = "classic"


def running_stacks() -> list[str]:
    """The stacks this invocation of tools/test runs (``SPARKDL_TEST_STACKS``); [] when unknown."""
    return os.environ.get("SPARKDL_TEST_STACKS", "").split()


def current_stack() -> str:
    """modern or classic: what tools/test says, else what tools/bootstrap.sh wrote in the venv."""
    if stack := os.environ.get("SPARKDL_STACK"):
        return stack
    stamp = Path(sys.prefix) / ".sparkdl-stack"
    return stamp.read_text().strip() if stamp.is_file() else "modern"


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    # SIGTERM (tools/test stopping a stack that runs in the background, CI giving up) ends the run
    # as Ctrl-C does, through the fixtures' teardown: clusters, namespaces, servers and accounts go.
    # A background job of a shell starts with SIGINT ignored; it interrupts here all the same.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--every-stack", action="store_true", default=False,
        help="run every test on this stack, also those the classic stack leaves to the modern one (tools/test --full)",
    )


def owned(proc: psutil.Process) -> bool:
    """Whether this test process started ``proc``: it carries our tag, or descends from us."""
    with contextlib.suppress(psutil.Error, OSError):
        if proc.environ().get(TEST_TAG_ENV) == TEST_TAG:
            return True
    with contextlib.suppress(psutil.Error):
        return any(parent.pid == os.getpid() for parent in proc.parents())
    return False


_BASE_CONF = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.python.worker.reuse": "true",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.driver.memory": "1g",
}

_current: dict[str, object] = {}
# Sessions started by this process, by (master, confs): a key started twice is a restart that a
# better order would have saved; the summary lists them.
_started: list[tuple[str, tuple[tuple[str, str], ...]]] = []
_unit_item: dict[str, str] = {}  # the unit test now running, if any: it may ask for no session


def _wait_for_executors(session: Any, master: str, bound_s: float = 120) -> None:
    """A ``local-cluster[N,...]`` session once its N executors have registered: tests that count
    on the slots (a run's ``slot_wait_s`` is a few seconds in tests) must not race the executors'
    start, which takes tens of seconds on a loaded 2-core machine."""
    import re

    from sparkdl._internal.cli.executors import _wait_for_executors as registered

    m = re.match(r"local-cluster\[(\d+),", master)
    if m is None:
        return
    want = int(m.group(1))
    if (have := registered(session.sparkContext, want, bound_s)) < want:
        raise AssertionError(f"{master}: {have} of {want} executors registered after {bound_s:.0f} s")


def _get_session(master: str, conf: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    from pyspark.sql import SparkSession

    if _unit_item:
        raise AssertionError(
            f"{_unit_item['nodeid']} asked for a Spark session: tests/unit is for tests without a JVM; "
            "move it to tests/integration (one session) or tests/cluster"
        )
    key = (master, tuple(sorted((conf or {}).items())))
    if _current.get("key") == key:
        session = _current["session"]
        _wait_for_executors(session, master)  # a test before may have killed one (Spark starts another)
        return session
    old = _current.get("session")
    if old is not None:
        old.stop()  # type: ignore[attr-defined]
        _current.clear()
    builder = SparkSession.builder.master(master).appName("sparkdl-tests")
    for k, v in {**_BASE_CONF, **(conf or {})}.items():
        builder = builder.config(k, v)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    _wait_for_executors(session, master)
    _current.update(key=key, session=session)
    _started.append(key)
    return session


_SESSION_LABEL = "_sparkdl_session_label"
_LATE_FIXTURES = {"connect_server", "netns_clusters"}
# The local-cluster most cluster tests share: two executors of one core each.
LOCAL_CLUSTER, LOCAL_CLUSTER_CONF = "local-cluster[2,1,1024]", {"spark.executor.memory": "512m"}


def needs_session(label: str | Callable[[Any], str]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declares the Spark session a fixture asks ``spark_session`` for: ``label`` names its master
    and confs (tests whose fixtures give one label share a session), or is a function of the
    fixture's param. Put it under ``@pytest.fixture``. Collection runs the tests of one label
    together (``_by_session``), so that each configuration starts once; a fixture without it still
    works, at the price of the restarts that the summary lists."""

    def mark(func: Callable[..., Any]) -> Callable[..., Any]:
        setattr(func, _SESSION_LABEL, label)
        return func

    return mark


def session_label(item: pytest.Item) -> str | None:
    """The session ``item`` runs under: the label of a fixture it asks for itself, else of one its
    fixtures ask for (a module's dataset written on ``spark``); None when it starts no session."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    direct, indirect = None, None
    for name in item.fixturenames:
        defs = info.name2fixturedefs.get(name)
        label = getattr(defs[-1].func, _SESSION_LABEL, None) if defs else None
        if callable(label):
            callspec = getattr(item, "callspec", None)
            label = label(callspec.params.get(name) if callspec else None)
        if label is None:
            continue
        if name in info.argnames:
            direct = label
        else:
            indirect = indirect or label
    return direct or indirect


def _by_session(items: list[pytest.Item], tiers: dict[str, str]) -> None:
    """Sorts ``items`` (in tier order) so that each session starts once: the unit tests, then the
    tests of each session label, the ``local[N]`` ones first and each label in the order it first
    comes, then the tests that start no session here (they run programs: jobs, notebooks, servers,
    clusters of their own). Within a label, tests keep their order, so a module's tests stay
    together; a module whose tests need two sessions sets up its module fixtures once per label.
    A test that also needs the Spark Connect server or the namespaced cluster runs with the last
    ones, so that the server is not started early and kept through the rest of the suite."""
    labels = {item.nodeid: None if _LATE_FIXTURES & set(item.fixturenames) else session_label(item) for item in items}
    first: dict[str, int] = {}
    for item in items:
        if (label := labels[item.nodeid]) is not None:
            first.setdefault(label, len(first))
    index = {item.nodeid: i for i, item in enumerate(items)}

    def key(item: pytest.Item) -> tuple[int, int, int]:
        label = labels[item.nodeid]
        if tiers[item.nodeid] == "unit":
            return (0, 0, index[item.nodeid])
        if label is None:
            return (3, 0, index[item.nodeid])
        return (2 if label.startswith("local-cluster") else 1, first[label], index[item.nodeid])

    items.sort(key=key)


@pytest.fixture(scope="session")
def spark_session() -> Iterator[Callable[..., object]]:
    """A factory: ``spark_session("local[2]")`` or ``spark_session("local-cluster[2,1,1024]", conf)``."""
    yield _get_session
    session = _current.get("session")
    if session is not None:
        session.stop()  # type: ignore[attr-defined]
        _current.clear()


@pytest.fixture(scope="module")
@needs_session("local[2]")
def spark(spark_session):  # type: ignore[no-untyped-def]
    """The shared local[2] session."""
    return spark_session("local[2]")


@pytest.fixture(scope="module")
def any_spark(spark_session):  # type: ignore[no-untyped-def]
    """The session running now, whatever its master, else the shared local[2] one: for a module
    fixture that only writes a small dataset or trains a reference, so that it does not pull the
    module's tests that run on another session back to local[2]. Tests ask for their own session
    fixture first (``spark``, ``local_cluster``), so that it is the one running when this is made."""
    session = _current.get("session")
    return session if session is not None else spark_session("local[2]")


@pytest.fixture(scope="module")
@needs_session(LOCAL_CLUSTER)
def local_cluster(spark_session):  # type: ignore[no-untyped-def]
    """The shared ``local-cluster[2,1,1024]`` session: two executors, one task slot each."""
    return spark_session(LOCAL_CLUSTER, LOCAL_CLUSTER_CONF)


def _group_of(item: pytest.Item, tier: str) -> str:
    name = Path(str(item.fspath)).name
    for group, files in _SHARED_GROUPS.items():
        if name in files:
            return group
    # A module's tests stay together (its module fixtures start once); unit tests spread freely.
    return "" if tier == "unit" else str(Path(str(item.fspath)).relative_to(TESTS))


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the xdist_group markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers = {}
    for item in items:
        tier = tiers[item.nodeid] = tier_of(Path(str(item.fspath)))
        for mark in _TIER_MARKS[tier]:
            item.add_marker(mark)
        if group := _group_of(item, tier):
            item.add_marker(pytest.mark.xdist_group(group))
    # One process: tiers in order, so that the local[2] session serves everything up to the
    # cluster tests. Test workers (xdist) take groups in this order as they free up: the longest
    # (the shared groups, then cluster and e2e modules) first, the many short unit tests last to
    # fill the tail. Within a tier, local-cluster tests come after the local[N] ones.
    if "PYTEST_XDIST_WORKER" in os.environ:
        def key(item: pytest.Item) -> tuple[int, ...]:
            shared = _group_of(item, tiers[item.nodeid]) in _SHARED_GROUPS
            return (0 if shared else 1, _PARALLEL_ORDER.index(tiers[item.nodeid]), 1 if item.get_closest_marker("cluster") else 0)
        items.sort(key=key)
    else:
        items.sort(key=lambda item: TIERS.index(tiers[item.nodeid]))
        _by_session(items, tiers)

    stack = current_stack()
    running = running_stacks()
    kept: dict[str, list[Any]] = {}  # tests this stack runs for both: path -> [count, reason]
    left: dict[str, list[Any]] = {}  # tests this stack leaves to the other: path -> [count, reason, stack]
    leave = []
    every = config.getoption("--every-stack")
    for item in items:
        path = Path(str(item.fspath))
        if (scenario := item.get_closest_marker("one_stack")) is not None:
            # A whole program whose stack-dependent paths other tests walk on both stacks.
            reason, home = scenario.args[1], scenario.args[0]
            home, why = (stack, "") if every or set(running) != {"modern", "classic"} else (home, "its marker's choice")
        else:
            reason = stack_rule.one_stack_enough(path, tiers[item.nodeid])
            if reason is None or item.get_closest_marker("both_stacks"):
                continue
            home, why = (stack, "") if every else stack_rule.home_stack(path, running, stack)
        where = str(path.relative_to(REPO))
        if home == stack:
            kept.setdefault(where, [0, reason])[0] += 1
        else:
            leave.append(item)
            left.setdefault(where, [0, f"{reason}; on the {home} stack: {why}", home])[0] += 1
    if leave:
        config.hook.pytest_deselected(items=leave)
        gone = set(leave)
        items[:] = [item for item in items if item not in gone]
    report = {"stack": stack, "selected": len(items), "kept": kept, "left": left, "every": every,
              "running": running, "jvm_archive": _use_jvm_archive(config, items, tiers)}
    config.stash[_STACK_REPORT] = report
    if hasattr(config, "workeroutput"):  # an xdist worker: the controller prints the summary
        config.workeroutput["sparkdl_stack_report"] = json.dumps(report)


_STACK_REPORT = pytest.StashKey[dict[str, Any]]()


def _use_jvm_archive(config: pytest.Config, items: list[pytest.Item], tiers: dict[str, str]) -> str:
    """Before the first JVM: points every JVM the tests start at the class archive of this stack's
    Spark (made now if missing). What happened, for the summary."""
    if not JVM_ARCHIVE:
        return "not used (SPARKDL_TEST_JVM_ARCHIVE=0)"
    if config.option.collectonly or all(tiers.get(item.nodeid) == "unit" for item in items):
        return "not needed (no test here starts a JVM)"
    from resources import jvm_archive

    path, what = jvm_archive.ensure(JVM_OPTS)
    if path is None:
        return f"not used: {what}"
    os.environ["JAVA_TOOL_OPTIONS"] = f"{os.environ.get('JAVA_TOOL_OPTIONS', '')} -XX:SharedArchiveFile={path} {jvm_archive.QUIET}".strip()
    return f"{path} ({what})"


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    output = getattr(node, "workeroutput", {})
    if "sparkdl_stack_report" in output:
        node.config.stash[_STACK_REPORT] = json.loads(output["sparkdl_stack_report"])
    for key in output.get("sparkdl_restarts", []):
        node.config.stash.setdefault(_RESTARTS, []).append(key)


_RESTARTS = pytest.StashKey[list[str]]()


def pytest_sessionfinish(session: pytest.Session) -> None:
    seen: set[Any] = set()
    restarts = []
    for key in _started:
        if key in seen:
            restarts.append(f"{key[0]} {dict(key[1])}")
        seen.add(key)
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["sparkdl_restarts"] = restarts
    else:
        session.config.stash[_RESTARTS] = restarts


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    report = config.stash.get(_STACK_REPORT, None)
    if report is None:
        return
    write = terminalreporter.write_line
    stack, left, kept = report["stack"], report["left"], report["kept"]
    terminalreporter.section(f"stack {stack}")
    if report["every"]:
        write(f"stack {stack}: {report['selected']} tests selected, every test (--every-stack)")
    elif left:
        others = sorted({home for _, _, home in left.values()})
        write(f"stack {stack}: {report['selected']} tests selected; {sum(n for n, *_ in left.values())} left to the "
              f"{' and '.join(others)} stack, which runs them for both (rule: tests/stack_rule.py):")
        for path, (n, reason, _) in sorted(left.items()):
            write(f"  {path} ({n}): {reason}")
    elif kept and [other for other in report["running"] if other != stack]:
        write(f"stack {stack}: {report['selected']} tests selected; {sum(n for n, _ in kept.values())} of them run "
              "here for both stacks (rule: tests/stack_rule.py)")
    else:
        write(f"stack {stack}: {report['selected']} tests selected, every test (no other stack runs in this "
              "invocation: SPARKDL_TEST_STACKS)")
    if archive := report.get("jvm_archive"):
        write(f"Spark's classes for the tests' JVMs: {archive}")
    restarts = config.stash.get(_RESTARTS, [])
    if restarts:
        write(f"Spark sessions started again with the same settings ({len(restarts)}): {'; '.join(restarts)}")


def child_jvms(parent: psutil.Process) -> list[psutil.Process]:
    """The live JVMs among ``parent``'s descendants; one that ends meanwhile is left out."""
    found = []
    for proc in parent.children(recursive=True):
        with contextlib.suppress(psutil.Error, OSError):
            # The executable, not the name: a test's fake ``java`` script runs a shell.
            if os.path.basename(proc.exe()) == "java":
                found.append(proc)
    return found


class _NoJvmGuard:
    """Watches a unit test, fixtures included, for a JVM it starts or a Spark session it asks for."""

    def __init__(self, item: pytest.Item) -> None:
        self.me = psutil.Process()
        self.before, self.seen, self.done = self._jvms(), set(), threading.Event()
        self.watcher = threading.Thread(target=self._watch, daemon=True, name="unit-jvm-guard")
        self.watcher.start()
        _unit_item["nodeid"] = item.nodeid

    def _jvms(self) -> set[int]:
        return {proc.pid for proc in child_jvms(self.me)}

    def _watch(self) -> None:
        while not self.done.wait(0.25):
            self.seen.update(self._jvms() - self.before)

    def stop(self) -> set[int]:
        _unit_item.clear()
        self.done.set()
        self.watcher.join(5)
        return self.seen | (self._jvms() - self.before)


_GUARD = pytest.StashKey[_NoJvmGuard]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if tier_of(Path(str(item.fspath))) == "unit":
        item.stash[_GUARD] = _NoJvmGuard(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    try:
        return (yield)
    finally:
        guard = item.stash.get(_GUARD, None)
        if guard is not None:
            del item.stash[_GUARD]
            if started := guard.stop():
                raise AssertionError(
                    f"{item.nodeid} started a JVM (pids {sorted(started)}): tests/unit is for tests "
                    "without one; move it to tests/integration, tests/cluster or tests/e2e"
                )


def _rank_processes() -> list[psutil.Process]:
    """Live rank processes that this test process started: fresh interpreters (``-m sparkdl._internal.rank``)
    and ranks forked by a zygote, and an MPI job's (mpirun, its daemons, sparkdl's agents and proxies)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "name", "status"]):
        cmd = proc.info.get("cmdline") or []
        name = proc.info.get("name") or ""
        if proc.info.get("status") == psutil.STATUS_ZOMBIE:
            continue
        if ("sparkdl._internal.rank" in cmd or name.startswith("sparkdl-rank") or "sparkdl._internal.backends.horovod.mpi_proxy" in cmd
                or name in ("orted", "mpirun")) and owned(proc):
            found.append(proc)
    return found


def _is_pyspark_daemon(proc: psutil.Process) -> bool:
    # PySpark's daemon (a child of the JVM) listens for its own workers; Spark owns it, not sparkdl.
    # The workers it forks share its command line but not its parent, and stay under watch.
    parent = proc.parent()
    return (
        "pyspark.daemon" in " ".join(proc.cmdline())
        and parent is not None
        and parent.name().startswith("java")
    )


def _listeners_outside_jvm() -> set[tuple[str, int, int]]:
    """Listening TCP sockets of non-JVM processes in this test process's tree."""
    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    found = set()
    for proc in procs:
        try:
            if proc.name().startswith("java") or _is_pyspark_daemon(proc):
                continue
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found.add((conn.laddr.ip, conn.laddr.port, proc.pid))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def wait_no_leaks(before: set[tuple[str, int, int]], timeout_s: float = 20.0) -> None:
    """Fails unless, within ``timeout_s``, no rank process runs and no new port listens."""
    deadline = time.monotonic() + timeout_s
    while True:
        ranks = _rank_processes()
        new_listeners = {(ip, port, pid) for ip, port, pid in _listeners_outside_jvm() - before}
        if not ranks and not new_listeners:
            return
        if time.monotonic() > deadline:
            details = [" ".join(p.cmdline()) + f" (pid {p.pid})" for p in ranks]
            for _, _, pid in new_listeners:
                try:
                    proc = psutil.Process(pid)
                    parent = proc.parent()
                    details.append(
                        f"listener pid {pid}: {' '.join(proc.cmdline())} "
                        f"(parent {parent.pid if parent else None} {parent.name() if parent else ''})"
                    )
                except psutil.NoSuchProcess:
                    pass
            raise AssertionError(
                f"left running after the run: rank processes {details}, listeners {new_listeners}"
            )
        time.sleep(0.2)


def wait_for_pids(proc: subprocess.Popen[Any], files: list[Path], timeout_s: float = 120) -> list[int]:
    """The pids that ranks wrote to ``files``, once all are there, while ``proc`` (their client) runs."""
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() and p.read_text() for p in files):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout and proc.stdout.read()[-3000:]
        time.sleep(0.2)
    pids = [int(p.read_text()) for p in files]
    assert all(psutil.pid_exists(pid) for pid in pids)
    return pids


def wait_ended(pids: list[int], timeout_s: float, after: str) -> None:
    """Fails unless every process of ``pids`` ends (or is a zombie) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while alive := [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]:
        assert time.monotonic() < deadline, f"ranks {alive} still run {timeout_s:g} s after {after}"
        time.sleep(0.2)


@pytest.fixture
def no_leaks() -> Iterator[None]:
    """Asserts that a test leaves no rank process running and no new port listening."""
    before = _listeners_outside_jvm()
    yield
    wait_no_leaks(before)


@pytest.fixture(scope="session")
def fake_gpus(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], str]:
    """A factory of GPU discovery scripts that give every fake worker GPUs of its own.

    ``fake_gpus(k)`` writes a script whose n-th call (Spark calls it once per worker) reports the
    addresses ``n*k .. n*k+k-1``; calls claim their n with ``mkdir``, which is atomic. Distinct
    addresses per worker are what let a test tell one executor's GPUs from another's.
    """

    def make(per_worker: int) -> str:
        directory = tmp_path_factory.mktemp("fake-gpus")
        (directory / "claims").mkdir()
        script = directory / "discover.sh"
        script.write_text(
            "#!/usr/bin/env bash\n"
            f"# Fake GPUs for tests: call n reports addresses n*{per_worker} .. n*{per_worker}+{per_worker - 1}.\n"
            f"n=0; while ! mkdir '{directory}/claims/'$n 2>/dev/null; do n=$((n+1)); done\n"
            f'first=$((n*{per_worker})); list=""\n'
            f'for ((i=first; i<first+{per_worker}; i++)); do list="$list${{list:+,}}\\"$i\\""; done\n'
            'echo "{\\"name\\": \\"gpu\\", \\"addresses\\": [$list]}"\n'
        )
        script.chmod(0o755)
        return str(script)

    return make


@pytest.fixture(scope="session")
def executor_gpus() -> Callable[[], dict[int, set[str]]]:
    """``executor_gpus()``: Spark's side of GPU assignment, each live executor JVM's pid -> the GPU
    addresses its worker allocated to it, read from the resources file on its command line
    (standalone and local-cluster pass ``--resourcesFile``), independently of sparkdl."""
    return _executor_gpus


def _executor_gpus() -> dict[int, set[str]]:
    import json

    found: dict[int, set[str]] = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        if (
            "org.apache.spark.executor.CoarseGrainedExecutorBackend" in cmd
            and "--resourcesFile" in cmd
            and owned(proc)
        ):
            path = cmd[cmd.index("--resourcesFile") + 1]
            with open(path) as f:
                allocations = json.load(f)
            found[proc.info["pid"]] = {
                a for r in allocations if r["id"]["resourceName"] == "gpu" for a in r["addresses"]
            }
    return found


class OtherUser:
    """A throwaway Unix account on this host: another tenant, for the tests of issue 17."""

    def __init__(self, name: str) -> None:
        import pwd

        entry = pwd.getpwnam(name)
        self.name, self.uid, self.gid = name, entry.pw_uid, entry.pw_gid
        # The system's interpreter: the project's may sit where another user cannot reach it
        # (under /root). Attack scripts use the standard library only.
        self.python = "/usr/bin/python3"
        self._dirs: list[str] = []

    def shared_dir(self) -> Path:
        """A fresh directory this user can read and write (pytest's own are private to root)."""
        import tempfile

        path = tempfile.mkdtemp(prefix="sparkdl-tenant-")
        os.chmod(path, 0o777)
        self._dirs.append(path)
        return Path(path)

    def popen(self, args: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """Starts ``args`` as this user (no supplementary groups, its own session)."""
        kwargs.setdefault("start_new_session", True)
        kwargs.setdefault("env", {"PATH": "/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8"})
        return subprocess.Popen(args, user=self.uid, group=self.gid, extra_groups=[], **kwargs)  # type: ignore[call-overload, no-any-return]

    def run(self, args: list[str], timeout: float = 60, **kwargs: object) -> subprocess.CompletedProcess[bytes]:
        """Runs ``args`` as this user to the end (bounded by ``timeout``), output captured."""
        proc = self.popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return subprocess.CompletedProcess(args, proc.returncode, out, err)

    def processes(self) -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == self.uid]

    def end_all(self) -> None:
        import shutil

        for proc in self.processes():
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(self.processes(), timeout=10)
        for path in self._dirs:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def other_user() -> Iterator[OtherUser]:
    """A second local user, created for this test session and removed after it, with every
    process it still runs. Creating one needs root: elsewhere the test is skipped, and the skip
    (shown in the summary, ``-rs``) says why."""
    import shutil

    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("a second Unix user is needed and this test session cannot create one (not root, or no useradd)")
    if not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("a second Unix user is needed to run /usr/bin/python3, and this host has none")
    name = f"sdlt{secrets.token_hex(3)}"
    _accounts("useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin", name)
    user = OtherUser(name)
    try:
        yield user
    finally:
        user.end_all()
        _accounts("userdel", name)


def _accounts(*argv: str) -> None:
    """useradd/userdel, tried again while another test worker holds the lock on /etc/passwd
    (exit 10: "cannot lock /etc/passwd"), for at most 30 s."""
    deadline = time.monotonic() + 30
    while True:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
        if done.returncode == 0:
            return
        if done.returncode != 10 or time.monotonic() > deadline:
            raise AssertionError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        time.sleep(0.2)


def path_without(tmp_path: Path, *names: str) -> str:
    """$PATH with each directory that holds one of ``names`` replaced by links to all else it holds."""
    dirs = []
    for i, entry in enumerate(os.environ["PATH"].split(os.pathsep)):
        d = Path(entry)
        if not any((d / n).exists() for n in names):
            dirs.append(entry)
            continue
        copy = tmp_path / f"path{i}"
        copy.mkdir()
        for f in d.iterdir():
            if f.name not in names:
                (copy / f.name).symlink_to(f)
        dirs.append(str(copy))
    return os.pathsep.join(dirs)


# Only the Connect server's processes have this variable: a rank that has it ran under the server.
CONNECT_SERVER_MARK, CONNECT_SERVER_TOKEN = "SPARKDL_TEST_CONNECT_SERVER", secrets.token_hex(8)


class _ConnectServers:
    """The one Spark Connect server (``local[2]``) of this worker, started again if a test killed it."""

    def __init__(self, cache: Path) -> None:
        self.cache, self.server = cache, None

    def get(self) -> Any:
        from connect_server import ConnectServer

        if self.server is not None and self.server.proc is not None and self.server.proc.poll() is None:
            return self.server
        self.close()
        confs = {"spark.sql.shuffle.partitions": "2", "spark.sparkdl.cacheDir": str(self.cache)}
        server = ConnectServer("local[2]", confs=confs, start_timeout_s=180)
        os.environ[CONNECT_SERVER_MARK] = CONNECT_SERVER_TOKEN
        try:
            server.start()
        except BaseException:
            server.cleanup()
            raise
        finally:
            del os.environ[CONNECT_SERVER_MARK]
        self.server = server
        return server

    def close(self) -> None:
        if self.server is not None:
            self.server.cleanup()
            self.server = None


@pytest.fixture(scope="session")
def _connect_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_ConnectServers]:
    from connect_server import connect_available

    if reason := connect_available():
        pytest.skip(reason)
    servers = _ConnectServers(tmp_path_factory.mktemp("connect-cache"))
    try:
        yield servers
    finally:
        servers.close()


@pytest.fixture
def connect_server(request: pytest.FixtureRequest, _connect_servers: _ConnectServers) -> Iterator[Any]:
    """A Spark Connect server on 127.0.0.1 (``local[2]``), shared by the Connect tests of this
    worker (tests/e2e's Connect modules are one xdist group). A test marked
    ``spoils_connect_server(reason)`` leaves it unfit for the next (its slots busy, say): the
    server is stopped after it, and the next test that asks for one gets a new one."""
    yield _connect_servers.get()
    if request.node.get_closest_marker("spoils_connect_server"):
        _connect_servers.close()


class _NetnsClusters:
    """The one namespaced cluster of this worker (a master and two workers, tools/netns_cluster.py),
    healed between tests: a worker a test killed is started again, a stopped cluster anew."""

    def __init__(self) -> None:
        self.cluster: Any = None

    def get(self) -> Any:
        import netns_cluster

        if self.cluster is not None and self.cluster.running:
            for host in self.cluster.hosts:
                self.cluster.link_up(host)  # a test that cut a link and failed before healing it
                self.cluster.restart_host(host)
            return self.cluster
        # Each worker offers two fake GPUs, as a GPU worker offers its own with conf/gpu-discovery.sh;
        # applications that ask for none are not affected.
        fake_gpus = TESTS / "resources" / "fake-gpus.sh"
        opts = ["-Dspark.worker.resource.gpu.amount=2", f"-Dspark.worker.resource.gpu.discoveryScript={fake_gpus}"]
        self.cluster = netns_cluster.NetnsCluster(2, cores=1, memory="1g", python=sys.executable,
                                                  start_timeout_s=90, keep=[REPO], worker_opts=opts).start()
        return self.cluster

    def close(self) -> None:
        if self.cluster is not None:
            left = self.cluster.stop()
            assert left == [], f"left running by the namespaced cluster: {left}"


@pytest.fixture(scope="session")
def netns_clusters() -> Iterator[_NetnsClusters]:
    """The namespaced cluster of this worker (root only; skipped elsewhere, saying why), shared by
    every namespaced-host module (one xdist group): ``netns_clusters.get()`` at a module's start
    gives it both workers alive, whatever the module before did to them."""
    import netns_cluster

    if reason := netns_cluster.NetnsCluster.available():
        pytest.skip(f"no namespaced hosts: {reason}")
    clusters = _NetnsClusters()
    try:
        yield clusters
    finally:
        clusters.close()
