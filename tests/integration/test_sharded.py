"""Sharded checkpoints of FSDP models, and resuming a run on another number of ranks.

Every run here is real: ranks are processes launched by ``sparkdl.run`` on a local Spark, the
model is sharded with FSDP2 (``fully_shard``) over gloo, checkpoints are written by every rank
with ``torch.distributed.checkpoint`` into a directory on disk, and faults are real (SIGKILL, a
process exiting in the middle of writing its shards).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
from conftest import needs_session

import sparkdl
from sparkdl._internal.common.errors import SparkDLError

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.spark, pytest.mark.fault]

CFG = sparkdl.RunConfig(start_timeout_s=90, slot_wait_s=30, collective_timeout_s=8.0, kill_grace_s=30)
ROWS = 480


@pytest.fixture(scope="module")
def dataset(any_spark, tmp_path_factory):  # type: ignore[no-untyped-def]
    import random

    rng = random.Random(11)
    rows = []
    for i in range(ROWS):
        x = [rng.uniform(-1, 1) for _ in range(8)]
        rows.append((i, x, sum(x[:4]) - 0.5 * x[5] + rng.gauss(0, 0.05)))
    df = any_spark.createDataFrame(rows, "id long, x array<float>, y double")
    return sparkdl.write_dataset(df, str(tmp_path_factory.mktemp("sharded") / "data"), num_files=4)


def _full(model: Any) -> dict[str, Any]:
    """The whole parameters of a sharded model, on every rank (a collective)."""
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def train(ds: sparkdl.Dataset, opts: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.distributed.fsdp import fully_shard

    ctx = sparkdl.context()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    fully_shard(net[0])
    fully_shard(net[2])
    fully_shard(net)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    state = sparkdl.TrainState(net, opt, ds.loader(opts["batch"], seed=3))
    assert state.sharded
    fault = opts.get("fault", {})
    if fault.get("how") == "die_writing_shards" and ctx.attempt == 0 and ctx.rank == fault["rank"]:
        _die_in_the_nth_shard_write(fault["save"])
    log = Path(opts["log"]) if "log" in opts else None
    first: dict[str, Any] | None = None
    losses = []
    for batch in state.batches(epochs=opts["epochs"], save_every=opts["save_every"]):
        if first is None:
            first = _full(net)  # the parameters the run starts (or resumes) from
        step = state.global_step
        if ctx.attempt == 0 and step == fault.get("step") and ctx.rank == fault.get("rank", ctx.rank):
            if fault["how"] == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault["how"] == "stop":  # the run ends here, its last checkpoint just saved
                raise RuntimeError(f"stopping after step {step}")
        if log is not None:
            with open(log / f"ids-w{ctx.world_size}-r{ctx.rank}", "a") as f:
                f.write(json.dumps([state.loader.epoch, batch["id"].tolist()]) + "\n")
        loss = torch.nn.functional.mse_loss(net(batch["x"]).squeeze(1), batch["y"].float())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if log is not None and step + 1 == opts.get("snapshot_at"):
            weights = _full(net)
            if ctx.rank == 0:
                torch.save(weights, log / "snapshot.pt")
    return {
        "weights": _full(net),
        "first": first,
        "attempt": ctx.attempt,
        "restored_from": state.restored_from,
        "steps": state.global_step,
        "losses": losses,
        "world_size": ctx.world_size,
    }


def _die_in_the_nth_shard_write(n: int) -> None:
    """Makes this process exit while it writes its shards of the ``n``-th sharded save: its
    files are half there, DCP's metadata is not, and the other ranks wait in a collective."""
    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data
    calls = {"n": 0}

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == n:
            path = Path(str(self.path))
            path.mkdir(parents=True, exist_ok=True)
            (path / "__1_0.distcp").write_bytes(b"half a shard")
            os._exit(9)
        return original(self, plan, planner)

    FileSystemWriter.write_data = write_data  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def reference(spark, dataset, tmp_path_factory):  # type: ignore[no-untyped-def]
    opts = {"batch": 16, "epochs": 2, "save_every": 4}
    out = sparkdl.run(train, dataset, opts, num_workers=2, config=CFG,
                      checkpoint_dir=str(tmp_path_factory.mktemp("ref") / "ckpt"))
    assert out["attempt"] == 0 and out["restored_from"] is None
    return out


