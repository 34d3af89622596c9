"""A torn checkpoint never blocks a rerun (invariant 10): every state a crash can leave a save
in is found by the commit record, skipped with its reason, and the rerun resumes from the newest
checkpoint that verifies, bitwise equal to a run that was never interrupted.

A save writes the data file under a temporary name, moves it into place, then writes its commit
record the same way. A process killed between two of those steps leaves the states below; a host
that crashes before the page cache reached the disk (writes are not fsynced by default) leaves an
empty or short data file under a record that says otherwise. Each state is made here on the files
a real save wrote. TrainState runs as rank 0 of 1 in this process; real ranks that crash in a save
are in tests/integration/test_sharded.py and tests/integration/test_faults.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import sparkdl
from sparkdl._internal.ckpt.fence import Writer

STEPS_PER_EPOCH = 6


class _Loader:
    """A loader with a position: batch ``i`` of an epoch is the same tensors on every run."""

    def __init__(self) -> None:
        import torch

        gen = torch.Generator().manual_seed(7)
        self.x = torch.randn(STEPS_PER_EPOCH * 4, 3, generator=gen)
        self.y = torch.randn(STEPS_PER_EPOCH * 4, 1, generator=gen)
        self.epoch, self.step = 0, 0

    def __len__(self) -> int:
        return STEPS_PER_EPOCH

    def __iter__(self) -> Any:
        while self.step < STEPS_PER_EPOCH:
            i = self.step
            self.step += 1
            yield self.x[i * 4:(i + 1) * 4], self.y[i * 4:(i + 1) * 4]
        self.epoch, self.step = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.step = state["epoch"], state["step"]


def _attempt(ckpt: Path, attempt: int, monkeypatch: pytest.MonkeyPatch, *, crash_after: int | None = None) -> Any:
    """One attempt of a run, as rank 0 of 1: trains 2 epochs, saving every 2 steps; with
    ``crash_after``, the attempt dies after that step. Returns the TrainState."""
    import torch

    import sparkdl._internal.train.state as state_module
    from sparkdl._internal.rank.context import RunContext

    ctx = RunContext(rank=0, world_size=1, local_rank=0, local_world_size=1, attempt=attempt, run_id="feed",
                     host="127.0.0.1", backend="torch", gpu_ids=(), use_cuda=False, checkpoint_url=str(ckpt))
    monkeypatch.setattr(state_module, "context", lambda: ctx)
    torch.manual_seed(100 + attempt)  # a rerun starts from other weights: only a restore makes it equal
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = sparkdl.TrainState(model, opt, _Loader())
    for x, y in state.batches(epochs=2, save_every=2):
        # The noise comes from torch's RNG, so an exact resume needs the RNG state restored too.
        loss = ((model(x) - y) ** 2).mean() + 0.01 * torch.randn(()).abs()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if state.global_step + 1 == crash_after:
            break
    return state


def _tmp_only(ckpt: Path, seq: int) -> None:
    """Killed after the data write, before its rename: only the temporary file is there."""
    os.rename(ckpt / f"ckpt-{seq:08d}.pt", ckpt / f".tmp-ckpt-{seq:08d}-feed-0-{'ab' * 16}")
    (ckpt / f"ckpt-{seq:08d}.json").unlink()


def _no_record(ckpt: Path, seq: int) -> None:
    """Killed after the rename, before the commit record."""
    (ckpt / f"ckpt-{seq:08d}.json").unlink()


def _truncate_data(size: Callable[[int], int]) -> Callable[[Path, int], None]:
    def fault(ckpt: Path, seq: int) -> None:
        path = ckpt / f"ckpt-{seq:08d}.pt"
        os.truncate(path, size(path.stat().st_size))
    return fault


def _flip_a_byte(ckpt: Path, seq: int) -> None:
    """Same size, other bytes: a block of another write, or a second writer's rename."""
    path = ckpt / f"ckpt-{seq:08d}.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _torn_record(ckpt: Path, seq: int) -> None:
    path = ckpt / f"ckpt-{seq:08d}.json"
    os.truncate(path, path.stat().st_size // 2)


def _data_gone(ckpt: Path, seq: int) -> None:
    (ckpt / f"ckpt-{seq:08d}.pt").unlink()


FAULTS = {
    "after-the-data-write": (_tmp_only, None),
    "after-the-rename": (_no_record, "it has no commit record"),
    "zero-length": (_truncate_data(lambda n: 0), "its data file is empty"),
    "truncated": (_truncate_data(lambda n: n // 2), "bytes, its commit record says"),
    "same-size-other-bytes": (_flip_a_byte, "checksum differs"),
    "commit-record-torn": (_torn_record, "commit record is not JSON"),
    "data-file-missing": (_data_gone, "its data file is missing"),
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as mp:
        state = _attempt(tmp_path_factory.mktemp("whole") / "ckpt", 0, mp)
    return {k: v.clone() for k, v in state.model.state_dict().items()}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_rerun_skips_a_torn_checkpoint_and_ends_bitwise_equal(
    fault: str, uninterrupted: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch

    ckpt = tmp_path / "ckpt"
    # Attempt 0 saves after steps 2, 4, 6 (the epoch's end) and 8, then dies after step 9.
    _attempt(ckpt, 0, monkeypatch, crash_after=9)
    store = sparkdl.CheckpointStore(ckpt)
    assert store.sequence_numbers() == [2, 3, 4]
    make, reason = FAULTS[fault]
    make(ckpt, 4)
    capsys.readouterr()

    rerun = _attempt(ckpt, 1, monkeypatch)
    assert rerun.restored_from == 3, "the rerun must resume from the newest checkpoint that verifies"
    said = capsys.readouterr().err
    if reason is None:
        assert "skipped checkpoint" not in said
    else:
        assert f"skipped checkpoint 4 of file://{ckpt}: " in said and reason in said
    for key, value in rerun.model.state_dict().items():
        assert torch.equal(value, uninterrupted[key]), f"{key} differs from the uninterrupted run"
    # The rerun's own checkpoints are numbered past the torn one, never on top of it.
    assert store.newest_good() == (7 if reason else 6, [])


def test_an_explicit_load_of_a_torn_checkpoint_names_it_and_why(tmp_path: Path) -> None:
    import torch

    store = sparkdl.CheckpointStore(tmp_path)
    store.save({"w": torch.ones(4)})
    store.save({"w": torch.zeros(4)})
    _truncate_data(lambda n: n - 10)(tmp_path, 2)
    with pytest.raises(sparkdl.SparkDLError, match=r"ckpt-00000002\.pt cannot be trusted: its data file is \d+ bytes"):
        store.load(2)
    assert store.newest_good()[0] == 1 and torch.equal(store.load()["w"], torch.ones(4))
    # A checkpoint written before commit records existed loads when named, and only then.
    _no_record(tmp_path, 1)
    assert torch.equal(store.load(1)["w"], torch.ones(4)) and store.load() is None


def test_a_diverged_state_is_not_committed_under_finite_only(tmp_path: Path) -> None:
    import torch

    store = sparkdl.CheckpointStore(tmp_path, keep=1, finite_only=True)
    store.save({"model": {"w": torch.ones(2)}, "loss": 0.5})
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(sparkdl.SparkDLError, match=r"not committed.*NaN or infinite values at model/w, loss"):
        store.save({"model": {"w": torch.tensor([1.0, float("nan")])}, "loss": float("inf")})
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "the refused save touched the directory"
    assert torch.equal(store.load()["model"]["w"], torch.ones(2))
    # Without the option, a diverged state is a checkpoint like any other (the default).
    sparkdl.CheckpointStore(tmp_path, keep=1).save({"w": torch.tensor([float("nan")])})
    assert store.sequence_numbers() == [2]


def test_checkpoint_sync_fsyncs_each_file_and_its_directory_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    sparkdl.CheckpointStore(tmp_path).save({"w": torch.ones(2)})
    assert synced == []  # the default: no fsync
    sparkdl.CheckpointStore(tmp_path, sync=True).save({"w": torch.ones(2)})
    # The data file and the record, each before its rename, and the directory after each rename.
    assert len(synced) == 4
    assert [Path(p).name.startswith(".tmp-ckpt-00000002-") for p in synced] == [True, False, True, False]
    assert synced[1] == synced[3] == str(tmp_path)


def test_a_stale_attempt_cannot_commit_and_a_writer_removes_only_what_its_run_left(tmp_path: Path) -> None:
    import torch

    old = sparkdl.CheckpointStore(tmp_path, writer=Writer("aa11", 0))
    old.save({"step": 1})
    # Attempt 0 left a half-written file; another run's save is under way in the same directory.
    (tmp_path / f".tmp-ckpt-00000002-aa11-0-{'0' * 32}").write_bytes(b"half")
    (tmp_path / f".tmp-ckpt-00000002-bb22-0-{'1' * 32}").write_bytes(b"theirs")
    (tmp_path / "shards-00000002-bb22-0-abcd").mkdir()
    (tmp_path / "shards-00000002-aa11-0-abcd").mkdir()

    new = sparkdl.CheckpointStore(tmp_path, writer=Writer("aa11", 1))
    assert new.newest_good() == (1, [])  # attempt 1 claims the directory as it restores
    with pytest.raises(sparkdl.SparkDLError, match=r"attempt 0 of run aa11 is stale: attempt 1 .* refused"):
        old.save({"step": 2, "w": torch.ones(1)})
    assert new.sequence_numbers() == [1] and new.load() == {"step": 1}

    new.save({"step": 2})
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(("ckpt-", ".sparkdl-")))
    assert left == [f".tmp-ckpt-00000002-bb22-0-{'1' * 32}", "shards-00000002-bb22-0-abcd"]


def test_a_run_writes_where_an_earlier_run_left_its_fence_but_not_where_another_run_holds_the_lease(tmp_path: Path) -> None:
    import json

    sparkdl.CheckpointStore(tmp_path, writer=Writer("aa11", 3)).save({"step": 1})  # an earlier run, ended
    # A new run's rank 0 saves without restoring first (its own loop): the old fence is no bar.
    assert sparkdl.CheckpointStore(tmp_path, writer=Writer("cc33", 0)).save({"step": 2}) == 2
    # Run dd44 took the directory over (its driver holds the lease): cc33 is fenced off now.
    (tmp_path / ".sparkdl-run.json").write_text(json.dumps({"run": "dd44", "host": "h", "pid": 1, "beat": 1}))
    sparkdl.CheckpointStore(tmp_path, writer=Writer("dd44", 0)).newest_good()
    with pytest.raises(sparkdl.SparkDLError, match=r"run dd44 has taken this checkpoint directory over from run cc33"):
        sparkdl.CheckpointStore(tmp_path, writer=Writer("cc33", 0)).save({"step": 3})
    assert sparkdl.CheckpointStore(tmp_path).sequence_numbers() == [1, 2]
