"""Petastorm's ``TransformSpec``, run by sparkdl's decode workers one row at a time.

Petastorm's converter calls a ``TransformSpec``'s ``func`` on each batch of rows, as a pandas
DataFrame, in its reader's worker pool; the image tutorials decode and augment photos there
(``edit_fields=[("features", np.float32, (3, 224, 224), False)]``). sparkdl calls the same
``func`` on the loader's decode workers (processes by default, since such functions are pure
Python and draw from the global generators), beside the reader:

- **The random draws are the row's.** A ``func`` that draws from Python's ``random``, numpy's
  global generator or torch's is called on one row at a time, each seeded from the row's own
  generator (``[seed, epoch, row]``), so a row gets the same augmentation with any number of
  workers, on any rank, after a resume and on every rerun; Petastorm's draws depend on which
  worker took which batch. One that draws nothing is called on a decode chunk's rows at once
  (a DataFrame a row cost more than the work of a small image), which gives each row the very
  output a call of its own would (for a ``func`` that treats rows alone, as Petastorm's batches
  of any size assume); whether it draws is seen by the generators' states around the
  call, chunk by chunk, and the first chunk it draws in is done again row by row.
- **Declared fields are checked.** A field of ``edit_fields`` whose value ``func`` returned with
  another dtype or shape is a :class:`~sparkdl.ConfigError` naming the field, the declared and
  the returned (in Petastorm, a failure deep in its workers). ``None`` in a declared shape matches
  any length. A row on which ``func`` raises is a bad sample (``on_bad_sample``).
- **The output is Petastorm's:** the fields ``func`` returned, less ``removed_fields``, or
  ``selected_fields`` in their order; numbers of a batch as 1-D tensors.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.common.validate import invalid

# A field as Petastorm's edit_fields give it: (name, numpy dtype, shape, nullable).
Field = tuple[str, Any, tuple[Any, ...], bool]


@dataclass(frozen=True)
class TransformSpec:
    """Petastorm's ``TransformSpec`` (0.12, 0.13): what the converter's loaders do to each row.

    Args:
        func: takes a pandas DataFrame of rows and returns one (the same rows, fields changed or
            added); None leaves the rows as they are.
        edit_fields: the fields ``func`` adds or changes, each ``(name, numpy dtype, shape,
            nullable)`` (or a Petastorm ``UnischemaField``); their values are checked.
        removed_fields: names of fields to leave out of the output.
        selected_fields: names of the fields of the output, in this order (instead of
            ``removed_fields``).

    Example::

        def decode(pdf):
            pdf["features"] = pdf["content"].map(lambda b: np.asarray(Image.open(io.BytesIO(b)), np.float32))
            return pdf[["features", "label"]]

        spec = TransformSpec(decode, edit_fields=[("features", np.float32, (32, 32, 3), False)],
                             selected_fields=["features", "label"])
        with converter.make_torch_dataloader(transform_spec=spec) as loader: ...
    """

    func: Callable[[Any], Any] | None = None
    edit_fields: Sequence[Any] | None = None
    removed_fields: Sequence[str] | None = None
    selected_fields: Sequence[str] | None = None

    def __post_init__(self) -> None:
        if self.func is not None and not callable(self.func):
            raise ConfigError(f"TransformSpec(func=...) must be callable (a pandas DataFrame in, one out); "
                              f"got {type(self.func).__name__}")
        if self.removed_fields and self.selected_fields:
            raise ConfigError("TransformSpec: give removed_fields or selected_fields, not both")
        fields(self)  # checked now, not in a worker


def fields(spec: Any) -> tuple[Field, ...]:
    """``spec``'s edit_fields as ``(name, dtype, shape, nullable)``; a ConfigError names a bad one."""
    out = []
    for f in getattr(spec, "edit_fields", None) or ():
        if hasattr(f, "numpy_dtype"):  # Petastorm's UnischemaField
            name, dtype, shape, nullable = f.name, f.numpy_dtype, f.shape, f.nullable
        else:
            try:
                name, dtype, shape, nullable = f
            except (TypeError, ValueError):
                raise ConfigError(f"TransformSpec edit_fields: {f!r} is not (name, numpy dtype, shape, nullable)") from None
        try:
            dtype = np.dtype(dtype)
        except TypeError:
            raise ConfigError(f"TransformSpec edit_fields: field {name!r} has dtype {dtype!r}, not a numpy dtype") from None
        out.append((str(name), dtype, tuple(shape or ()), bool(nullable)))
    return tuple(out)


def from_petastorm(spec: Any) -> TransformSpec:
    """A ``TransformSpec`` of sparkdl's, or of Petastorm's (or anything with its four attributes)."""
    if isinstance(spec, TransformSpec):
        return spec
    if not all(hasattr(spec, a) for a in ("func", "edit_fields", "removed_fields", "selected_fields")):
        raise invalid("transform_spec", spec, "a TransformSpec (sparkdl.compat.petastorm's or petastorm's)")
    return TransformSpec(spec.func, list(spec.edit_fields or ()), list(spec.removed_fields or ()) or None,
                         list(spec.selected_fields) if spec.selected_fields is not None else None)


