"""One rank's process: ``python -m sparkdl._internal.rank WORKDIR``, or forked by the executor's zygote.

The Spark task that starts this process holds the write end of a "lifeline" pipe. When the task
ends for any reason, even SIGKILL, the pipe reaches end-of-file and this process kills everything
it started, so a rank never outlives the task that owns it (a watchdog process does it when native
code holding the GIL keeps the rank's own thread from running). The rank is a child subreaper
(:mod:`sparkdl._internal.common.proctree`): what its descendants start and orphan, even in a session of its own,
stays below it, and ends when the rank ends.

Files in WORKDIR: ``payload.pkl`` (cloudpickled fn, args, kwargs) written by the task;
``result.pkl`` (rank 0's return value), ``error.json`` (a failure, with the host's time of it) and
``stacks.txt`` written here. The last exists once :data:`STACK_SIGNAL` makes this process append
every thread's Python stack to it (:mod:`faulthandler`, which needs no GIL: a rank blocked inside
a collective answers too); the task sends that signal when the driver asks before it stops a run.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO

from sparkdl._internal.backends import get_backend
from sparkdl._internal.backends.base import Backend
from sparkdl._internal.common import proctree
from sparkdl._internal.rank import orders
from sparkdl._internal.wire import rankspec, trial, workdir_files

# The function of the lifeline thread: stack reports leave that thread out.
LIFELINE_FRAME = "sparkdl_lifeline"
# A real-time signal, not SIGUSR1: libraries give that one meanings of their own (SLURM requeue).
STACK_SIGNAL = signal.SIGRTMIN + 4 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2
_stacks_file: IO[bytes] | None = None
# How long the watchdog process leaves the rank's own lifeline thread to end the rank.
_WATCHDOG_GRACE_S = 1.0
_MAX_FD = 1 << 16


def _enable_stack_dumps(workdir: Path) -> None:
    """From now on :data:`STACK_SIGNAL` appends this process's stacks to ``stacks.txt``. The file
    gets its name only once the handler is in place, so a task never signals a rank too early
    (the signal's default action would end it)."""
    global _stacks_file
    path = workdir_files.stacks_path(workdir)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        _stacks_file = open(tmp, "ab", buffering=0)  # noqa: SIM115 (open for the life of the rank)
        faulthandler.register(STACK_SIGNAL, file=_stacks_file, all_threads=True, chain=False)
        os.replace(tmp, path)
    except (OSError, RuntimeError, ValueError):
        pass  # no stacks for the report; the rank runs as before


def _start_watchdog(fd: int) -> None:
    """Forks a small process that ends this rank when the lifeline closes, should the rank's own
    lifeline thread not get to run: native code that blocks while holding the GIL (TensorFlow's
    ``MultiWorkerMirroredStrategy()`` waiting for its peers) stops every Python thread of the
    rank. The watchdog gives the thread :data:`_WATCHDOG_GRACE_S`, then SIGKILLs what is below
    the rank and the rank's process group (itself with it). It dies with the rank (SIGKILL on
    its parent's end), holds no descriptor but the lifeline, and runs no Python of the rank's."""
    rank = os.getpid()
    if os.fork() != 0:
        return
    try:  # the watchdog, from here to os._exit
        proctree.die_with_parent()
        os.closerange(0, fd)
        os.closerange(fd + 1, _MAX_FD)
        if os.getppid() != rank:
            os._exit(0)  # the rank is gone already
        with contextlib.suppress(OSError):
            while os.read(fd, 4096):
                pass
        time.sleep(_WATCHDOG_GRACE_S)  # still alive: the rank did not end itself
        me = os.getpid()
        for pid in proctree.descendants(rank):
            if pid != me:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(rank, signal.SIGKILL)
        os.killpg(os.getpgid(0), signal.SIGKILL)
    finally:
        os._exit(0)


def _watch_lifeline(fd: int) -> None:
    def sparkdl_lifeline() -> None:  # the name marks its thread, left out of stack reports
        try:
            while os.read(fd, 4096):
                pass
        except OSError:
            pass
        # The owning Spark task is gone: end this rank and everything it started.
        try:
            proctree.kill_descendants(os.getpid())
            os.killpg(os.getpgid(0), signal.SIGKILL)
        finally:
            os._exit(137)

    threading.Thread(target=sparkdl_lifeline, name="sparkdl-lifeline", daemon=True).start()


def _format(exc: BaseException, *, skip_own_frame: bool) -> str:
    tb = exc.__traceback__
    if skip_own_frame and tb is not None and tb.tb_next is not None:
        tb = tb.tb_next  # the user's frames start below main()
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _record_error(workdir: Path, exc: BaseException, where: str, at: float | None = None) -> None:
    summary = traceback.format_exception_only(type(exc), exc)[-1].strip()
    workdir_files.write_error(workdir, f"{where}: {summary}" if where else summary,
                              _format(exc, skip_own_frame=not where), at or time.time())


def _close_on_exec() -> None:
    """Marks every descriptor above stdio close-on-exec, so that a program the user's function
    starts (``os.system``, ``subprocess`` with ``close_fds=False``) gets none of the rank's: not
    the task's pipes, not the store's or gloo's sockets, which torch's C++ side opens inheritable."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        fd = int(name)
        if fd > 2:
            try:
                if os.get_inheritable(fd):
                    os.set_inheritable(fd, False)
            except OSError:
                pass  # the listing's own descriptor, closed by now


def _use_cuda(spec: rankspec.RankSpec, gang: rankspec.GangSpec, backend: Backend) -> bool:
    """The rank's device, decided and set once: the GPUs Spark assigned, when this torch can use them."""
    if not spec.gpu_ids:
        return False
    if not backend.device_is_torchs:
        return True  # the framework (TensorFlow) places its own work on the GPUs it sees; torch stays off them
    import torch

    if torch.cuda.is_available():
        # Each rank sees exactly its task's GPUs: its device is cuda:LOCAL_RANK (cuda:0 with one
        # rank per task), for every backend.
        torch.cuda.set_device(gang.local_rank)
        return True
    print(
        f"sparkdl: Spark assigned GPU(s) {','.join(spec.gpu_ids)} to this rank, but "
        "torch.cuda.is_available() is False (a CPU build of torch?); running on the CPU",
        file=sys.stderr,
    )
    return False


def main(workdir: Path | None = None) -> int:
    workdir = Path(sys.argv[1]) if workdir is None else workdir
    lifeline = rankspec.read_fd("lifeline")
    control = rankspec.read_fd("control")
    if lifeline is None or control is None:
        sys.stderr.write("sparkdl._internal.rank is started by sparkdl's launchers, not by hand\n")
        return 2
    proctree.set_subreaper()
    _start_watchdog(lifeline)
    _watch_lifeline(lifeline)
    _enable_stack_dumps(workdir)
    try:
        return _run(workdir, control)
    finally:
        proctree.kill_descendants(os.getpid())


def _run(workdir: Path, control: int) -> int:
    spec = rankspec.read_rank()
    stage = "starting"
    try:
        # Import while the gang forms, then wait for the task to say where the gang is.
        import cloudpickle

        backend = get_backend(spec.backend)
        backend.prepare_rank(workdir)
        # The pipe stays open: a trial's decisions come down it later (sparkdl._internal.rank.orders).
        told = orders.open_pipe(control).first_line()
        if not told:
            return 3  # the task gave up before the gang formed
        os.environ.update(json.loads(told))
        gang = rankspec.read_gang()
        stage = "setting up the backend"
        use_cuda = _use_cuda(spec, gang, backend)
        # Written to the environment so that threads and processes of this rank see it too.
        os.environ.update(rankspec.device_env(use_cuda))
        backend.setup_rank(spec, gang, use_cuda)
        stage = "loading the function"
        with open(workdir_files.payload_path(workdir), "rb") as f:
            fn, args, kwargs = cloudpickle.load(f)
        _close_on_exec()
        stage = ""
        result = fn(*args, **kwargs)
        if spec.rank == 0:
            stage = "pickling the return value of rank 0"
            workdir_files.write_result(workdir, cloudpickle.dumps(result, protocol=5))
        stage = "tearing down the backend"
        backend.teardown_rank()
        return 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code != 0:
            _record_error(workdir, exc, stage)
        elif spec.rank == 0 and not workdir_files.result_path(workdir).exists():
            import cloudpickle

            workdir_files.write_result(workdir, cloudpickle.dumps(None))
        return code
    except BaseException as exc:
        if not stage and trial.is_pruned_exception(exc):
            # The trial ends pruned (every rank was told so at the same step): not a failure.
            if spec.rank == 0:
                import cloudpickle

                workdir_files.write_result(workdir, cloudpickle.dumps(trial.Pruned()))
            backend.teardown_rank()
            return 0
        failed_at = time.time()  # before a write to a full stderr pipe can delay it
        sys.stderr.write(_format(exc, skip_own_frame=not stage))
        _record_error(workdir, exc, stage, failed_at)
        return 1


def exit_process(code: int) -> None:
    """Ends the rank process: os._exit, so a user's leftover non-daemon thread or a library
    destructor cannot hang the exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
