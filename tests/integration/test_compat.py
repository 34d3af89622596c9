"""Code written for Databricks' HorovodRunner and Spark's TorchDistributor runs unchanged on sparkdl.

The signatures and the checks that need no session are in tests/unit/compat/test_compat_signatures.py.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

import cloudpickle
import pytest
from conftest import REPO, needs_session
from resources.horovod_runner_train import hvd_train

import sparkdl

cloudpickle.register_pickle_by_value(sys.modules[__name__])
# Spark's own TorchDistributor pickles with pyspark's vendored copy of cloudpickle.
pyspark_cloudpickle = pytest.importorskip("pyspark.cloudpickle")
pyspark_cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.spark
SCRIPT = str(REPO / "tests" / "resources" / "td_train_script.py")


@pytest.mark.parametrize("np", [2, -2])
def test_horovod_runner_runs_documented_code(spark, capfd, no_leaks, np: int) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("horovod.torch")
    out = sparkdl.HorovodRunner(np=np).run(hvd_train, lr=0.05)
    assert out["size"] == 2
    printed = capfd.readouterr().out
    assert "[rank 0] hvd rank 0 of 2 done" in printed and "[rank 1] hvd rank 1 of 2 done" in printed
    if np == 2:
        # The same code, the same result on the cluster and on the driver.
        local = sparkdl.HorovodRunner(np=-2).run(hvd_train, lr=0.05)
        assert local["weight"] == pytest.approx(out["weight"], abs=1e-6)


def td_train(lr: float, backend: str = "nccl", steps: int = 10) -> list[float]:
    # As written for pyspark.ml.torch.distributor.TorchDistributor.
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    w = torch.zeros(3, requires_grad=True)
    x = torch.arange(6.0).reshape(2, 3) + rank
    for _ in range(steps):
        (x @ w - 1.0).pow(2).mean().backward()
        with torch.no_grad():
            dist.all_reduce(w.grad)
            w -= lr * w.grad / dist.get_world_size()
            w.grad.zero_()
    dist.destroy_process_group()
    return w.tolist()


@pytest.mark.parametrize("local_mode", [False, True])
def test_torch_distributor_function_matches_sparks_own(spark, no_leaks, local_mode: bool) -> None:  # type: ignore[no-untyped-def]
    from pyspark.ml.torch.distributor import TorchDistributor as SparkTD

    # Keyword arguments reach the function, backend= too, though sparkdl.run has a backend of its
    # own (without them the function would try NCCL on CPUs and run 10 steps).
    ours = sparkdl.TorchDistributor(num_processes=2, local_mode=local_mode, use_gpu=False).run(
        td_train, 0.05, backend="gloo", steps=7)
    theirs = SparkTD(num_processes=2, local_mode=local_mode, use_gpu=False).run(td_train, 0.05, backend="gloo", steps=7)
    assert ours == pytest.approx(theirs, abs=1e-7)


@pytest.mark.parametrize("local_mode", [False, True])
def test_torch_distributor_script_matches_sparks_own(spark, tmp_path, no_leaks, local_mode: bool) -> None:  # type: ignore[no-untyped-def]
    from pyspark.ml.torch.distributor import TorchDistributor as SparkTD

    ours_out, theirs_out = tmp_path / "ours.json", tmp_path / "theirs.json"
    assert sparkdl.TorchDistributor(num_processes=2, local_mode=local_mode, use_gpu=False).run(
        SCRIPT, "--out", str(ours_out), "--lr", "0.05") is None
    SparkTD(num_processes=2, local_mode=local_mode, use_gpu=False).run(SCRIPT, "--out", str(theirs_out), "--lr", "0.05")
    ours, theirs = json.loads(ours_out.read_text()), json.loads(theirs_out.read_text())
    assert ours["world"] == theirs["world"] == 2
    assert ours["w"] == pytest.approx(theirs["w"], abs=1e-7)


@pytest.mark.parametrize("local_mode", [False, True])
def test_torch_distributor_refuses_keywords_for_a_script_like_sparks(spark, local_mode: bool) -> None:  # type: ignore[no-untyped-def]
    from pyspark.ml.torch.distributor import TorchDistributor as SparkTD

    # Spark's ValueError comes before any process starts in local mode (in a task otherwise);
    # ours before anything starts, in both modes.
    with pytest.raises(ValueError):
        SparkTD(num_processes=2, local_mode=True, use_gpu=False).run(SCRIPT, "--lr", "0.05", epochs=3)
    with pytest.raises(sparkdl.ConfigError, match=r"keyword arguments \(epochs\).*command-line arguments only"):
        sparkdl.TorchDistributor(num_processes=2, local_mode=local_mode, use_gpu=False).run(
            SCRIPT, "--lr", "0.05", epochs=3)


@contextlib.contextmanager
def session_confs(spark: Any, confs: dict[str, str]) -> Iterator[None]:
    # Both classes read GPU confs through spark.conf, which a running session lets a test set.
    for key, value in confs.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key in confs:
            spark.conf.unset(key)


SPARK_4 = int(__import__("pyspark").__version__.split(".")[0]) >= 4
TASK_UNSET = r"'spark\.task\.resource\.gpu\.amount' is unset.*use_gpu=False"
TASK_GPUS = "spark.task.resource.gpu.amount"


@pytest.mark.parametrize(("kwargs", "confs", "raised", "ours_says"), [
    # Spark's class defaults to use_gpu=True: without GPU confs both refuse at construction.
    ({"num_processes": 2, "local_mode": False}, {}, RuntimeError, TASK_UNSET),
    ({"num_processes": 2}, {}, RuntimeError, r"'spark\.driver\.resource\.gpu\.amount' is unset.*use_gpu=False"),
    # The GPU confs are checked before num_processes, in both.
    ({"num_processes": 0, "local_mode": False}, {}, RuntimeError, TASK_UNSET),
    ({"num_processes": 0, "local_mode": False, "use_gpu": False}, {}, ValueError, r"num_processes=0"),
    ({"num_processes": -2, "local_mode": False}, {TASK_GPUS: "1"}, ValueError, r"num_processes=-2"),
    # Spark's int("0.5") refuses a fraction of a GPU with a ValueError: ours is one too.
    ({"num_processes": 2, "local_mode": False}, {TASK_GPUS: "0.5"}, ValueError, r"is 0\.5, not a whole number"),
    pytest.param({"num_processes": 3, "local_mode": False}, {TASK_GPUS: "2"}, RuntimeError,
                 r"must be a multiple of spark\.task\.resource\.gpu\.amount.*num_processes=2 or 4",
                 marks=pytest.mark.skipif(not SPARK_4, reason="pyspark 3.5 takes ceil(3 / 2) tasks")),
    ({"num_processes": 4, "local_mode": False}, {TASK_GPUS: "2"}, None, ""),
])
def test_torch_distributor_constructor_refuses_like_sparks(  # type: ignore[no-untyped-def]
    spark, kwargs: dict[str, Any], confs: dict[str, str], raised: type[Exception] | None, ours_says: str,
) -> None:
    from pyspark.ml.torch.distributor import TorchDistributor as SparkTD

    with session_confs(spark, confs):
        if raised is None:
            assert sparkdl.TorchDistributor(**kwargs).num_processes == SparkTD(**kwargs).num_processes == 4
            return
        with pytest.raises(raised) as theirs:
            SparkTD(**kwargs)
        with pytest.raises(raised, match=ours_says) as ours:
            sparkdl.TorchDistributor(**kwargs)
    assert isinstance(ours.value, sparkdl.ConfigError)
    # Spark's own tests match its words for num_processes; ours say them too.
    if "positive integer" in str(theirs.value):
        assert "num_processes has to be a positive integer" in str(ours.value)


def test_torch_distributor_input_params_are_sparks(spark) -> None:  # type: ignore[no-untyped-def]
    from pyspark.ml.torch.distributor import TorchDistributor as SparkTD

    for kwargs in ({"num_processes": 3, "local_mode": False, "use_gpu": False},
                   {"num_processes": 2, "local_mode": True, "use_gpu": False}):
        assert sparkdl.TorchDistributor(**kwargs).input_params == SparkTD(**kwargs).input_params


def fails_on_rank_1() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("rank 1 is broken")
    dist.barrier()


def test_local_mode_failure_gives_the_report_and_leaves_nothing(spark, no_leaks) -> None:  # type: ignore[no-untyped-def]
    # Caught as a RuntimeError, as code written for Spark's class catches its failures.
    with pytest.raises(RuntimeError, match=r"Root cause: attempt 0, rank 1 .*ValueError: rank 1 is broken") as info:
        sparkdl.TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(fails_on_rank_1)
    assert isinstance(info.value, sparkdl.RunFailedError)


def visible_gpus() -> list[str]:
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo")
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, os.environ["CUDA_VISIBLE_DEVICES"])
    dist.destroy_process_group()
    return seen


@pytest.fixture
@needs_session("local[2] with two driver GPUs")
def driver_with_gpus(spark_session, fake_gpus):  # type: ignore[no-untyped-def]
    """A session whose driver has two (fake) GPUs, 0 and 1; started before no_leaks looks."""
    return spark_session("local[2]", {"spark.driver.resource.gpu.amount": "2",
                                      "spark.driver.resource.gpu.discoveryScript": fake_gpus(2)})


def test_torch_distributor_local_mode_takes_the_drivers_gpus_like_sparks(driver_with_gpus, no_leaks) -> None:  # type: ignore[no-untyped-def]
    # Last in this module: it switches sessions.
    from pyspark.ml.torch.distributor import TorchDistributor as SparkTD

    # Spark's class lowers num_processes to the driver's GPUs at construction; so does ours.
    assert sparkdl.TorchDistributor(num_processes=3).num_processes == SparkTD(num_processes=3).num_processes == 2
    assert sorted(sparkdl.TorchDistributor(num_processes=2).run(visible_gpus)) == ["0", "1"]
