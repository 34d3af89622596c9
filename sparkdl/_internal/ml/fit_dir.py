"""Where one :class:`~sparkdl.TorchEstimator` fit keeps its checkpoints under ``checkpointDir``.

A ``checkpointDir`` is set once on an estimator, and Spark ML copies the estimator for every fit
it makes: ``CrossValidator`` and ``TrainValidationSplit`` fit each parameter map on each fold,
several at once with ``parallelism``. Checkpoints written straight into the one directory would
make the second fit resume from the first one's state (another fold, another learning rate), and
two fits at once would be refused by the directory's lease. So each fit writes to a subdirectory
named by what it trains: the estimator's training parameters and the fit's data (the
DataFrame's plan, by Spark's ``semanticHash``). The same fit made again (a rerun of the job, or
more ``epochs``) finds its own subdirectory and resumes there.

What does not name a fit, since a resume may change it: ``epochs`` (more epochs continue), the
number of ranks, the GPUs, the run's bounds, how often it checkpoints, and how the model scores.
"""

from __future__ import annotations

import hashlib
import posixpath
from typing import Any

# The estimator's parameters that a fit may change and still resume its checkpoints.
RESUMABLE_WITH_OTHER = frozenset({
    "checkpointDir", "epochs", "numWorkers", "useGpu", "runConfig", "checkpointEvery",
    "inferenceBatchSize", "predictionCol",
})


def fit_dir(checkpoint_dir: str, estimator: Any, dataset: Any) -> str:
    """The subdirectory of ``checkpoint_dir`` for fitting ``estimator`` on ``dataset``."""
    return posixpath.join(checkpoint_dir.rstrip("/"), f"fit-{fit_key(estimator, dataset)}")


def fit_key(estimator: Any, dataset: Any) -> str:
    """16 hex digits naming what a fit trains: the same for a rerun of the same fit (or one with
    more epochs), different for another parameter map or other data."""
    digest = hashlib.sha256()
    for param, value in sorted(estimator.extractParamMap().items(), key=lambda item: item[0].name):
        if param.name in RESUMABLE_WITH_OTHER:
            continue
        digest.update(f"{param.name}\0".encode())
        digest.update(_value_bytes(value))
        digest.update(b"\0")
    try:
        data = f"plan {dataset.semanticHash()}"
    except Exception:  # a DataFrame that cannot say (a Connect server without it): params alone
        data = "plan unknown"
    digest.update(data.encode())
    return digest.hexdigest()[:16]


def _value_bytes(value: Any) -> bytes:
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value).encode()
    import cloudpickle

    try:  # a model, a factory, a loss: by what they are (code and weights), as they travel
        return bytes(cloudpickle.dumps(value, protocol=5))
    except Exception:
        return repr(value).encode()
