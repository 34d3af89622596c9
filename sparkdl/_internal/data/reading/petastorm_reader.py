"""``reader="petastorm"``: batches from Petastorm's ``make_batch_reader``, in the loader's format.

Petastorm reads rank ``r``'s shard with ``cur_shard=r, shard_count=world_size``; its chunks are
converted to Arrow (so both readers share the conversions) and cut to the planned batch sizes,
and every rank stops after the planned number of steps, reading its shard again from its start
if it runs short. Petastorm imports only on the classic stack.

Array columns: Petastorm stacks the lists of each row group into one matrix, so it reads a list
column whose rows have one length per row group, which is what Spark writes for ``array<float>``
features and what Petastorm's own Spark converter caches hold. A plain Parquet list column's
length is not known up front; it is learnt from each chunk as it arrives, exactly as the Arrow
reader does (rows of one length give ``[batch, length]``, mixed lengths are padded, with
``<name>_lengths`` either way). A row group whose rows have unequal lengths stops the loader
with a :class:`~sparkdl.DatasetError` that names the column and the row group.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from sparkdl._internal.common.errors import ConfigError, DatasetError
from sparkdl._internal.data.format.arrow import list_lengths
from sparkdl._internal.data.format.manifest import ARRAY, BINARY, STRING, ColumnSpec
from sparkdl._internal.data.reading.files import ParquetFiles, RowGroupReader
from sparkdl._internal.data.reading.plan import EpochPlan
from sparkdl._internal.data.reading.read import Batch, BatchMaker, WindowBuilder
from sparkdl._internal.fs.storage import redact

_CLASSIC_STACK = "pyspark 3.5, pyarrow 14.0.2, numpy 1.26 and petastorm 0.12.1"


def check_petastorm(plan: EpochPlan, columns: Sequence[ColumnSpec], *, lengths_known: bool) -> None:
    """Fails now, not in the first step, when Petastorm cannot read this plan's columns or shards.

    ``lengths_known``: the manifest was written by ``write_dataset``, which records the length
    of every array column whose rows all have one; its other array columns are ragged. Without
    such a manifest an array column's lengths are unknown and are checked as batches arrive.

    Raises:
        ConfigError: Petastorm does not import here, a column is known to be a variable-length
            array, or the dataset has fewer row groups than ranks.
    """
    _petastorm_make_batch_reader()
    ragged = [c.name for c in columns if c.kind == ARRAY and c.length is None] if lengths_known else []
    if ragged:
        raise ConfigError(
            f"reader='petastorm' cannot read the variable-length array column(s) {ragged}: "
            "Petastorm's make_batch_reader needs the lists of each row group to have one length. "
            "Use reader='arrow', or leave them out with columns=[...]"
        )
    if len(plan.rg_rows) < plan.world_size:
        raise ConfigError(
            f"reader='petastorm' shards by row groups and the dataset has {len(plan.rg_rows)} "
            f"for world_size={plan.world_size}; write it with more row groups (smaller "
            "row_group_bytes or more num_files) or use reader='arrow'"
        )


def petastorm_batches(
    files: ParquetFiles, plan: EpochPlan, make: BatchMaker, workers: int, epoch: int, start_step: int
) -> Iterator[Batch]:
    """This rank's batches of ``epoch`` from step ``start_step`` on, read by Petastorm's
    ``make_batch_reader`` with ``workers`` threads.

    Raises:
        DatasetError: a row group holds an array column whose rows have unequal lengths.
    """
    columns = make.columns
    url = files.url
    make_batch_reader = _petastorm_make_batch_reader()
    kwargs: dict[str, Any] = {
        "schema_fields": [c.name for c in columns],
        "reader_pool_type": "thread",
        "workers_count": workers,
        "num_epochs": None,  # a short shard is read again; the loader stops at len(loader)
        "cur_shard": plan.rank,
        "shard_count": plan.world_size,
        "shuffle_row_groups": plan.shuffle,
    }
    accepted = inspect.signature(make_batch_reader).parameters
    optional = {"seed": plan.seed * 1_000_003 + epoch, "shard_seed": plan.seed, "shuffle_rows": plan.shuffle}
    kwargs.update({k: v for k, v in optional.items() if k in accepted})
    sizes = [plan.batch_size] * (plan.steps - 1) + [plan.per_rank - (plan.steps - 1) * plan.batch_size]
    with make_batch_reader(url, **kwargs) as reader:
        missing = [c.name for c in columns if c.name not in reader.schema.fields]
        if missing:
            raise ConfigError(
                f"Petastorm's make_batch_reader skips the column(s) {missing} of "
                f"{redact(url)} (it reads numbers, strings, binary and lists written as "
                "Parquet LIST, not Arrow fixed-size lists); use reader='arrow', or leave them "
                "out with columns=[...]"
            )
        chunks = (
            {c.name: _from_petastorm(c, np.asarray(getattr(raw, c.name))) for c in columns}
            for raw in _unequal_lengths_named(reader, files, plan, columns)
        )
        for step, data in enumerate(_rebatch(chunks, sizes)):
            if step >= start_step:
                builder = WindowBuilder(columns, sizes[step], f"in {redact(url)} (petastorm)")
                builder.add(data, sizes[step])
                yield make(builder.finish(), slice(0, sizes[step]), epoch)


def _petastorm_make_batch_reader() -> Callable[..., Any]:
    try:
        from petastorm import make_batch_reader
    except Exception as exc:  # ImportError, or AttributeError from a pyarrow it does not know
        raise ConfigError(
            f"reader='petastorm' needs Petastorm, which cannot be imported here "
            f"({type(exc).__name__}: {exc}; installed pyarrow {pa.__version__}). Petastorm runs only "
            f"on the classic stack: {_CLASSIC_STACK}. Use reader='arrow' on this stack"
        ) from exc
    return make_batch_reader


def _unequal_lengths_named(
    reader: Iterator[Any], files: ParquetFiles, plan: EpochPlan, columns: Sequence[ColumnSpec]
) -> Iterator[Any]:
    """Petastorm's batches; its error for a row group of unequal list lengths, which names
    neither the row group nor the file, becomes a DatasetError that names both."""
    while True:
        try:
            raw = next(reader)
        except StopIteration:
            return
        except RuntimeError as exc:
            if "expected to be the same length" not in str(exc):
                raise
            arrays = [c for c in columns if c.kind == ARRAY and f"'{c.name}'" in str(exc)]
            raise _unequal_lengths(files, plan, arrays or [c for c in columns if c.kind == ARRAY]) from None
        yield raw


def _unequal_lengths(files: ParquetFiles, plan: EpochPlan, arrays: Sequence[ColumnSpec]) -> DatasetError:
    """The error for a row group whose rows of an array column have unequal lengths, naming the
    column, the row group and its file: the first such row group in file order, found by
    reading that column alone (this runs once, on the way to the error)."""
    fix = (
        "Petastorm's reader stacks the lists of each row group into one matrix, so every row of "
        "a row group must have the same length. Use reader='arrow' (it pads, and gives "
        "'<name>_lengths'), or leave the column out with columns=[...]"
    )
    for c in arrays:
        reader = RowGroupReader(files, plan.rg_file, plan.rg_index, plan.rg_rows, [c])
        for g in range(len(plan.rg_rows)):
            column = reader.row_group(g).column(c.name)
            for chunk in column.chunks:
                lengths = list_lengths(chunk)
                if len(lengths) and lengths.min() != lengths.max():
                    return DatasetError(
                        f"column {c.name!r} has rows of {int(lengths.min())} to {int(lengths.max())} "
                        f"elements in row group {int(plan.rg_index[g])} of {reader.where()}; {fix}"
                    )
    names = [c.name for c in arrays]
    return DatasetError(
        f"an array column of {names} has rows of unequal lengths in a row group of {redact(files.url)}; {fix}"
    )


def _from_petastorm(c: ColumnSpec, values: np.ndarray) -> pa.Array:
    """One column of a Petastorm batch (numpy) as Arrow, so both readers share the conversions."""
    if c.kind == ARRAY:
        element = pa.from_numpy_dtype(np.dtype(c.dtype))
        if values.dtype != object and values.ndim == 2:
            flat = pa.array(np.ascontiguousarray(values).reshape(-1), type=element)
            if c.length is None:
                # A length learnt from this chunk: a plain list, like the Arrow reader's chunks,
                # so that chunks of two lengths still join (and are padded) in one batch.
                n, length = values.shape
                offsets = pa.array(np.arange(0, (n + 1) * length, length, dtype=np.int32))
                return pa.ListArray.from_arrays(offsets, flat)
            return pa.FixedSizeListArray.from_arrays(flat, values.shape[1])
        return pa.array([None if v is None else np.asarray(v) for v in values], type=pa.list_(element))
    if c.kind in (BINARY, STRING):
        return pa.array(list(values), type=pa.binary() if c.kind == BINARY else pa.string())
    return pa.array(values)


def _rebatch(chunks: Iterator[dict[str, pa.Array]], sizes: Sequence[int]) -> Iterator[dict[str, list[pa.Array]]]:
    """Cuts a stream of column chunks into batches of exactly ``sizes[0], sizes[1], ...`` rows."""
    held: list[dict[str, pa.Array]] = []
    have = 0
    for size in sizes:
        while have < size:
            chunk = next(chunks, None)
            if chunk is None:
                raise DatasetError(
                    f"Petastorm's reader ended after {have} rows while a batch of {size} was due; "
                    "the dataset changed, or the shard is empty"
                )
            n = len(next(iter(chunk.values())))
            if n:
                held.append(chunk)
                have += n
        out: dict[str, list[pa.Array]] = {k: [] for k in held[0]}
        need = size
        while need:
            chunk = held[0]
            n = len(next(iter(chunk.values())))
            take = min(n, need)
            for k, v in chunk.items():
                out[k].append(v.slice(0, take))
            if take == n:
                held.pop(0)
            else:
                held[0] = {k: v.slice(take) for k, v in chunk.items()}
            need -= take
            have -= take
        yield out
