"""sparkdl's loader as a ``tf.data.Dataset``, for TensorFlow ranks (``backend="tensorflow"``).

The dataset is the rank's :class:`~sparkdl._internal.data.loader.Loader` seen through
``tf.data.Dataset.from_generator``: the same shard of rows, the same number of batches on every
rank (its cardinality is set, so Keras knows the steps of an epoch), the seeded shuffle, and each
pass over it the loader's next epoch. It is already this rank's share: TensorFlow's own
auto-sharding is turned off, or a ``MultiWorkerMirroredStrategy`` would shard it a second time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sparkdl._internal.common.errors import DatasetError

if TYPE_CHECKING:
    from sparkdl._internal.data.loader import Loader


def tf_dataset(loader: Loader) -> Any:
    """``loader`` as a ``tf.data.Dataset`` of ``{column: tf.Tensor}`` batches (strings and bytes as
    ``tf.string``). Its signature comes from the loader's first batch, which it keeps and yields
    first: building it starts the loader's first pass."""
    import tensorflow as tf

    it = iter(loader)
    try:
        first = next(it)
    except StopIteration:
        raise DatasetError(
            "this rank's share of the dataset has no batch (fewer rows than ranks, or drop_last=True with "
            "fewer rows than batch_size): lower batch_size or the number of ranks"
        ) from None
    signature = {name: _spec(tf, value) for name, value in first.items()}
    started: list[Iterator[Any]] = [it]

    def batches() -> Iterator[dict[str, Any]]:
        if started:  # the first pass, already under way
            source = started.pop()
            yield _arrays(first)
        else:
            source = iter(loader)
        for batch in source:
            yield _arrays(batch)

    dataset = tf.data.Dataset.from_generator(batches, output_signature=signature)
    dataset = dataset.apply(tf.data.experimental.assert_cardinality(len(loader)))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return dataset.with_options(options)


def _spec(tf: Any, value: Any) -> Any:
    if isinstance(value, list):
        return tf.TensorSpec(shape=(None,), dtype=tf.string)
    array = value.numpy()
    return tf.TensorSpec(shape=(None, *array.shape[1:]), dtype=tf.as_dtype(array.dtype))


def _arrays(batch: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    return {name: np.array(value, dtype=object) if isinstance(value, list) else value.numpy()
            for name, value in batch.items()}


def named_batches(dataset: Any, num_epochs: int | None, prefetch: int | None) -> Any:
    """``dataset``'s batches as Petastorm's ``make_tf_dataset`` gives them: a namedtuple of
    tensors a batch, ``num_epochs`` passes (None: without end), ``prefetch`` ahead (None: autotune)."""
    import collections

    import tensorflow as tf

    row = collections.namedtuple("inferred_schema_view", list(dataset.element_spec))  # type: ignore[misc]
    named = dataset.map(lambda batch: row(**batch))
    named = named.repeat(num_epochs) if num_epochs is not None else named.repeat()
    return named.prefetch(tf.data.AUTOTUNE if prefetch is None else prefetch)
