"""Horovod's MPI controller: ``RunConfig(horovod_controller="mpi")`` makes each gang one Open MPI
job whose every process a Spark task started, with the guarantees of the Gloo controller.

The training runs on ``local[2]`` and on ``local-cluster[2,1,1024]`` (the ranks in two executors);
the rerun and the timeout on ``local-cluster``, the report of a SIGKILLed rank on ``local[2]``.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cloudpickle
import psutil
import pytest

import sparkdl

hvd = pytest.importorskip("horovod.torch")
if not hvd.mpi_built():
    pytest.skip("Horovod was built without MPI (tools/build-horovod.sh builds it with Open MPI)", allow_module_level=True)
try:
    from sparkdl._internal.backends.horovod.horovod_mpi import open_mpi_version

    open_mpi_version()
except sparkdl.BackendUnavailableError as exc:
    pytest.skip(f"no Open MPI 4 here: {exc}", allow_module_level=True)

# The Gloo tests' training function (pickled by value, as its module asks), for the same model and data.
from conftest import LOCAL_CLUSTER, LOCAL_CLUSTER_CONF, needs_session, path_without  # noqa: E402
from resources.horovod_train import CFG, train_horovod  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.spark

MPI = CFG.replace(horovod_controller="mpi")
EPOCHS, BATCH, SAVE_EVERY = 2, 16, 3
SECRET = bytes(range(100, 132))


CLUSTER = pytest.param(LOCAL_CLUSTER, marks=pytest.mark.cluster)
# The faults run where the ranks are in executors of their own, as on a cluster; on local[2] a
# SIGKILLed rank is the report test's, which reruns nothing.
ON_A_CLUSTER = pytest.mark.parametrize("session", [CLUSTER], indirect=True)


@pytest.fixture(params=["local[2]", CLUSTER])
@needs_session(lambda master: master)  # the shared local[2] and local-cluster sessions
def session(request, spark_session):  # type: ignore[no-untyped-def]
    return spark_session(request.param, LOCAL_CLUSTER_CONF if request.param == LOCAL_CLUSTER else None)


@pytest.fixture(autouse=True)
def no_session_files_left() -> Any:
    """Open MPI's session files (PMIx's shared segments) stay in the tasks' workdirs, which go with
    the tasks: nothing new under the machine's temp dir, however the job ended."""
    def sessions() -> set[str]:
        root = Path(tempfile.gettempdir())
        return {str(p) for top in root.glob("ompi.*") for p in top.iterdir()}

    before = sessions()
    yield
    assert sessions() <= before, sorted(sessions() - before)


def _mpi_processes() -> list[dict[str, Any]]:
    """mpirun, its daemons and sparkdl's proxies of this test process (they inherit its
    SPARKDL_TEST_TAG, as this rank did; another test worker's are not counted), each with its
    parent's command."""
    found = []
    tag = os.environ["SPARKDL_TEST_TAG"]
    for proc in psutil.process_iter(["pid", "name", "cmdline", "ppid", "environ"]):
        cmd = proc.info["cmdline"] or []
        if (proc.info["environ"] or {}).get("SPARKDL_TEST_TAG") != tag:
            continue
        if proc.info["name"] in ("orted", "mpirun") or "sparkdl._internal.backends.horovod.mpi_proxy" in cmd:
            try:
                parent = psutil.Process(proc.info["ppid"])
                parent_cmd, parent_name = parent.cmdline(), parent.name()
            except psutil.NoSuchProcess:
                parent_cmd, parent_name = [], ""
            found.append({"name": proc.info["name"], "cmd": cmd, "parent": parent_name, "parent_cmd": parent_cmd})
    return found


def train_mpi() -> dict[str, Any]:
    import horovod.torch as hvd
    import torch

    out = train_horovod()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
    out.update(mpi=hvd.mpi_enabled(), local=(hvd.local_rank(), hvd.local_size()), total=total.item(),
               processes=_mpi_processes() if hvd.rank() == 0 else [], rank_pid=os.getpid())
    return out


