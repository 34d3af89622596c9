"""Entry point of one rank's process: ``python -m sparkdl._rank WORKDIR``.

The Spark task that starts this process holds the write end of a "lifeline" pipe. When the task
ends for any reason, even SIGKILL, the pipe reaches end-of-file and this process kills its whole
process group, so a rank never outlives the task that owns it.

Files in WORKDIR: ``payload.pkl`` (cloudpickled fn, args, kwargs) written by the task;
``result.pkl`` (rank 0's return value) and ``error.json`` (a failure) written here.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import traceback
from pathlib import Path


def _watch_lifeline(fd: int) -> None:
    def watch() -> None:
        try:
            while os.read(fd, 4096):
                pass
        except OSError:
            pass
        # The owning Spark task is gone: end this rank and everything it started.
        try:
            os.killpg(os.getpgid(0), signal.SIGKILL)
        finally:
            os._exit(137)

    threading.Thread(target=watch, name="sparkdl-lifeline", daemon=True).start()


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _format(exc: BaseException, *, skip_own_frame: bool) -> str:
    tb = exc.__traceback__
    if skip_own_frame and tb is not None and tb.tb_next is not None:
        tb = tb.tb_next  # the user's frames start below main()
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _record_error(workdir: Path, exc: BaseException, where: str) -> None:
    summary = traceback.format_exception_only(type(exc), exc)[-1].strip()
    info = {
        "error": f"{where}: {summary}" if where else summary,
        "traceback": _format(exc, skip_own_frame=not where),
    }
    _write_atomically(workdir / "error.json", json.dumps(info).encode())


def main() -> int:
    workdir = Path(sys.argv[1])
    _watch_lifeline(int(os.environ["SPARKDL_LIFELINE_FD"]))
    rank = int(os.environ["SPARKDL_RANK"])
    stage = "starting"
    try:
        # Import while the gang forms, then wait for the task to say where the gang is.
        import cloudpickle

        if os.environ.get("SPARKDL_BACKEND") in ("torch", "horovod"):
            import torch.distributed  # noqa: F401
        with os.fdopen(int(os.environ["SPARKDL_CONTROL_FD"])) as control:
            gang = control.read()
        if not gang:
            return 3  # the task gave up before the gang formed
        os.environ.update(json.loads(gang))
        stage = "setting up the backend"
        from sparkdl.backends import get_backend

        backend = get_backend(os.environ["SPARKDL_BACKEND"])
        backend.setup_rank()
        stage = "loading the function"
        with open(workdir / "payload.pkl", "rb") as f:
            fn, args, kwargs = cloudpickle.load(f)
        stage = ""
        result = fn(*args, **kwargs)
        if rank == 0:
            stage = "pickling the return value of rank 0"
            _write_atomically(workdir / "result.pkl", cloudpickle.dumps(result, protocol=5))
        stage = "tearing down the backend"
        backend.teardown_rank()
        return 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code != 0:
            _record_error(workdir, exc, stage)
        elif rank == 0 and not (workdir / "result.pkl").exists():
            import cloudpickle

            _write_atomically(workdir / "result.pkl", cloudpickle.dumps(None))
        return code
    except BaseException as exc:
        sys.stderr.write(_format(exc, skip_own_frame=not stage))
        _record_error(workdir, exc, stage)
        return 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: a user's leftover non-daemon thread or a library destructor must not hang the exit.
    os._exit(code)
