"""``RunConfig(min_workers=M)``: a gang whose executor is gone for good goes on with fewer ranks,
and grows back at its next checkpoint once an executor returns.

The tests share a ``local-cluster[2,1,1024]`` of their own: each test asks Spark to kill the
executor of rank 1 with ``SparkContext.killExecutor``, which also lowers the number of executors
the application wants, so the cluster manager does not replace it (killing the JVM alone makes
the local cluster's Master start a new one). Before the next test, the application asks for two
executors again and waits until both are registered: a new executor instead of a new
application. Attempt 0 saves a checkpoint first; the next attempt must resume from it. The
policy part, as a pure function, is in
tests/unit/driver/test_shrink_policy.py.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
from conftest import needs_session

import sparkdl
from sparkdl._internal.common.config import RunConfig

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MASTER = "local-cluster[2,1,1024]"


# ---- real Spark: an executor lost for good ------------------------------------------------


def steps(marker: str) -> dict[str, Any]:
    """Attempt 0 checkpoints step 5 and waits to be killed; a later attempt resumes from it."""
    import torch.distributed as dist

    ctx = sparkdl.context()
    state = ctx.load_checkpoint() or {"step": 0}
    if ctx.attempt == 0:
        ctx.save_checkpoint({"step": 5})
        dist.barrier()  # the checkpoint is complete before the executor goes
        lose_rank_1s_executor(marker)
    return {
        "attempt": ctx.attempt,
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "env": (os.environ["RANK"], os.environ["WORLD_SIZE"]),
        "resumed_from": state["step"],
        "run_id": ctx.run_id,
    }


def _rank() -> int:
    return sparkdl.context().rank


def lose_rank_1s_executor(marker: str) -> None:
    """Rank 1 names its executor in ``marker`` for the test to kill; every rank waits for its end."""
    if sparkdl.context().rank == 1:
        import psutil

        task = psutil.Process(int(os.environ["SPARKDL_TASK_PID"]))
        executor = next(p for p in task.parents() if p.name().startswith("java")).cmdline()
        Path(marker + ".tmp").write_text(executor[executor.index("--executor-id") + 1])
        os.rename(marker + ".tmp", marker)
    time.sleep(600)


class ExecutorKiller:
    """Kills, through the driver, the executor whose id rank 1 writes to ``marker``; the kill
    lowers the application's executor target, so no new executor replaces it."""

    def __init__(self, sc: Any, marker: Path) -> None:
        self.sc, self.marker = sc, marker
        self.killed_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="executor-killer", daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            if self.marker.exists():
                executor_id = self.marker.read_text()
                assert self.sc._jsc.sc().killExecutor(executor_id)
                self.killed_at = time.monotonic()
                return

    def __enter__(self) -> ExecutorKiller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive()


def want_two_executors(sc: Any) -> None:
    """Asks the cluster manager for two executors again: after a kill lowered the number the
    application wants, ``requestExecutors(1)`` does not bring one back."""
    assert sc._jsc.sc().requestTotalExecutors(2, 0, sc._jvm.PythonUtils.toScalaMap({}))


@pytest.fixture(scope="module")
@needs_session("local-cluster[2,1,1024] of the shrink tests")
def shrink_cluster(spark_session):  # type: ignore[no-untyped-def]
    """The application these tests share, apart from the suite's other local-cluster (each test
    here loses one of its executors)."""
    return spark_session(MASTER, {"spark.executor.memory": "512m", "spark.sparkdl.test.shrink": "lost executors"})


@pytest.fixture
def fresh_cluster(shrink_cluster) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    """The shrink tests' application with both executors registered: an executor that the test
    before killed for good is replaced (its kill lowered the number the application wants)."""
    from sparkdl._internal.spark.spark_api import ClassicApi

    sc = shrink_cluster.sparkContext
    if ClassicApi(shrink_cluster).task_slots() != 2:
        want_two_executors(sc)
    deadline = time.monotonic() + 120
    while ClassicApi(shrink_cluster).task_slots() != 2:
        assert time.monotonic() < deadline, "the local cluster's two executors did not register in 120 s"
        time.sleep(0.2)
    yield shrink_cluster