class RowTransform:
    """The decode function of ``decode={ROW: ...}`` for a spec: one row in, its output fields out. Picklable."""

    def __init__(self, spec: TransformSpec) -> None:
        self.spec = spec
        self.fields = fields(spec)
        self._draws = False  # seen drawing from a global generator: rows one by one from then on

    def __call__(self, row: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        return self._one(row, int(rng.integers(2**32)))

    def run_chunk(self, rows: list[dict[str, Any]], rngs: list[np.random.Generator]) -> list[Any]:
        """The outputs of consecutive rows (an exception for a row ``func`` failed on), from one
        call of ``func`` on them all while it draws nothing from the global generators: the
        per-row results exactly, without a DataFrame a row. The first chunk on which it draws
        is done again row by row, and so is every chunk after it in this worker."""
        import pandas as pd

        seeds = [int(rng.integers(2**32)) for rng in rngs]
        if self.spec.func is not None and not self._draws and len(rows) > 1:
            _seed_globals(_PROBE_SEED)
            before = _generators()
            try:
                out = self.spec.func(_frame(pd, rows))
            except Exception:
                out = None  # the row it failed on is found, and named, row by row
            if _generators() != before:
                self._draws = True
            elif out is not None:
                return self._outputs(pd, out, len(rows))
        return [outcome(self._one, row, seed) for row, seed in zip(rows, seeds, strict=True)]

    def _one(self, row: dict[str, Any], seed: int) -> dict[str, Any]:
        import pandas as pd

        _seed_globals(seed)
        return self._outputs(pd, self.spec.func(_frame(pd, [row])) if self.spec.func is not None else _frame(pd, [row]), 1)[0]

    def _outputs(self, pd: Any, out: Any, n: int) -> list[dict[str, Any]]:
        if not isinstance(out, pd.DataFrame) or len(out) != n:
            raise ConfigError(
                f"TransformSpec(func={getattr(self.spec.func, '__name__', self.spec.func)!r}) must return a pandas "
                f"DataFrame of the rows it was given; it returned {type(out).__name__}"
                + (f" of {len(out)} rows for {n}" if isinstance(out, pd.DataFrame) else "")
            )
        names = list(self.spec.selected_fields) if self.spec.selected_fields is not None else [
            c for c in out.columns if c not in set(self.spec.removed_fields or ())]
        missing = [n for n in names if n not in out.columns]
        if missing:
            raise ConfigError(f"TransformSpec selected_fields names {missing}, which func did not return; it "
                              f"returned {list(out.columns)}")
        columns = {name: out[name].to_list() for name in names}
        results = [{name: values[i] for name, values in columns.items()} for i in range(n)]
        for name, dtype, shape, nullable in self.fields:
            if name in columns:
                for result in results:
                    result[name] = _checked(name, result[name], dtype, shape, nullable)
        return results


def outcome(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or the exception it raised (one bad sample must not hide the others of its
    chunk); a ConfigError is raised: the function's settings are wrong (a declared field it did
    not return), so no sample is."""
    try:
        return fn(*args)
    except ConfigError:
        raise
    except Exception as exc:
        return exc


def _checked(name: str, value: Any, dtype: np.dtype, shape: tuple[Any, ...], nullable: bool) -> Any:
    if value is None:
        if nullable:
            return value
        raise ConfigError(f"TransformSpec field {name!r} is declared not nullable, and func returned None for it")
    if dtype.kind in "OSU":
        return value
    array = np.asarray(value)
    if array.dtype != dtype:
        raise ConfigError(f"TransformSpec field {name!r} is declared {dtype} {shape}; func returned {array.dtype} "
                          f"{array.shape}: cast it in func (e.g. .astype(np.{dtype.name})) or declare what it returns")
    if len(array.shape) != len(shape) or any(d is not None and d != a for d, a in zip(shape, array.shape, strict=True)):
        raise ConfigError(f"TransformSpec field {name!r} is declared of shape {shape}; func returned shape "
                          f"{array.shape} ({dtype}): resize it in func, or declare the shape it returns "
                          "(None for a length that varies)")
    return array


def _frame(pd: Any, rows: list[dict[str, Any]]) -> Any:
    """A DataFrame of ``rows``, built for speed: one is made for every row a function that draws
    is given (190 us with pandas' dict of lists, 37 us from arrays without pandas' checks)."""
    names = list(rows[0])
    arrays = [_column([row[name] for row in rows]) for name in names]
    try:
        return pd.DataFrame._from_arrays(arrays, columns=pd.Index(names), index=pd.RangeIndex(len(rows)),
                                         verify_integrity=False)
    except (AttributeError, TypeError):  # a pandas without it
        return pd.DataFrame(dict(zip(names, arrays, strict=True)), copy=False)


def _column(values: list[Any]) -> np.ndarray:
    if all(isinstance(v, (int, float, bool, np.number, np.bool_)) for v in values):
        return np.asarray(values)
    if len(values) == 1 and isinstance(values[0], np.ndarray) and values[0].ndim == 0:
        return values[0].reshape(1)
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


# The seed the globals get before a chunk's call: whether the call moved them is all that counts.
_PROBE_SEED = 0x5EED


def _generators() -> tuple[Any, ...]:
    """Where the global generators stand: Python's, numpy's and torch's CPU one."""
    import sys

    state = np.random.get_state(legacy=False)
    torch = sys.modules.get("torch")
    return (random.getstate(), int(state["state"]["pos"]), bytes(state["state"]["key"].tobytes()),
            state["has_gauss"], None if torch is None else bytes(torch.default_generator.get_state().numpy().tobytes()))


def _seed_globals(seed: int) -> None:
    """The generators a pandas function draws from unasked: Python's, numpy's and torch's (its
    CPU generator: ``torch.manual_seed`` also seeds every GPU's, 200 us a row)."""
    import sys

    random.seed(seed)
    np.random.seed(seed)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.manual_seed(seed)


__all__ = ["RowTransform", "TransformSpec", "fields", "from_petastorm", "outcome"]
