"""TorchEstimator's params without a JVM: a bad validation fraction, loss or backend, and a fit
without a model, are refused at once, by the constructor or before any Spark work. Bad input
data, refused before training, and everything that trains or scores, are in
tests/integration/test_ml.py and tests/integration/test_ml_images.py.
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


def test_image_decoders_evaluate_without_random_draws() -> None:
    from sparkdl import ImageDecoder
    from sparkdl._internal.ml.decoding import eval_decoder

    train = ImageDecoder(32, scale=(0.5, 1.0))
    # Unset, the evaluation decoder is the training one with the center crop, same size and fraction.
    assert eval_decoder(train, None) == ImageDecoder(32, scale=(0.5, 1.0), crop="center")
    assert eval_decoder(ImageDecoder(32, crop="full"), None) == ImageDecoder(32, crop="full")
    explicit = ImageDecoder(32, crop="full")
    assert eval_decoder(train, explicit) is explicit
    # A plain function has no deterministic form to derive: it is used as it is.
    assert eval_decoder(len, None) is len and eval_decoder(None, None) is None
    est = TorchEstimator(featuresDecoder=train)
    assert est.getFeaturesDecoder() is train and est.getEvalDecoder() is None
    with pytest.raises(ConfigError, match="evalDecoder must be a per-sample function"):
        est.setEvalDecoder("center")