CFG = RunConfig(slot_wait_s=5, start_timeout_s=60, connect_timeout_s=30, kill_grace_s=30, progress=False)


@pytest.mark.spark
@pytest.mark.cluster
@pytest.mark.fault
def test_an_executor_lost_for_good_shrinks_the_gang_and_the_run_resumes(
    fresh_cluster, no_leaks, tmp_path, caplog  # type: ignore[no-untyped-def]
) -> None:
    marker = tmp_path / "executor-of-rank-1"
    caplog.set_level(logging.WARNING, logger="sparkdl._internal.driver.spark")
    with ExecutorKiller(fresh_cluster.sparkContext, marker) as killer:
        result = sparkdl.launch(steps, str(marker), num_workers=2, max_attempts=3,
                                config=CFG.replace(min_workers=1), checkpoint_dir=str(tmp_path / "ckpt"))
    assert killer.killed_at is not None
    print(f"shrunk run finished {time.monotonic() - killer.killed_at:.1f} s after the executor was killed")
    assert result.world_sizes == [2, 1] and result.attempts == 2
    # Rank 0 of attempt 1 ran alone, was told so, and resumed from attempt 0's checkpoint.
    assert result.value == {"attempt": 1, "rank": 0, "world_size": 1, "env": ("0", "1"),
                            "resumed_from": 5, "run_id": result.run_id}
    assert "sparkdl: attempt 1 runs on 1 ranks instead of num_workers=2, RunConfig.min_workers=1" in caplog.text


@pytest.mark.one_stack("modern", "the lost executor's path through Spark is walked on both stacks by the shrink "
                        "tests beside it; the failure it ends in is sparkdl's policy, the same on both")
@pytest.mark.spark
@pytest.mark.cluster
@pytest.mark.fault
def test_without_min_workers_a_lost_executor_fails_the_run_naming_the_missing_slots(
    fresh_cluster, no_leaks, tmp_path  # type: ignore[no-untyped-def]
) -> None:
    marker = tmp_path / "executor-of-rank-1"
    cfg = CFG.replace(start_timeout_s=20)
    # The executors are new: their first ranks' start (Python workers, zygotes importing torch)
    # took over 20 s once on a loaded 2-core machine. A first run warms them, so that the 20 s
    # bound only the wait for the lost executor's slot.
    assert sparkdl.launch(_rank, num_workers=2, config=CFG).value == 0
    with ExecutorKiller(fresh_cluster.sparkContext, marker) as killer, pytest.raises(sparkdl.RunTimeoutError) as info:
        sparkdl.launch(steps, str(marker), num_workers=2, max_attempts=3, config=cfg,
                       checkpoint_dir=str(tmp_path / "ckpt"))
    assert killer.killed_at is not None
    waited = time.monotonic() - killer.killed_at
    message = str(info.value)
    assert "the gang needs 2 task slots and only 1 are free" in message, message
    assert "start_timeout_s=20" in message and "RunConfig.min_workers" in message
    assert info.value.attempts == 1
    assert waited < 20 + 30, waited  # start_timeout_s, plus kill_grace_s at most


@pytest.mark.spark
@pytest.mark.cluster
@pytest.mark.fault
def test_with_too_few_slots_for_min_workers_the_run_fails_naming_both_settings(
    fresh_cluster, no_leaks, tmp_path  # type: ignore[no-untyped-def]
) -> None:
    marker = tmp_path / "executor-of-rank-1"
    with ExecutorKiller(fresh_cluster.sparkContext, marker) as killer, \
            pytest.raises(sparkdl.InsufficientSlotsError) as info:
        sparkdl.launch(steps, str(marker), num_workers=2, max_attempts=3, config=CFG.replace(min_workers=2),
                       checkpoint_dir=str(tmp_path / "ckpt"))
    assert killer.killed_at is not None
    message = str(info.value)
    assert "the gang could not be rescheduled: it needs 2 task slots and only 1 are free" in message, message
    assert "slot_wait_s=5" in message and "RunConfig.min_workers=2" in message
    assert (info.value.required, info.value.available) == (2, 1)
    assert time.monotonic() - killer.killed_at < 5 + 30 + 10


