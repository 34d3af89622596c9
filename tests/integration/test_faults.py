"""Fault injection with checkpoints: every rerun of the gang resumes where the gang left off.

Each case trains the same small model from a real Parquet dataset with ``sparkdl.TrainState``,
injects a fault on attempt 0, and asserts the outcome, that the final weights are bitwise equal
to those of an uninterrupted run (CPU, deterministic), that nothing is left running or
listening, and that the source data and the committed checkpoints are intact. The same guarantee
at the file level (a writer process killed mid-write) is in tests/unit/ckpt/test_checkpoint_writes.py.
"""

from __future__ import annotations

import collections
import hashlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle
import psutil
import pytest

import sparkdl

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.spark, pytest.mark.fault]

CFG = sparkdl.RunConfig(start_timeout_s=90, slot_wait_s=30, collective_timeout_s=6.0, kill_grace_s=30)
EPOCHS, BATCH, SAVE_EVERY = 3, 16, 3


@pytest.fixture(scope="module")
def dataset(any_spark, tmp_path_factory):  # type: ignore[no-untyped-def]
    import random

    rng = random.Random(5)
    rows = []
    for i in range(300):
        x = [rng.uniform(-1, 1) for _ in range(8)]
        rows.append((i, x, sum(x[:4]) - 0.5 * x[5] + rng.gauss(0, 0.05)))
    df = any_spark.createDataFrame(rows, "id long, x array<float>, y double")
    return sparkdl.write_dataset(df, str(tmp_path_factory.mktemp("faults") / "data"), num_files=3)


def _digest(ds: sparkdl.Dataset) -> str:
    root = Path(ds.url.removeprefix("file://"))
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file():
            h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


class Bomb:
    """Pickles fine, except on the chosen save of attempt 0, where the process dies mid-save."""

    def __init__(self, on_save: int) -> None:
        self.on_save = on_save
        self.saves = 0

    def __reduce__(self) -> tuple[Any, ...]:
        self.saves += 1
        ctx = sparkdl.context()
        if ctx.attempt == 0 and self.saves == self.on_save:
            os._exit(9)
        # Stored as an empty OrderedDict: the checkpoint must not need this test module, and
        # TrainState restores with weights_only=True, which allows OrderedDict but not dict().
        return (collections.OrderedDict, ())


def train(ds: sparkdl.Dataset, fault: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = sparkdl.context()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1)
    )
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    extra = {"bomb": Bomb(fault["save"])} if fault.get("how") == "crash_in_save" else None
    state = sparkdl.TrainState(model, opt, ds.loader(BATCH, seed=3, drop_last=True), extra=extra)
    for batch in state.batches(epochs=EPOCHS, save_every=SAVE_EVERY):
        step = state.global_step
        target = fault.get("step", -1)
        if fault.get("how") == "raise_later":  # each attempt fails a little further on
            target += (SAVE_EVERY + 1) * ctx.attempt
        hit = ctx.rank == fault.get("rank") and step == target
        if hit and (ctx.attempt == 0 or fault.get("every_attempt")):
            how = fault["how"]
            if how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "raise":
                raise RuntimeError(f"injected failure at step {step} on attempt {ctx.attempt}")
            if how == "hang":
                time.sleep(3600)
            if how == "kill_executor":
                task = psutil.Process(int(os.environ["SPARKDL_TASK_PID"]))
                executor = next(p for p in task.parents() if p.name().startswith("java"))
                executor.kill()
                time.sleep(3600)
            if how == "raise_later":
                raise RuntimeError(f"flaky failure at step {step}")
        loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(1), batch["y"].float())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {
        "weights": {k: v.clone() for k, v in model.module.state_dict().items()},
        "attempt": ctx.attempt,
        "restored_from": state.restored_from,
        "steps": state.global_step,
        "steps_per_epoch": len(state.loader),
    }


@pytest.fixture(scope="module")
def reference(any_spark, dataset, tmp_path_factory):  # type: ignore[no-untyped-def]
    out = sparkdl.run(train, dataset, {}, num_workers=2, config=CFG,
                      checkpoint_dir=str(tmp_path_factory.mktemp("ref") / "ckpt"))
    assert out["attempt"] == 0 and out["restored_from"] is None
    assert out["steps"] == EPOCHS * out["steps_per_epoch"]
    return out


def _assert_same_weights(a: dict[str, Any], b: dict[str, Any]) -> None:
    import torch

    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs from the uninterrupted run"


def _assert_checkpoints_loadable(ckpt_dir: Path) -> list[int]:
    store = sparkdl.CheckpointStore(str(ckpt_dir))
    seqs = store.sequence_numbers()
    assert seqs, "no checkpoint was committed"
    for seq in seqs:
        assert store.load(seq)["global_step"] > 0
    return seqs