def _assert_same(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    import torch

    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs from {what}"


def test_sigkill_of_a_rank_resumes_the_sharded_model_bitwise_equal(spark, dataset, reference, tmp_path, no_leaks) -> None:  # type: ignore[no-untyped-def]
    opts = {"batch": 16, "epochs": 2, "save_every": 4, "fault": {"how": "sigkill", "rank": 1, "step": 10}}
    ckpt = tmp_path / "ckpt"
    out = sparkdl.run(train, dataset, opts, num_workers=2, max_attempts=3, config=CFG, checkpoint_dir=str(ckpt))
    assert out["attempt"] == 1
    assert out["restored_from"] == 2  # saved at steps 4 and 8
    assert out["steps"] == reference["steps"]
    _assert_same(out["weights"], reference["weights"], "the uninterrupted run")
    # Each kept checkpoint is a commit file naming a directory of both ranks' shards.
    store = sparkdl.CheckpointStore(str(ckpt))
    seqs = store.sequence_numbers()
    assert len(seqs) == 3
    shard_dirs = sorted(p.name for p in ckpt.iterdir() if p.is_dir())
    assert [int(name.split("-")[1]) for name in shard_dirs] == seqs
    for name in shard_dirs:
        assert {p.name for p in (ckpt / name).iterdir()} == {"__0.metadata", "__0_0.distcp", "__1.metadata", "__1_0.distcp"}
    with pytest.raises(SparkDLError, match=r"is sharded.*load_checkpoint\(into="):
        store.load()


def test_a_rank_dying_in_the_middle_of_a_sharded_save_leaves_the_previous_checkpoint(spark, dataset, reference, tmp_path, no_leaks) -> None:  # type: ignore[no-untyped-def]
    # Rank 1 exits while writing its shards of the 2nd save (step 8): checkpoint 1 stays the latest.
    opts = {"batch": 16, "epochs": 2, "save_every": 4, "fault": {"how": "die_writing_shards", "rank": 1, "save": 2}}
    ckpt = tmp_path / "ckpt"
    out = sparkdl.run(train, dataset, opts, num_workers=2, max_attempts=3, config=CFG, checkpoint_dir=str(ckpt))
    assert out["attempt"] == 1
    assert out["restored_from"] == 1, "the half-written checkpoint 2 must never be loaded"
    _assert_same(out["weights"], reference["weights"], "the uninterrupted run")
    # The half-written shards are gone; every directory left belongs to a committed checkpoint.
    store = sparkdl.CheckpointStore(str(ckpt))
    dirs = sorted(p.name for p in ckpt.iterdir() if p.is_dir())
    assert [int(name.split("-")[1]) for name in dirs] == store.sequence_numbers()


@pytest.fixture(scope="module")
def one_epoch_saved(spark, dataset, tmp_path_factory):  # type: ignore[no-untyped-def]
    """The checkpoints of one epoch of a real run, for the planting tests to copy and spoil."""
    ckpt = tmp_path_factory.mktemp("one-epoch") / "ckpt"
    sparkdl.run(train, dataset, {"batch": 16, "epochs": 1, "save_every": 4}, num_workers=2, config=CFG,
                checkpoint_dir=str(ckpt))
    return ckpt


class _Payload:
    """What a planter hides in a pickle: unpickling it touches ``marker``, i.e. runs code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _planted(one_epoch_saved: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """A copy of the saved checkpoints to plant in: (the directory, its newest shards, the marker)."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(one_epoch_saved, ckpt)
    return ckpt, max(p for p in ckpt.iterdir() if p.is_dir()), tmp_path / "ran"


def _resume_refused(dataset: sparkdl.Dataset, ckpt: Path, match: str) -> None:
    with pytest.raises(sparkdl.RunFailedError, match=match):
        sparkdl.run(train, dataset, {"batch": 16, "epochs": 2, "save_every": 4}, num_workers=2, max_attempts=1,
                    config=CFG, checkpoint_dir=str(ckpt))


def test_planted_metadata_is_refused_without_running_it(spark, dataset, one_epoch_saved, tmp_path, no_leaks) -> None:  # type: ignore[no-untyped-def]
    ckpt, latest, marker = _planted(one_epoch_saved, tmp_path)
    (latest / "__1.metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _forge_record(ckpt, latest.name)  # the planter rewrites the commit record to match
    _resume_refused(dataset, ckpt, r"metadata.*holds what no checkpoint metadata holds")
    assert not marker.exists()


def _forge_record(ckpt: Path, shard_dir: str) -> None:
    """What a planter who knows the format does: the commit record made to match planted shards."""
    import hashlib

    path = next(p for p in ckpt.glob("ckpt-*.json") if json.loads(p.read_text())["shards"]["dir"] == shard_dir)
    record = json.loads(path.read_text())
    files = sorted((ckpt / shard_dir).iterdir())
    record["shards"]["files"] = {p.name: p.stat().st_size for p in files}
    record["shards"]["metadata_sha256"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                                           for p in files if p.name.endswith(".metadata")}
    path.write_text(json.dumps(record))


def test_planted_byte_entries_in_real_metadata_are_refused_without_running_them(spark, dataset, one_epoch_saved, tmp_path, no_leaks) -> None:  # type: ignore[no-untyped-def]
    """DCP reads an entry its metadata marks as bytes with torch.load(weights_only=False): the
    planter marks a tensor that every restore asks for as bytes, stored in a shard file of its own."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    ckpt, latest, marker = _planted(one_epoch_saved, tmp_path)
    metadata = pickle.loads((latest / "__0.metadata").read_bytes())  # sparkdl's own, read by the test
    key = sorted(metadata.state_dict_metadata)[0]  # e.g. "model/0.weight": a key every restore requests
    payload = pickle.dumps(_Payload(marker))
    (latest / "__0_9.distcp").write_bytes(payload)
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data = {i: s for i, s in metadata.storage_data.items() if i.fqn != key}
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo("__0_9.distcp", 0, len(payload))
    (latest / "__0.metadata").write_bytes(pickle.dumps(metadata))
    _forge_record(ckpt, latest.name)
    _resume_refused(dataset, ckpt, rf"not one sparkdl's save writes: entry '{key}' is a BytesStorageMetadata")
    assert not marker.exists(), "restoring ran code from the planted shard file"


def test_a_commit_whose_shards_are_missing_or_torn_is_skipped_for_the_one_before(spark, dataset, reference, one_epoch_saved, tmp_path, capfd, no_leaks) -> None:  # type: ignore[no-untyped-def]
    # One epoch saves after steps 4, 8 and 12 and at its end (15): checkpoints 2, 3 and 4 are kept.
    opts = {"batch": 16, "epochs": 1, "save_every": 4}
    ckpt = _planted(one_epoch_saved, tmp_path)[0]
    store = sparkdl.CheckpointStore(str(ckpt))
    assert store.sequence_numbers() == [2, 3, 4]
    dirs = sorted(p for p in ckpt.iterdir() if p.is_dir())
    (dirs[-1] / "__1_0.distcp").unlink()  # a host lost rank 1's shards of checkpoint 4
    os.truncate(dirs[-2] / "__0_0.distcp", 10)  # and tore rank 0's of checkpoint 3
    capfd.readouterr()
    result = sparkdl.launch(train, dataset, {**opts, "epochs": 2}, num_workers=2, config=CFG, checkpoint_dir=str(ckpt))
    out = result.value
    assert out["attempt"] == 0 and out["restored_from"] == 2
    _assert_same(out["weights"], reference["weights"], "the uninterrupted run")
    missing = f"its shard file {dirs[-1].name}/__1_0.distcp is missing"
    torn = f"its shard file {dirs[-2].name}/__0_0.distcp is 10 bytes"
    said = capfd.readouterr().err
    assert f"skipped checkpoint 4 of file://{ckpt}: {missing}" in said
    assert f"skipped checkpoint 3 of file://{ckpt}: {torn}" in said
    # The run's result names them too (rank 0 verifies for the gang), with the same reasons.
    assert [(s["attempt"], s["rank"], s["checkpoint"]) for s in result.skipped_checkpoints] == [(0, 0, 4), (0, 0, 3)]
    assert result.skipped_checkpoints[0]["reason"].startswith(missing)
    assert result.skipped_checkpoints[1]["reason"].startswith(torn)


def _fed(log: Path) -> dict[int, dict[tuple[int, int], list[int]]]:
    """Ids fed in each epoch, by (world size, rank): ``{epoch: {(w, r): [ids...]}}``."""
    fed: dict[int, dict[tuple[int, int], list[int]]] = {}
    for path in log.glob("ids-w*-r*"):
        w, r = (int(part[1:]) for part in path.name.split("-")[1:])
        for line in path.read_text().splitlines():
            epoch, ids = json.loads(line)
            fed.setdefault(epoch, {}).setdefault((w, r), []).extend(ids)
    return fed


@pytest.fixture(scope="module")
@needs_session("local[4]")
def four_slots(spark_session):  # type: ignore[no-untyped-def]
    return spark_session("local[4]")


@pytest.mark.parametrize(("before", "after", "stop_at"), [(4, 2, 5), (2, 4, 10)], ids=["4-to-2", "2-to-4"])
def test_a_run_resumes_on_another_number_of_ranks(four_slots, dataset, tmp_path, before, after, stop_at) -> None:  # type: ignore[no-untyped-def]
    ckpt, log = tmp_path / "ckpt", tmp_path / "log"
    log.mkdir()
    opts = {"batch": 8, "epochs": 2, "save_every": stop_at, "log": str(log), "snapshot_at": stop_at,
            "fault": {"how": "stop", "step": stop_at}}
    with pytest.raises(sparkdl.RunFailedError, match=f"stopping after step {stop_at}"):
        sparkdl.run(train, dataset, opts, num_workers=before, max_attempts=1, config=CFG, checkpoint_dir=str(ckpt))
    saved = __import__("torch").load(log / "snapshot.pt")
    out = sparkdl.run(train, dataset, {**opts, "fault": {}}, num_workers=after, config=CFG, checkpoint_dir=str(ckpt))
    assert out["restored_from"] == 1 and out["world_size"] == after
    # The model resumed from the checkpoint, resharded from `before` ranks to `after`.
    _assert_same(out["first"], saved, f"the parameters saved by {before} ranks")
    fed = _fed(log)
    # Epoch 0: the rows fed before the checkpoint, by `before` ranks, and after it, by `after`
    # ranks, are every row exactly once; each run fed the same number of batches on every rank.
    interrupted = fed[0]
    everything = sorted(i for ids in interrupted.values() for i in ids)
    assert everything == list(range(ROWS))
    old = {r: len(ids) for (w, r), ids in interrupted.items() if w == before}
    new = {r: len(ids) for (w, r), ids in interrupted.items() if w == after}
    assert len(old) == before and set(old.values()) == {stop_at * 8}
    assert len(new) == after and len(set(new.values())) == 1
    # Epoch 1 is planned for `after` ranks from the start: every row once, equal shares.
    assert sorted(i for ids in fed[1].values() for i in ids) == list(range(ROWS))
    assert {len(ids) for ids in fed[1].values()} == {ROWS // after}
    # Training went on and learned: the last epoch's losses are far below the first steps'.
    losses = out["losses"]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


def own_loop(save: bool) -> dict[str, Any]:
    """A loop of the user's own: ``save_checkpoint(sharded=True)`` and ``load_checkpoint(into=)``."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    ctx = sparkdl.context()
    torch.manual_seed(1 if save else 2)  # the loading run starts from other weights
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    fully_shard(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    if save:
        net(torch.randn(4, 8)).sum().backward()
        opt.step()
        msd, osd = get_state_dict(net, opt)
        seq = ctx.save_checkpoint({"model": msd, "optimizer": osd, "note": "mine"}, sharded=True)
        return {"seq": seq, "weights": _full(net)}
    msd, osd = get_state_dict(net, opt)
    ckpt = ctx.load_checkpoint(into={"model": msd, "optimizer": osd})
    set_state_dict(net, opt, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optimizer"])
    return {"note": ckpt["note"], "weights": _full(net)}


def test_a_loop_of_ones_own_saves_and_loads_sharded_checkpoints(spark, tmp_path, no_leaks) -> None:  # type: ignore[no-untyped-def]
    ckpt = str(tmp_path / "ckpt")
    saved = sparkdl.run(own_loop, True, num_workers=2, config=CFG, checkpoint_dir=ckpt)
    assert saved["seq"] == 1
    loaded = sparkdl.run(own_loop, False, num_workers=1, config=CFG, checkpoint_dir=ckpt)
    assert loaded["note"] == "mine"
    _assert_same(loaded["weights"], saved["weights"], "the weights saved by 2 ranks")
