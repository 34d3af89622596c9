"""The DataFrame side of fit and transform: column type checks, the feature and label
expressions, and :func:`inspect_columns`, which checks the data's values in one aggregation job
before any training.

Every refusal is a ConfigError naming the column param (``featuresCol=...``, ``labelCol=...``),
what was found and what to do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.ml.decoding import holds_images
from sparkdl._internal.ml.fit_plan import BINARY_LOSSES, CLASSIFICATION, FitPlan

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame
    from pyspark.sql.types import DataType

__all__ = ["Facts", "check_features_type", "features_expr", "inspect_columns", "label_expr"]


@dataclass(frozen=True)
class Facts:
    """What the checks learned about the data and the model."""

    num_rows: int
    num_features: int | None  # None: decoded features (the probe finds their shape)
    label_length: int | None  # None: one number per row; L: an array or vector of length L
    label_max: float | None  # the largest label, for one number per row


def _numeric_types() -> tuple[type, ...]:
    from pyspark.sql import types as T

    return (T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.FloatType, T.DoubleType, T.DecimalType)


def _is_vector(t: DataType) -> bool:
    from pyspark.ml.linalg import VectorUDT
    from pyspark.mllib.linalg import VectorUDT as OldVectorUDT

    return isinstance(t, (VectorUDT, OldVectorUDT))


def _is_numeric_array(t: DataType) -> bool:
    from pyspark.sql import types as T

    return isinstance(t, T.ArrayType) and isinstance(t.elementType, (*_numeric_types(), T.BooleanType))


def _column_type(df: DataFrame, name: str, role: str) -> DataType:
    if name not in df.columns:
        raise ConfigError(
            f"{role}={name!r} is not a column of the DataFrame; its columns are {df.columns}. Set {role} "
            "to an existing column"
        )
    return df.schema[name].dataType


def check_features_type(df: DataFrame, col: str, decoded: bool = False) -> None:
    """ConfigError unless ``col`` exists and holds Spark ML vectors or arrays of numbers, or
    anything with a decoder (``decoded``) (no job)."""
    t = _column_type(df, col, "featuresCol")
    if decoded:
        return
    if holds_images(t):
        raise ConfigError(
            f"featuresCol={col!r} holds images ({t.simpleString()}); set featuresDecoder to a function that "
            "decodes them, such as sparkdl.ImageDecoder(224) (random crops and flips in training)"
        )
    if not (_is_vector(t) or _is_numeric_array(t)):
        raise ConfigError(
            f"featuresCol={col!r} has type {t.simpleString()}; expected a Spark ML vector (e.g. the "
            "output of VectorAssembler) or an array of numbers, every row of the same length"
        )


def features_expr(df: DataFrame, col: str) -> Column:
    """The features as ``array<float>``, whatever their column type (already checked)."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    if _is_vector(df.schema[col].dataType):
        return vector_to_array(F.col(col), "float32")
    return F.col(col).cast("array<float>")


