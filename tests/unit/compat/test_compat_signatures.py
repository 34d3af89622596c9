"""The compatibility classes without a JVM: ``sparkdl.HorovodRunner`` has the signature and the
up-front checks of Databricks' HorovodRunner, and ``sparkdl.TorchDistributor`` the signatures of
Spark's TorchDistributor and its refusal of ``use_gpu`` without a session. Runs, and the checks
that read a session's confs, are in tests/integration/test_compat.py.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from resources.horovod_runner_train import hvd_train

import sparkdl


def test_horovod_runner_refuses_np_zero() -> None:
    with pytest.raises(sparkdl.ConfigError, match="np must be a non-zero integer"):
        sparkdl.HorovodRunner(np=0)


def test_horovod_runner_signature_and_checks_match_databricks() -> None:
    # Databricks' HorovodRunner(*, np, driver_log_verbosity="log_callback_only").run(main, **kwargs)
    init = inspect.signature(sparkdl.HorovodRunner).parameters
    assert init["np"].kind is inspect.Parameter.KEYWORD_ONLY
    assert init["driver_log_verbosity"].default == "log_callback_only"
    run = list(inspect.signature(sparkdl.HorovodRunner.run).parameters.values())
    assert [(p.name, p.kind) for p in run] == [
        ("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), ("main", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("kwargs", inspect.Parameter.VAR_KEYWORD)]
    with pytest.raises(TypeError):
        sparkdl.HorovodRunner(2)  # type: ignore[misc]
    # Databricks' raises ValueError for an unknown verbosity, and TypeError, before anything
    # starts, for keyword arguments main cannot take.
    with pytest.raises(ValueError, match="driver_log_verbosity"):
        sparkdl.HorovodRunner(np=2, driver_log_verbosity="none")
    with pytest.raises(TypeError, match="learning_rate"):
        sparkdl.HorovodRunner(np=-2).run(hvd_train, learning_rate=0.1)


def test_torch_distributor_signatures_match_sparks() -> None:
    from pyspark.ml.torch.distributor import TorchDistributor as SparkTD

    def shape(fn: Any, count: int | None = None) -> list[tuple[str, Any, Any]]:
        params = list(inspect.signature(fn).parameters.values())[:count]
        return [(p.name, p.kind, p.default) for p in params]

    assert shape(sparkdl.TorchDistributor.run) == shape(SparkTD.run)
    # Spark's fifth parameter, _ssl_conf, is private.
    assert shape(sparkdl.TorchDistributor.__init__, 4) == shape(SparkTD.__init__, 4)


def test_torch_distributor_use_gpu_without_a_session(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from pyspark.sql import SparkSession

    # Spark's class needs a session to read the GPU confs from (a RuntimeError without one).
    monkeypatch.setattr(SparkSession, "getActiveSession", classmethod(lambda cls: None))
    with pytest.raises(RuntimeError, match=r"active SparkSession.*use_gpu=False"):
        sparkdl.TorchDistributor(num_processes=2, local_mode=False)