def test_mpi_training_converges_like_gloo_with_every_process_started_by_a_task(session, no_leaks, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import torch

    import sparkdl._internal.driver.spark as driver

    # Only the launcher's channel secret is fixed (to look for it on command lines): patching the
    # secrets module itself would fix the run id too, and another test process (the other stack,
    # running side by side) would share this run's directory under /tmp and remove its markers.
    monkeypatch.setattr(driver, "secrets", SimpleNamespace(token_bytes=lambda n: SECRET[:n]))
    mpi = sparkdl.run(train_mpi, num_workers=2, backend="horovod", config=MPI)
    monkeypatch.undo()
    gloo = sparkdl.run(train_horovod, num_workers=2, backend="horovod", config=CFG)
    assert mpi["mpi"] and mpi["env"]["HOROVOD_CONTROLLER"] == "mpi" and mpi["size"] == 2
    assert mpi["total"] == 3.0 and mpi["replicas_equal"] and mpi["loss"] < 0.01
    # Every rank is an MPI node of its own: local rank 0, as each task sees only its own GPUs.
    assert mpi["local"] == (0, 1)
    # The same averaged gradients as Gloo's, from the same initial weights: the same model.
    assert torch.allclose(mpi["weights"], gloo["weights"], atol=1e-5), (mpi["weights"], gloo["weights"])
    procs = mpi["processes"]
    daemons = [p for p in procs if p["name"] == "orted"]
    proxies = [p for p in procs if p["name"] != "mpirun" and p["cmd"][-2:] == ["sparkdl._internal.backends.horovod.mpi_proxy", "rank"]]
    runs = [p for p in procs if p["name"] == "mpirun"]
    assert len(runs) == 1 and len(daemons) == 2 and len(proxies) == 2, procs
    # No ssh anywhere: each daemon's parent is a Spark task's Python worker, each proxy's a daemon.
    assert all("ssh" not in " ".join(p["parent_cmd"]) for p in procs), procs
    assert all(p["parent"].startswith("python") for p in daemons + runs), daemons + runs
    assert all(p["parent"] == "orted" for p in proxies), proxies
    assert not any(SECRET.hex() in " ".join(p["cmd"]) for p in procs), "the run's secret is on a command line"


def _dataset(session: Any, path: str) -> sparkdl.Dataset:
    import random

    rng = random.Random(7)
    rows = [(i, x, sum(x[:4]) - 0.5 * x[5] + rng.gauss(0, 0.05))
            for i, x in ((i, [rng.uniform(-1, 1) for _ in range(8)]) for i in range(192))]
    df = session.createDataFrame(rows, "id long, x array<float>, y double")
    return sparkdl.write_dataset(df, path, num_files=2)


def train_resumable(ds: sparkdl.Dataset, fault: dict[str, Any]) -> dict[str, Any]:
    import horovod.torch as hvd
    import torch

    hvd.init()
    ctx = sparkdl.context()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = hvd.DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=0.01), named_parameters=net.named_parameters())
    state = sparkdl.TrainState(net, opt, ds.loader(BATCH, seed=3, drop_last=True))
    for batch in state.batches(epochs=EPOCHS, save_every=SAVE_EVERY):
        if ctx.attempt == 0 and ctx.rank == fault.get("rank") and state.global_step == fault.get("step"):
            if fault["how"] == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)  # "hang": the other rank waits in the next allreduce
        loss = torch.nn.functional.mse_loss(net(batch["x"]).squeeze(1), batch["y"].float())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"weights": {k: v.clone() for k, v in net.state_dict().items()}, "attempt": ctx.attempt,
            "restored_from": state.restored_from, "steps": state.global_step}


@pytest.mark.one_stack("classic", "both stacks build the same Horovod and Open MPI; the barrier rerun it rides on "
                        "is walked on both stacks by tests/integration/test_faults.py")
@ON_A_CLUSTER
def test_a_sigkilled_mpi_rank_reruns_the_gang_and_resumes_bitwise_equal(session, tmp_path, no_leaks) -> None:  # type: ignore[no-untyped-def]
    import torch

    ds = _dataset(session, str(tmp_path / "data"))
    ref = sparkdl.run(train_resumable, ds, {}, num_workers=2, backend="horovod", config=MPI,
                      checkpoint_dir=str(tmp_path / "ref"))
    assert ref["attempt"] == 0 and ref["restored_from"] is None
    fault = {"how": "sigkill", "rank": 1, "step": 7}
    result = sparkdl.launch(train_resumable, ds, fault, num_workers=2, backend="horovod", max_attempts=2,
                            config=MPI, checkpoint_dir=str(tmp_path / "ckpt"))
    out = result.value
    assert result.attempts == 2 and out["attempt"] == 1
    assert out["restored_from"] is not None and out["steps"] == ref["steps"]
    for key, value in ref["weights"].items():
        assert torch.equal(out["weights"][key], value), f"{key} differs from the uninterrupted run"