def label_expr(df: DataFrame, plan: FitPlan) -> Column:
    """The label as training takes it: ``array<float>``, ``long`` class indices, or ``float``."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    t = df.schema[plan.label_col].dataType
    col = F.col(plan.label_col)
    if _is_vector(t):
        return vector_to_array(col, "float32")
    if _is_numeric_array(t):
        return col.cast("array<float>")
    if plan.class_index_labels:
        return col.cast("long")
    return col.cast("float")


def inspect_columns(df: DataFrame, plan: FitPlan) -> Facts:
    """Checks the columns' types (no job), then their values in one aggregation job."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    decoded = plan.decoder is not None
    check_features_type(df, plan.features_col, decoded)
    lt = _column_type(df, plan.label_col, "labelCol")
    label_is_array = _is_vector(lt) or _is_numeric_array(lt)
    scalar_ok = isinstance(lt, (*_numeric_types(), T.BooleanType))
    lc = plan.label_col
    if plan.task == CLASSIFICATION and not scalar_ok:
        raise ConfigError(
            f"labelCol={lc!r} has type {lt.simpleString()}; loss {plan.loss_name!r} ({plan.task}) expects one "
            "number per row: a class index 0..C-1 (index string labels with StringIndexer)"
        )
    if not (scalar_ok or label_is_array):
        raise ConfigError(
            f"labelCol={lc!r} has type {lt.simpleString()}; loss {plan.loss_name!r} expects a number per row, "
            "or an array or vector of numbers of one length"
        )

    aggs = [
        F.count(F.lit(1)).alias("n"),
        F.sum(F.when(F.col(plan.features_col).isNull(), 1).otherwise(0)).alias("x_null"),
        F.sum(F.when(F.col(lc).isNull(), 1).otherwise(0)).alias("y_null"),
    ]
    if not decoded:  # decoded features: the decoder checks each value, the probe their shape
        x = features_expr(df, plan.features_col)
        bad_value = F.exists(x, lambda v: v.isNull() | F.isnan(v))
        aggs += [
            F.min(F.when(x.isNotNull(), F.size(x))).alias("x_min"),
            F.max(F.when(x.isNotNull(), F.size(x))).alias("x_max"),
            F.sum(F.when(bad_value, 1).otherwise(0)).alias("x_bad"),
        ]
    if label_is_array:
        y = label_expr(df, plan)
        aggs += [
            F.min(F.when(y.isNotNull(), F.size(y))).alias("y_min"),
            F.max(F.when(y.isNotNull(), F.size(y))).alias("y_max"),
            F.sum(F.when(F.exists(y, lambda v: v.isNull() | F.isnan(v)), 1).otherwise(0)).alias("y_bad"),
        ]
    else:
        y = F.col(lc).cast("double")
        aggs += [
            F.min(y).alias("y_min"),
            F.max(y).alias("y_max"),
            F.sum(F.when(F.isnan(y), 1).otherwise(0)).alias("y_bad"),
            F.sum(F.when(y != F.floor(y), 1).otherwise(0)).alias("y_frac"),
        ]
    s = df.agg(*aggs).first()
    assert s is not None  # an aggregation without grouping always has one row
    n = int(s["n"])
    fc = plan.features_col
    if n == 0:
        raise ConfigError("the DataFrame passed to fit has no rows")
    if s["x_null"]:
        raise ConfigError(f"featuresCol={fc!r} is null in {s['x_null']} of {n} rows; drop or fill those rows first")
    if not decoded:
        _check_feature_values(s, fc, n)
    if s["y_null"] or s["y_bad"]:
        raise ConfigError(
            f"labelCol={lc!r} is null or NaN in {int(s['y_null'] or 0) + int(s['y_bad'] or 0)} of {n} rows; "
            "drop or fill those rows first"
        )
    label_length: int | None = None
    if label_is_array:
        if s["y_min"] != s["y_max"] or not s["y_min"]:
            raise ConfigError(
                f"labelCol={lc!r} holds arrays of lengths {s['y_min']} to {s['y_max']}; every row's label "
                "must have the same, non-zero length"
            )
        label_length = int(s["y_min"])
    elif plan.task == CLASSIFICATION:
        lo, hi = s["y_min"], s["y_max"]
        if plan.loss in BINARY_LOSSES:
            if lo < 0 or hi > 1:
                raise ConfigError(
                    f"labelCol={lc!r} holds values from {lo:g} to {hi:g}; loss 'bce_with_logits' expects labels "
                    "in [0, 1]"
                )
        elif s["y_frac"] or lo < 0:
            raise ConfigError(
                f"labelCol={lc!r} holds values from {lo:g} to {hi:g}"
                + (f", {s['y_frac']} of them not whole numbers" if s["y_frac"] else "")
                + f"; loss {plan.loss_name!r} expects class indices 0, 1, ..., C-1 (index labels with StringIndexer)"
            )
    n_val = n * plan.validation_fraction
    if plan.validation_fraction > 0 and (n_val < 1 or n - n_val < plan.num_workers):
        raise ConfigError(
            f"validationFraction={plan.validation_fraction:g} of {n} rows leaves too few rows to train on "
            f"{plan.num_workers} workers or to validate on; lower it, or use more data"
        )
    return Facts(
        num_rows=n,
        num_features=None if decoded else int(s["x_min"]),
        label_length=label_length,
        label_max=None if label_is_array else float(s["y_max"]),
    )


def _check_feature_values(s: Any, fc: str, n: int) -> None:
    if s["x_min"] != s["x_max"]:
        raise ConfigError(
            f"featuresCol={fc!r} holds rows of different lengths, from {s['x_min']} to {s['x_max']} values; "
            "every row must have the same number of features"
        )
    if s["x_min"] == 0:
        raise ConfigError(f"featuresCol={fc!r} holds empty vectors; every row needs at least one feature")
    if s["x_bad"]:
        raise ConfigError(f"featuresCol={fc!r} holds NaN or null values in {s['x_bad']} of {n} rows; clean them first")