@pytest.mark.parametrize(
    "fault",
    [
        {"how": "sigkill", "rank": 1, "step": 7},
        {"how": "raise", "rank": 0, "step": 7},
        {"how": "hang", "rank": 1, "step": 7},
    ],
    ids=["sigkill-rank1-step7", "exception-rank0-step7", "hang-in-collective-rank1-step7"],
)
def test_rerun_resumes_bitwise_equal(spark, dataset, reference, tmp_path, no_leaks, fault) -> None:  # type: ignore[no-untyped-def]
    before = _digest(dataset)
    start = time.monotonic()
    out = sparkdl.run(train, dataset, fault, num_workers=2, max_attempts=3, config=CFG,
                      checkpoint_dir=str(tmp_path / "ckpt"))
    assert out["attempt"] == 1
    assert out["restored_from"] is not None  # it resumed, it did not start over
    assert out["steps"] == reference["steps"]
    _assert_same_weights(out["weights"], reference["weights"])
    assert _digest(dataset) == before
    _assert_checkpoints_loadable(tmp_path / "ckpt")
    assert time.monotonic() - start < 120


def test_a_crash_in_the_middle_of_a_checkpoint_write_keeps_the_previous_one(spark, dataset, reference, tmp_path, no_leaks) -> None:  # type: ignore[no-untyped-def]
    # Rank 0 dies while saving its 2nd checkpoint: the 1st stays the latest, and the run resumes from it.
    fault = {"how": "crash_in_save", "save": 2}
    out = sparkdl.run(train, dataset, fault, num_workers=2, max_attempts=3, config=CFG,
                      checkpoint_dir=str(tmp_path / "ckpt"))
    assert out["attempt"] == 1 and out["restored_from"] == 1
    _assert_same_weights(out["weights"], reference["weights"])
    _assert_checkpoints_loadable(tmp_path / "ckpt")
    assert not list((tmp_path / "ckpt").glob(".tmp-*")), "the crashed write's temporary file was not cleaned up"


def test_attempts_used_up_report_names_every_root_cause(spark, dataset, tmp_path, no_leaks) -> None:  # type: ignore[no-untyped-def]
    fault = {"how": "raise_later", "rank": 1, "step": 4, "every_attempt": True}
    with pytest.raises(sparkdl.RunFailedError) as info:
        sparkdl.run(train, dataset, fault, num_workers=2, max_attempts=3, config=CFG,
                    checkpoint_dir=str(tmp_path / "ckpt"))
    report = str(info.value)
    assert info.value.attempts == 3
    for attempt in range(3):
        assert f"Attempt {attempt}:" in report
    # Each attempt got further (it saved checkpoints), so each was worth its rerun.
    assert "flaky failure at step 4" in report and "flaky failure at step 8" in report
    assert "flaky failure at step 12" in report
    assert "Root cause: attempt 0, rank 1" in report
    _assert_checkpoints_loadable(tmp_path / "ckpt")


def typo(ds: sparkdl.Dataset) -> None:
    sparkdl.context()
    len(5)  # type: ignore[arg-type]


def test_a_bug_that_fails_every_rank_the_same_way_does_not_burn_every_attempt(spark, dataset, no_leaks) -> None:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    with pytest.raises(sparkdl.RunFailedError) as info:
        sparkdl.run(typo, dataset, num_workers=2, max_attempts=4, config=CFG)
    assert info.value.attempts == 1
    assert "every rank raised the same TypeError" in str(info.value)
    assert "stop_on_repeated_error" in str(info.value)
    assert time.monotonic() - start < 60


@pytest.mark.one_stack("modern", "an executor lost under a gang is walked on both stacks by tests/cluster/test_shrink.py "
                        "(which reschedules or shrinks the gang)")
