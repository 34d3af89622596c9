"""The model tried on the driver before training: a few real rows through the model, the loss and
the optimizer, so a wrong input size, output shape, class count or factory fails ``fit`` at once
with a message naming the columns and the loss, instead of failing every rank mid-run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.ml.columns import Facts, features_expr, label_expr
from sparkdl._internal.ml.decoding import decode_values
from sparkdl._internal.ml.fit_plan import (
    BINARY_LOSSES,
    CLASS_LOSSES,
    CLASSIFICATION,
    REGRESSION,
    FitPlan,
)
from sparkdl._internal.ml.training import (
    aligned,
    input_dtype,
    instantiate,
    label_tensor,
    loss_function,
    make_optimizer,
    model_input,
)

if TYPE_CHECKING:
    import numpy as np
    import torch
    from pyspark.sql import DataFrame

__all__ = ["probe"]

# Rows of model input probed on the driver before training.
_PROBE_ROWS = 4


def probe(df: DataFrame, plan: FitPlan, facts: Facts) -> tuple[torch.nn.Module, int]:
    """Runs the model on a few real rows on the driver; checks its output against labels and loss.

    Returns the driver's instance of the model (the trained weights are loaded into it later)
    and the number of outputs per row.
    """
    import torch
    from pyspark.sql import functions as F

    decoded = plan.decoder is not None
    x_expr = F.col(plan.features_col) if decoded else features_expr(df, plan.features_col)
    rows = df.select(x_expr.alias("x"), label_expr(df, plan).alias("y")).limit(_PROBE_ROWS).collect()
    module = instantiate(plan.model, plan.seed)
    dtype = input_dtype(module)
    if decoded:
        x = model_input(torch.from_numpy(_decoded([r["x"] for r in rows], plan)), "cpu", dtype)
    else:
        x = torch.tensor([r["x"] for r in rows], dtype=dtype)
    y = label_tensor([r["y"] for r in rows], plan, dtype)
    fc, lc = plan.features_col, plan.label_col
    was_training = module.training
    module.eval()  # batch norm and dropout behave on a handful of rows
    try:
        with torch.no_grad():
            out = module(x)
    except Exception as exc:
        raise ConfigError(
            f"the model failed on {len(rows)} rows of featuresCol={fc!r} (input shape {tuple(x.shape)}"
            + ("" if decoded else f", {facts.num_features} features per row")
            + f"): {type(exc).__name__}: {exc}. Check the model's input size"
        ) from exc
    finally:
        module.train(was_training)
    if not isinstance(out, torch.Tensor):
        raise ConfigError(f"the model returned {type(out).__name__}; it must return one tensor")
    shape = tuple(out.shape)
    k = len(rows)
    width = 1 if len(shape) == 1 else (shape[1] if len(shape) == 2 else -1)
    label_desc = "one number per row" if facts.label_length is None else f"arrays of length {facts.label_length}"
    expected: str | None = None
    if width < 1 or shape[0] != k:
        expected = f"({k},) or ({k}, m): one value or one vector per row"
    elif plan.loss in BINARY_LOSSES:
        if width != 1:
            expected = f"({k},) or ({k}, 1): one logit per row"
    elif plan.loss in CLASS_LOSSES:
        if len(shape) != 2 or width < 2:
            expected = f"({k}, C) with C >= 2 class scores per row"
    elif (
        plan.task == REGRESSION
        and isinstance(plan.loss, str)
        and (width != (facts.label_length or 1) or (facts.label_length is not None and len(shape) != 2))
    ):
        expected = (
            f"({k},) or ({k}, 1): one value per row, like the label"
            if facts.label_length is None
            else f"({k}, {facts.label_length}): one vector per row, like the label"
        )
    if expected is not None:
        raise ConfigError(
            f"the model's output for {k} rows of featuresCol={fc!r} has shape {shape}, which does not match "
            f"labelCol={lc!r} ({label_desc}) for loss {plan.loss_name!r}: expected {expected}"
        )
    if plan.task == CLASSIFICATION and facts.label_max is not None:
        classes = max(width, 2)  # one logit scores two classes
        if facts.label_max >= classes:
            raise ConfigError(
                f"labelCol={lc!r} holds class indices up to {facts.label_max:g}, but the model outputs {width} "
                f"score(s) per row, so loss {plan.loss_name!r} accepts class indices 0..{classes - 1}. Give the "
                f"model's last layer {int(facts.label_max) + 1} outputs, or re-index the labels (StringIndexer)"
            )
    loss_fn = loss_function(plan.loss)
    try:
        value = loss_fn(*aligned(out, y, plan))
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise TypeError(f"the loss returned {type(value).__name__} {getattr(value, 'shape', '')}, not a scalar tensor")
    except Exception as exc:
        raise ConfigError(
            f"loss {plan.loss_name!r} failed on the model's output (shape {shape}) and labelCol={lc!r} "
            f"(shape {tuple(y.shape)}): {type(exc).__name__}: {exc}"
        ) from exc
    _check_optimizer(plan, module)
    return module, width


def _decoded(values: list[Any], plan: FitPlan) -> np.ndarray:
    """The probe's rows decoded as training decodes them; the evaluation decoder must give the same shape."""
    x = decode_values(plan.decoder, values, plan.features_col)
    if plan.eval_decoder is not None and plan.eval_decoder is not plan.decoder:
        shape = decode_values(plan.eval_decoder, values[:1], plan.features_col, "evalDecoder").shape[1:]
        if shape != x.shape[1:]:
            raise ConfigError(
                f"evalDecoder gives arrays of shape {shape} and featuresDecoder {x.shape[1:]} for featuresCol="
                f"{plan.features_col!r}; the model takes one shape: give both decoders the same size"
            )
    return x


def _check_optimizer(plan: FitPlan, module: torch.nn.Module) -> None:
    import torch

    try:
        opt = make_optimizer(plan, module.parameters())
    except Exception as exc:
        raise ConfigError(f"the optimizer factory failed on the model's parameters: {type(exc).__name__}: {exc}") from exc
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(
            f"the optimizer factory returned {type(opt).__name__}; it must return a torch.optim.Optimizer, e.g. "
            "lambda params: torch.optim.Adam(params, lr=1e-3)"
        )