def train_and_shrink(ds: sparkdl.Dataset, marker: str, log: str) -> dict[str, Any]:
    """DDP with ``TrainState``: attempt 0 checkpoints step 3 and loses rank 1's executor; the rest
    of the epoch goes on with the ranks that are left, from the rows the old ranks had left."""
    import json

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = sparkdl.context()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = sparkdl.TrainState(model, opt, ds.loader(8, seed=1))
    for batch in state.batches(epochs=2, save_every=3):
        if ctx.attempt == 0 and state.global_step == 3:  # checkpoint 1 is saved: lose an executor
            dist.barrier()
            lose_rank_1s_executor(marker)
        with open(f"{log}/ids-w{ctx.world_size}-r{ctx.rank}", "a") as f:
            f.write(json.dumps([state.loader.epoch, batch["id"].tolist()]) + "\n")
        loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(1), batch["y"].float())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"world_size": ctx.world_size, "restored_from": state.restored_from, "steps": state.global_step}


@pytest.mark.spark
@pytest.mark.cluster
@pytest.mark.fault
def test_a_shrunk_run_feeds_the_rest_of_the_epoch_once_on_the_ranks_left(
    fresh_cluster, no_leaks, tmp_path  # type: ignore[no-untyped-def]
) -> None:
    import json

    rows = [(i, [float(i % 7)] * 8, float(i % 5)) for i in range(96)]
    df = fresh_cluster.createDataFrame(rows, "id long, x array<float>, y double")
    ds = sparkdl.write_dataset(df, str(tmp_path / "data"), num_files=2)
    marker, log = tmp_path / "executor-of-rank-1", tmp_path / "log"
    log.mkdir()
    with ExecutorKiller(fresh_cluster.sparkContext, marker):
        result = sparkdl.launch(train_and_shrink, ds, str(marker), str(log), num_workers=2, max_attempts=3,
                                config=CFG.replace(min_workers=1), checkpoint_dir=str(tmp_path / "ckpt"))
    assert result.world_sizes == [2, 1]
    assert result.value["world_size"] == 1 and result.value["restored_from"] == 1
    fed: dict[int, dict[str, list[int]]] = {}
    for path in log.iterdir():
        for line in path.read_text().splitlines():
            epoch, ids = json.loads(line)
            fed.setdefault(epoch, {}).setdefault(path.name, []).extend(ids)
    # Epoch 0: 3 batches on each of 2 ranks before the loss, the 48 rows they had left on the one rank after.
    assert {k: len(v) for k, v in fed[0].items()} == {"ids-w2-r0": 24, "ids-w2-r1": 24, "ids-w1-r0": 48}
    assert sorted(i for ids in fed[0].values() for i in ids) == list(range(96))
    # Epoch 1 is one rank's from the start.
    assert sorted(fed[1]["ids-w1-r0"]) == list(range(96)) and set(fed[1]) == {"ids-w1-r0"}
    assert result.value["steps"] == 3 + 6 + 12