@pytest.mark.cluster
def test_losing_the_executor_of_a_rank_reschedules_the_gang(local_cluster, dataset, reference, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from conftest import _listeners_outside_jvm, wait_no_leaks

    before = _listeners_outside_jvm()
    fault = {"how": "kill_executor", "rank": 1, "step": 7}
    out = sparkdl.run(train, dataset, fault, num_workers=2, max_attempts=3, config=CFG,
                      checkpoint_dir=str(tmp_path / "ckpt"))
    assert out["attempt"] >= 1 and out["restored_from"] is not None
    _assert_same_weights(out["weights"], reference["weights"])
    wait_no_leaks(before)


def hold_the_directory(gate: str) -> int | None:
    """Saves a checkpoint, says so, then waits (bounded) until the test lets it finish."""
    ctx = sparkdl.context()
    seq = ctx.save_checkpoint({"step": 1})
    Path(gate, "saved").write_text(ctx.run_id)
    deadline = time.monotonic() + 60
    while not Path(gate, "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return seq


def test_a_second_run_on_a_live_runs_checkpoint_directory_is_refused_naming_both(spark, tmp_path, no_leaks) -> None:  # type: ignore[no-untyped-def]
    import threading

    ckpt, gate = tmp_path / "ckpt", tmp_path / "gate"
    gate.mkdir()
    first: dict[str, Any] = {}

    def run_first() -> None:
        try:
            first["out"] = sparkdl.run(hold_the_directory, str(gate), num_workers=1, config=CFG,
                                       checkpoint_dir=str(ckpt))
        except BaseException as exc:  # reported by the assertion below
            first["error"] = exc

    thread = threading.Thread(target=run_first)
    thread.start()
    try:
        deadline = time.monotonic() + 90
        while not (gate / "saved").exists() and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (gate / "saved").exists(), f"the first run did not save: {first}"
        with pytest.raises(sparkdl.SparkDLError) as info:
            sparkdl.run(hold_the_directory, str(gate), num_workers=1, config=CFG, checkpoint_dir=str(ckpt))
        message = str(info.value)
        holder = (gate / "saved").read_text()
        assert f"in use by run {holder}" in message and "did not start" in message
    finally:
        (gate / "go").write_text("")
        thread.join(timeout=120)
    assert first.get("out") == 1, f"the first run was harmed: {first}"
    assert sparkdl.CheckpointStore(str(ckpt)).load() == {"step": 1}
    assert not (ckpt / ".sparkdl-run.json").exists(), "the run that ended kept its lease"


def stale_then_rerun(gate: str) -> int | None:
    """Attempt 0: rank 0 commits checkpoint 1, hands its store (run and attempt bound) to the test,
    which plays that rank still running on an executor the driver cut off; rank 1 then fails.
    Attempt 1: rank 0 commits, waits (bounded) until the stale writer has tried, commits again."""
    import pickle

    ctx = sparkdl.context()
    gate_dir = Path(gate)
    if ctx.attempt == 0:
        if ctx.rank == 0:
            ctx.save_checkpoint({"step": 1, "attempt": 0})
            (gate_dir / "stale-store.pkl").write_bytes(pickle.dumps(ctx.checkpoints))
            return None
        deadline = time.monotonic() + 60
        while not (gate_dir / "stale-store.pkl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        raise RuntimeError("rank 1 of attempt 0 fails after rank 0's first commit")
    if ctx.rank == 0:
        ctx.save_checkpoint({"step": 2, "attempt": ctx.attempt})
        (gate_dir / "rerun-saved").write_text(ctx.run_id)
        deadline = time.monotonic() + 60
        while not (gate_dir / "stale-tried").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return ctx.save_checkpoint({"step": 3, "attempt": ctx.attempt})
    return None


# The rank 0 of attempt 0 that a partition cut off, still running: it commits once attempt 1 has.
STALE_WRITER = """
import pathlib, pickle, sys, time
gate = pathlib.Path(sys.argv[1])
deadline = time.monotonic() + 120
while not (gate / "rerun-saved").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
store = pickle.loads((gate / "stale-store.pkl").read_bytes())
try:
    store.save({"step": 99, "attempt": 0})
    outcome = "committed"
except Exception as exc:
    outcome = f"{type(exc).__name__}: {exc}"
(gate / "stale-tried").write_text(outcome)
"""


def test_a_stale_attempts_rank_0_cannot_commit_over_the_rerun(spark, tmp_path, no_leaks) -> None:  # type: ignore[no-untyped-def]
    import subprocess

    ckpt, gate = tmp_path / "ckpt", tmp_path / "gate"
    gate.mkdir()
    stale = subprocess.Popen([sys.executable, "-c", STALE_WRITER, str(gate)])
    try:
        out = sparkdl.run(stale_then_rerun, str(gate), num_workers=2, max_attempts=2, config=CFG,
                          checkpoint_dir=str(ckpt))
        stale.wait(timeout=30)
    finally:
        if stale.poll() is None:
            stale.kill()
            stale.wait()
    run_id = (gate / "rerun-saved").read_text()
    outcome = (gate / "stale-tried").read_text()
    assert outcome.startswith("StaleWriterError: ") and f"attempt 0 of run {run_id} is stale: attempt 1" in outcome, outcome
    # The rerun's checkpoints are whole and numbered on; nothing of the stale writer's is there.
    store = sparkdl.CheckpointStore(str(ckpt))
    assert out == 3 and store.sequence_numbers() == [1, 2, 3]
    assert [store.load(seq) for seq in (1, 2, 3)] == [{"step": 1, "attempt": 0}, {"step": 2, "attempt": 1},
                                                     {"step": 3, "attempt": 1}]
    assert not [p.name for p in ckpt.iterdir() if p.name.startswith(".tmp-")]
