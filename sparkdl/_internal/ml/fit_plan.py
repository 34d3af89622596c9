"""What a fit is made of: the task and loss vocabulary, and the frozen plan every rank gets.

This is the leaf of ``sparkdl.ml``: params, column checks, the driver's probe, the rank's loop and
scoring all speak these names, and it imports nothing from the rest of the package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CLASSIFICATION = "classification"
REGRESSION = "regression"
TASKS = (CLASSIFICATION, REGRESSION)

# Named losses: the task each implies and how labels must look.
CLASS_LOSSES = ("cross_entropy", "nll")  # integer class indices in [0, C); output (N, C)
BINARY_LOSSES = ("bce_with_logits",)  # labels in [0, 1]; output (N,) or (N, 1), a logit
REGRESSION_LOSSES = ("mse", "l1", "smooth_l1", "huber")  # output shaped like the label
LOSSES = CLASS_LOSSES + BINARY_LOSSES + REGRESSION_LOSSES
OPTIMIZERS = ("adam", "adamw", "sgd")


@dataclass(frozen=True)
class FitPlan:
    """Everything a rank needs to train: plain values and the user's callables, never a session.

    It is built on the driver from the estimator's params and shipped to every rank, so it must
    stay small and picklable.
    """

    model: Any
    optimizer: Any
    learning_rate: float
    loss: Any
    task: str
    features_col: str
    label_col: str
    batch_size: int
    epochs: int
    num_workers: int
    seed: int
    checkpoint_every: int
    validation_fraction: float
    # Per-sample functions that decode the features (images): in training, and in validation and
    # the fitted model's scoring. None: the features are numbers.
    decoder: Any = None
    eval_decoder: Any = None

    @property
    def loss_name(self) -> str:
        """The loss as messages name it: its name, or the callable's ``__name__``."""
        return self.loss if isinstance(self.loss, str) else getattr(self.loss, "__name__", "a callable")

    @property
    def class_index_labels(self) -> bool:
        """Whether labels are class indices (int64): classification with any loss but a binary one."""
        return self.task == CLASSIFICATION and self.loss not in BINARY_LOSSES
