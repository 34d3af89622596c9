"""Checkpoints of a Keras model (``backend="tensorflow"``) in the run's checkpoint store, so that
a rerun of the gang goes on from the last one.

The checkpoint is sparkdl's own (:mod:`sparkdl._internal.ckpt.store`): one file, written by rank 0 and
moved into place, so a crash in the middle leaves the previous one the latest. It holds the
epoch, the model's weights and its optimizer's variables, as tensors, and loads back with
``weights_only=True``. Under ``MultiWorkerMirroredStrategy`` every worker holds the same
weights; every worker calls the callback and rank 0 alone writes.

Example::

    def train(ds):
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        with strategy.scope():
            model = make_model()
            model.compile(optimizer="adam", loss="mse")
            start = sparkdl.keras_resume(model)            # 0, or the epoch after the last checkpoint
        data = ds.tf_dataset(64, seed=7, epoch=start).map(lambda b: (b["features"], b["label"]))
        model.fit(data, epochs=10, initial_epoch=start, callbacks=[sparkdl.keras_checkpoint()])

Passing ``epoch=start`` to the loader makes the resumed epochs read the rows in the order an
uninterrupted run would have (the shuffle depends on seed and epoch); resume is at epoch
boundaries: the steps of an epoch that failed midway run again.
"""

from __future__ import annotations

from typing import Any

from sparkdl._internal.common.validate import int_at_least

_WEIGHTS = "keras_weights"
_OPTIMIZER = "keras_optimizer"


def keras_resume(model: Any) -> int:
    """Loads the run's latest Keras checkpoint into ``model`` and its compiled optimizer; returns
    the epoch to go on from (``fit(initial_epoch=...)``), 0 when there is none.

    Call it after ``compile``, inside the strategy's scope. The optimizer's state is restored
    when it has the variables that were saved (the same optimizer); otherwise it starts afresh
    and a line on stderr says so.
    """
    import sys

    from sparkdl._internal.rank.context import context

    state = context().load_checkpoint()
    if not isinstance(state, dict) or _WEIGHTS not in state:
        return 0
    model.set_weights([t.numpy() for t in state[_WEIGHTS]])
    saved = state.get(_OPTIMIZER) or []
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and saved:
        if hasattr(optimizer, "build"):
            optimizer.build(model.trainable_variables)
        variables = _variables(optimizer)
        if [tuple(v.shape) for v in variables] == [tuple(t.shape) for t in saved]:
            for variable, value in zip(variables, saved, strict=True):
                variable.assign(value.numpy())
        else:
            print("sparkdl: the optimizer's state in the checkpoint does not match this optimizer's "
                  "variables; it starts afresh", file=sys.stderr)
    return int(state["epoch"]) + 1


def keras_checkpoint(every_epochs: int = 1) -> Any:
    """A Keras callback that saves the model (weights, optimizer, epoch) every ``every_epochs``
    epochs into the run's checkpoint store; :func:`keras_resume` reads it back."""
    int_at_least("every_epochs", every_epochs, 1)
    import numpy as np
    import tensorflow as tf
    import torch

    from sparkdl._internal.rank.context import context

    class SparkdlCheckpoint(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if (epoch + 1) % every_epochs:
                return
            optimizer = getattr(self.model, "optimizer", None)
            state = {
                "epoch": epoch,
                _WEIGHTS: [torch.from_numpy(np.array(w)) for w in self.model.get_weights()],
                _OPTIMIZER: [torch.from_numpy(np.array(v.numpy())) for v in _variables(optimizer)]
                if optimizer is not None else [],
            }
            context().save_checkpoint(state)

    return SparkdlCheckpoint()


def _variables(optimizer: Any) -> list[Any]:
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)