def train_shrink_grow(ds: sparkdl.Dataset, marker: str, log: str) -> dict[str, Any]:
    """Attempt 0 (2 ranks) checkpoints step 3 and loses rank 1's executor; the shrunk attempt (1
    rank) waits until the test has an executor back, then steps slowly until the driver stops it
    after its next checkpoint; the grown attempt (2 ranks) finishes. Each batch is logged with the
    step it ran at, so that the rows an attempt fed after the checkpoint the next one resumed from
    (fed again there) can be told apart."""
    import json

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = sparkdl.context()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = sparkdl.TrainState(model, opt, ds.loader(8, seed=1))
    started_at: int | None = None
    for batch in state.batches(epochs=2, save_every=3):
        if started_at is None:
            started_at = state.global_step
            if ctx.world_size == 1:  # shrunk: the test brings an executor back, then the gang grows
                Path(f"{log}/shrunk").touch()
                deadline = time.monotonic() + 120
                while not Path(f"{log}/returned").exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
        if ctx.attempt == 0 and state.global_step == 3:
            dist.barrier()
            lose_rank_1s_executor(marker)
        with open(f"{log}/ids-a{ctx.attempt}-r{ctx.rank}", "a") as f:
            f.write(json.dumps([state.loader.epoch, state.global_step, batch["id"].tolist()]) + "\n")
        if ctx.world_size == 1:
            time.sleep(0.5)
        loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(1), batch["y"].float())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"world_size": ctx.world_size, "attempt": ctx.attempt, "restored_from": state.restored_from,
            "started_at": started_at, "steps": state.global_step}


@pytest.mark.one_stack("classic", "the lost executor's path through Spark is walked on both stacks by the shrink "
                        "tests beside it; growing back is sparkdl's policy, the same on both")
@pytest.mark.spark
@pytest.mark.cluster
@pytest.mark.fault
def test_a_shrunk_gang_grows_back_at_its_next_checkpoint_when_an_executor_returns(
    fresh_cluster, no_leaks, tmp_path, caplog  # type: ignore[no-untyped-def]
) -> None:
    import json

    from sparkdl._internal.spark.spark_api import ClassicApi

    sc = fresh_cluster.sparkContext
    rows = [(i, [float(i % 7)] * 8, float(i % 5)) for i in range(96)]
    ds = sparkdl.write_dataset(fresh_cluster.createDataFrame(rows, "id long, x array<float>, y double"),
                               str(tmp_path / "data"), num_files=2)
    marker, log = tmp_path / "executor-of-rank-1", tmp_path / "log"
    log.mkdir()

    def bring_one_back() -> None:  # once the gang runs shrunk: an executor again, as a restarted worker gives
        deadline = time.monotonic() + 180
        while not (log / "shrunk").exists():
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)
        want_two_executors(sc)
        while ClassicApi(fresh_cluster).task_slots() != 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        (log / "returned").touch()

    caplog.set_level(logging.WARNING, logger="sparkdl._internal.driver.spark")
    returner = threading.Thread(target=bring_one_back, daemon=True)
    returner.start()
    with ExecutorKiller(sc, marker):
        result = sparkdl.launch(train_shrink_grow, ds, str(marker), str(log), num_workers=2, max_attempts=2,
                                config=CFG.replace(min_workers=1), checkpoint_dir=str(tmp_path / "ckpt"))
    returner.join(30)
    assert (log / "returned").exists(), "the executor did not come back"
    # Two ranks, one after the executor was lost, two again: the grow-back did not use up max_attempts=2.
    assert result.world_sizes == [2, 1, 2] and result.attempts == 3
    assert result.value["world_size"] == 2 and result.value["attempt"] == 2
    assert "sparkdl: attempt 2 runs on num_workers=2 ranks again" in caplog.text
    # The grown gang resumed from a checkpoint the shrunk one wrote after the executor came back.
    assert result.value["restored_from"] >= 3 and result.value["started_at"] > 3
    fed: dict[int, list[int]] = {}
    ends = {0: 3, 1: result.value["started_at"]}  # the step each next attempt resumed from
    for path in log.glob("ids-a*"):
        attempt = int(path.name.split("-")[1][1:])
        for line in path.read_text().splitlines():
            epoch, step, ids = json.loads(line)
            if attempt not in ends or step < ends[attempt]:  # what a later attempt did not feed again
                fed.setdefault(epoch, []).extend(ids)
    # Every row of both epochs fed once, over three gangs of 2, 1 and 2 ranks.
    assert sorted(fed[0]) == list(range(96)) and sorted(fed[1]) == list(range(96)), {e: len(v) for e, v in fed.items()}
