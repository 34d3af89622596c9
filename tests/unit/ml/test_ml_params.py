"""TorchEstimator's params without a JVM: a bad validation fraction, loss or backend, and a fit
without a model, are refused at once, by the constructor or before any Spark work. Bad input
data, refused before training, and everything that trains or scores, are in
tests/integration/test_ml.py.
"""

from __future__ import annotations

import pytest

from sparkdl import ConfigError, TorchEstimator


def test_bad_params_are_refused_at_once() -> None:
    with pytest.raises(ConfigError, match="validationFraction"):
        TorchEstimator(validationFraction=1.0)
    with pytest.raises(ConfigError, match="loss='hinge'"):
        TorchEstimator(loss="hinge")
    with pytest.raises(ConfigError, match="backend='horovod'"):
        TorchEstimator(backend="horovod")
    with pytest.raises(ConfigError, match="needs a model"):
        TorchEstimator().fit(None)  # type: ignore[arg-type]