def test_the_report_names_the_killed_rank_not_the_peer_open_mpi_ended_after_it(spark, tmp_path, no_leaks) -> None:  # type: ignore[no-untyped-def]
    ds = _dataset(spark, str(tmp_path / "data"))
    with pytest.raises(sparkdl.RunFailedError) as failed:
        sparkdl.run(train_resumable, ds, {"how": "sigkill", "rank": 1, "step": 4}, num_workers=2,
                    backend="horovod", max_attempts=1, config=MPI, checkpoint_dir=str(tmp_path / "ckpt"))
    assert "rank 1" in failed.value.root_cause and "SIGKILL" in failed.value.root_cause, failed.value.root_cause
    # Its peer, waiting in the MPI allreduce, was stopped by the policy with its stack taken first.
    report = str(failed.value)
    assert "rank 0 on 127.0.0.1" in report and "stopped while running" in report, report
    assert "in synchronize" in report, report


@ON_A_CLUSTER
def test_a_hanging_mpi_rank_is_stopped_by_timeout_s(session, tmp_path, no_leaks) -> None:  # type: ignore[no-untyped-def]
    ds = _dataset(session, str(tmp_path / "data"))
    start = time.monotonic()
    with pytest.raises(sparkdl.RunTimeoutError, match="timeout_s"):
        sparkdl.run(train_resumable, ds, {"how": "hang", "rank": 1, "step": 4}, num_workers=2, backend="horovod",
                    config=MPI.replace(timeout_s=10.0), checkpoint_dir=str(tmp_path / "ckpt"))
    assert time.monotonic() - start < 90


def test_the_mpi_controller_is_refused_with_another_backend_or_an_unknown_name() -> None:
    with pytest.raises(sparkdl.ConfigError, match="horovod_controller"):
        sparkdl.RunConfig(horovod_controller="nccl")
    with pytest.raises(sparkdl.ConfigError, match="backend='horovod' only"):
        sparkdl.run(len, num_workers=2, backend="torch", config=MPI)


def hvd_documented(lr: float, kill_rank: int | None = None) -> dict[str, Any]:
    # As Databricks' HorovodRunner documentation writes it; kill_rank dies in its first allreduce.
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.manual_seed(1234)
    model = torch.nn.Linear(3, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr * hvd.size()),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if hvd.rank() == kill_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    x = torch.ones(4, 3) * (hvd.rank() + 1)
    for _ in range(5):
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    return {"mpi": hvd.mpi_enabled(), "size": hvd.size(), "weight": model.weight.detach().flatten().tolist()}


def test_horovod_runner_takes_the_mpi_controller_on_the_cluster_and_on_the_driver(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    cluster = sparkdl.HorovodRunner(np=2, config=MPI).run(hvd_documented, lr=0.05)
    local = sparkdl.HorovodRunner(np=-2, config=MPI).run(hvd_documented, lr=0.05)
    gloo = sparkdl.HorovodRunner(np=-2).run(hvd_documented, lr=0.05)
    assert cluster["mpi"] and local["mpi"] and not gloo["mpi"]
    assert cluster["size"] == local["size"] == 2
    assert local["weight"] == pytest.approx(cluster["weight"], abs=1e-6) == gloo["weight"]


def test_a_killed_rank_on_the_driver_ends_the_mpi_job_with_the_report(no_leaks) -> None:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    with pytest.raises(sparkdl.RunFailedError) as failed:
        sparkdl.HorovodRunner(np=-2, config=MPI).run(hvd_documented, lr=0.05, kill_rank=1)
    assert "rank 1" in failed.value.root_cause and "SIGKILL" in failed.value.root_cause, str(failed.value)
    assert time.monotonic() - start < 60


@pytest.fixture
@needs_session("local-cluster[2,1,1024] without Open MPI on the executors' PATH")
def executors_without_mpi(spark_session, tmp_path):  # type: ignore[no-untyped-def]
    """local-cluster whose executors' PATH lacks Open MPI (the driver has it)."""
    return spark_session("local-cluster[2,1,1024]", {"spark.executor.memory": "512m",
                                                     "spark.executorEnv.PATH": path_without(tmp_path, "mpirun", "orted")})


@pytest.mark.cluster
def test_executors_without_open_mpi_fail_the_run_saying_what_to_install(executors_without_mpi, no_leaks) -> None:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    with pytest.raises(sparkdl.RunFailedError) as failed:
        sparkdl.run(hvd_documented, 0.05, num_workers=2, backend="horovod", max_attempts=1, config=MPI)
    assert "rank 0" in failed.value.root_cause and "mpirun" in failed.value.root_cause, str(failed.value)
    assert "install Open MPI 4" in str(failed.value)
    assert time.monotonic() - start < 90
