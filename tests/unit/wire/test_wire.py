"""The task <-> driver messages, what a rank is told, and the monitor fed over a real channel."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from sparkdl._internal.ckpt.store import CheckpointStore
from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import NotInRunError
from sparkdl._internal.driver.monitor import Monitor
from sparkdl._internal.driver.policy import Decision
from sparkdl._internal.driver.progress import MetricsLog, Progress
from sparkdl._internal.driver.report import RankRecord
from sparkdl._internal.wire.channel import ChannelError, connect
from sparkdl._internal.wire.messages import (
    DumpStacks,
    Exited,
    Gang,
    GoAhead,
    Hello,
    LogLine,
    LogLines,
    Metric,
    RankState,
    Started,
    TaskMessage,
    decode,
    encode,
)
from sparkdl._internal.wire.rankspec import (
    GangSpec,
    RankSpec,
    RunSpec,
    gang_env,
    rank_env,
    read_gang,
    read_rank,
)
from sparkdl._internal.wire.server import ChannelServer


@pytest.mark.parametrize(
    "message",
    [
        Hello("10.0.0.2", 4242, 17),
        Gang((3, 5, 9)),
        Started(777),
        Exited(0, None),
        Exited(None, 9, "killed", None),
        Exited(1, None, "ValueError: bad", "Traceback ...\nValueError: bad"),
        LogLine("e", "a line with unicode é and \"quotes\"", more=True),
        LogLines("o", ("one", "", "three é")),
        Metric({"loss": 0.25, "epoch": 3, "note": "ok"}),
    ],
)
def test_every_message_survives_json_on_the_wire(message: TaskMessage) -> None:
    frame = json.loads(json.dumps(encode(message, rank=2, attempt=1)))
    env = decode(frame)
    assert (env.rank, env.attempt, env.message) == (2, 1, message)


@pytest.mark.parametrize(
    ("frame", "complaint"),
    [
        ({"t": "shout", "r": 0, "a": 0}, "unknown message kind"),
        ({"t": "started", "a": 0, "pid": 1}, "'r' is not an integer"),
        ({"t": "started", "r": True, "a": 0, "pid": 1}, "'r' is not an integer"),
        ({"t": "gang", "r": 0, "a": -1, "tids": "1,2"}, "no list of task ids"),
        ({"t": "gang", "r": 0, "a": -1, "tids": [1, "2"]}, "'tids' is not an integer"),
        ({"t": "metric", "r": 0, "a": 0, "m": [1, 2]}, "no record"),
        ({"t": "logs", "r": 0, "a": 0, "s": "o", "ls": "one line"}, "no list of lines"),
        ({"t": "exit", "r": 0, "a": 0, "code": "1"}, "'code' is not an integer"),
    ],
)
def test_a_malformed_frame_is_refused_by_name(frame: dict[str, Any], complaint: str) -> None:
    with pytest.raises(ChannelError, match=complaint):
        decode(frame)


def test_the_drivers_reply_round_trips_and_a_missing_reply_means_stop() -> None:
    assert GoAhead.decode(GoAhead(True, attempt=2).encode()) == GoAhead(True, attempt=2)
    refused = GoAhead.decode(GoAhead(False, reason="attempt 3 exceeds max_attempts=3").encode())
    assert not refused.go and refused.reason == "attempt 3 exceeds max_attempts=3"
    assert GoAhead.decode(None) == GoAhead(False, reason="no reply")


def test_rank_state_is_an_enum_that_reports_still_read_as_text() -> None:
    record = RankRecord(attempt=0, rank=1, state="lost")  # type: ignore[arg-type]
    assert record.state is RankState.LOST and record.failed
    assert str(RankState.FAILED) == "failed"
    assert {s for s in RankState if s.ended} == {RankState.SUCCEEDED, RankState.FAILED, RankState.LOST}
    with pytest.raises(ValueError):
        RankRecord(attempt=0, rank=0, state="sleeping")  # type: ignore[arg-type]


def test_what_a_rank_is_told_round_trips_through_its_environment() -> None:
    run = RunSpec("r1", 3, "torch", False, "file:///ckpt", RunConfig(collective_timeout_s=42, keep_checkpoints=5,
                                                                    init_process_group=False))
    spec = RankSpec.of(run, rank=2, host="10.0.0.3", gpu_ids=[], task_pid=99)
    gang = GangSpec.form(spec, attempt=1, hosts=["10.0.0.1", "10.0.0.3", "10.0.0.3"], master_port=29500)
    env = {**rank_env(spec), **gang_env(spec, gang)}
    assert read_rank(env) == spec and read_gang(env) == gang
    # torch's own names, for a user's init_process_group(): from the same description.
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["RANK"], env["WORLD_SIZE"]) == ("10.0.0.1", "29500", "2", "3")
    # Two ranks share host 10.0.0.3: this one is the second of them.
    assert (gang.local_rank, gang.local_world_size) == (1, 2)


def test_a_checkpoint_urls_password_stays_out_of_the_ranks_environment_and_messages(tmp_path: Path) -> None:
    import stat

    from sparkdl._internal.wire.rankspec import write_secrets

    url = "ftp://trainer:s3cret@files.example/ckpt"
    run = RunSpec("r1", 2, "torch", False, url, RunConfig(checkpoint_sync=True, checkpoint_finite_only=True))
    spec = RankSpec.of(run, rank=1, host="h", gpu_ids=[], task_pid=1)
    write_secrets(spec, tmp_path)
    env = rank_env(spec, tmp_path)
    assert not any("s3cret" in value for value in env.values())
    assert env["SPARKDL_CHECKPOINT_DIR"] == "ftp://trainer:***@files.example/ckpt"
    assert stat.S_IMODE((tmp_path / "checkpoint_url").stat().st_mode) == 0o600
    told = read_rank(env)
    assert told == spec and told.checkpoint_url == url and told.checkpoint_sync and told.checkpoint_finite_only
    assert "s3cret" not in repr(CheckpointStore(url))  # what sparkdl says of such a store


def test_a_rank_with_gpus_sees_only_its_own_and_is_local_rank_0() -> None:
    run = RunSpec("r1", 2, "torch", True, "file:///ckpt", RunConfig())
    spec = RankSpec.of(run, rank=1, host="h", gpu_ids=["3"], task_pid=1)
    gang = GangSpec.form(spec, attempt=0, hosts=["h", "h"], master_port=1)
    assert (gang.local_rank, gang.local_world_size) == (0, 1)
    assert rank_env(spec)["CUDA_VISIBLE_DEVICES"] == "3"


def test_ranks_sharing_a_task_and_its_gpus_are_numbered_within_it_as_torchrun_does() -> None:
    # RunConfig(processes_per_task=2): task 1 holds ranks 2 and 3 and both of its GPUs.
    run = RunSpec("r1", 4, "torch", True, "file:///ckpt", RunConfig(processes_per_task=2))
    told = []
    for rank in (2, 3):
        spec = RankSpec.of(run, rank=rank, host="h", gpu_ids=["2", "3"], task_pid=1)
        gang = GangSpec.form(spec, attempt=0, hosts=["g", "g", "h", "h"], master_port=1)
        env = {**rank_env(spec), **gang_env(spec, gang)}
        assert read_rank(env) == spec and read_gang(env) == gang
        told.append((env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["CUDA_VISIBLE_DEVICES"]))
    assert told == [("0", "2", "2,3"), ("1", "2", "2,3")]


def test_reading_a_rank_outside_a_run_says_where_it_works() -> None:
    with pytest.raises(NotInRunError, match=r"inside a function launched by sparkdl\.run"):
        read_rank({})


class _Tasks:
    """Connects like a Spark task would, over the real authenticated channel."""

    def __init__(self, server: ChannelServer, secret: bytes) -> None:
        self.server, self.secret = server, secret

    def connect(self) -> Any:
        return connect(self.server.address, self.secret, timeout=5)


def _wait_until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + 5
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_monitor_over_a_real_channel_numbers_gangs_tags_output_and_judges_with_the_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    cfg = RunConfig(outcome_wait_s=60, log_tail_lines=5)
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    monitor = Monitor(2, 3, cfg, store, metrics, Progress(1.0, enabled=False))
    secret = b"z" * 32
    with ChannelServer("127.0.0.1", secret, monitor.on_message, monitor.on_close, handshake_timeout_s=2) as server:
        tasks = _Tasks(server, secret)
        conns = [tasks.connect() for _ in range(2)]
        for rank, conn in enumerate(conns):
            conn.send(encode(Hello("127.0.0.1", 100 + rank, 10 + rank), rank=rank, attempt=-1))
            conn.send(encode(Gang((10, 11)), rank=rank, attempt=-1))
        replies = [GoAhead.decode(conn.recv(timeout=5)) for conn in conns]
        assert replies == [GoAhead(True, attempt=0), GoAhead(True, attempt=0)]
        with monitor.cond:
            assert monitor.check(time.monotonic()).decision is Decision.WAIT  # notes attempt 0's checkpoint
        for rank, conn in enumerate(conns):
            conn.send(encode(Started(500 + rank), rank=rank, attempt=0))
        conns[1].send(encode(LogLine("o", "half of a ", more=True), rank=1, attempt=0))
        conns[1].send(encode(LogLine("o", "line"), rank=1, attempt=0))
        # A record cannot claim another rank: the frame's rank and attempt win.
        conns[1].send(encode(Metric({"loss": 0.5, "rank": 0}), rank=1, attempt=0))
        store.save({"step": 1})  # attempt 0 made progress before it failed
        for rank, conn in enumerate(conns):
            conn.send(encode(Exited(1, None, "TypeError: f() missing 1 argument", "tb"), rank=rank, attempt=0))
        _wait_until(lambda: all(r.state is RankState.FAILED for r in monitor.records.values()), "both failed")
        _wait_until(lambda: metrics.records, "the metric arrived")
        with monitor.cond:
            verdict = monitor.check(time.monotonic())
        # Every rank raised the same TypeError, but a checkpoint was saved: worth a rerun.
        assert verdict.decision is Decision.WAIT and verdict.judged == (0,)
        # A malformed frame ends that task's connection: its rank is lost, the driver goes on.
        conns[0].send({"t": "started", "r": "zero", "a": 0})
        with pytest.raises((ChannelError, OSError)):
            # (Before that, a request for rank 0's stacks, if rank 1's failure was heard first.)
            while (frame := conns[0].recv(timeout=5)) is not None:
                assert DumpStacks.asked(frame), frame
            raise ChannelError("the driver closed the connection")
        for conn in conns:
            conn.close()
    assert not monitor.output.close(timeout_s=10)  # as the run does before it returns
    out = capsys.readouterr().out
    assert "[rank 1] half of a line" in out
    assert monitor.records[(0, 1)].tail == ["half of a line"]
    assert metrics.records == [{"loss": 0.5, "rank": 1, "attempt": 0}]
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == metrics.records


def test_monitor_refuses_a_gang_beyond_max_attempts_and_one_formed_while_stopping(tmp_path: Path) -> None:
    monitor = Monitor(1, 1, RunConfig(), None, MetricsLog(None), Progress(1.0, enabled=False))
    assert monitor.join("a", 0, Gang((1,))) == GoAhead(True, attempt=0)
    refused = monitor.join("b", 0, Gang((2,)))
    assert not refused.go and refused.reason == "attempt 1 exceeds max_attempts=1"
    monitor.stopping = "the driver was interrupted"
    assert monitor.join("c", 0, Gang((1,))) == GoAhead(False, reason="the driver was interrupted")
