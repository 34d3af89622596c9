"""``Dataset``: the small, picklable handle that ranks open a Parquet dataset with.

A dataset is a directory of Parquet files, with a manifest when :func:`sparkdl.write_dataset`
wrote it (see :mod:`sparkdl._internal.data.format.manifest`). The loader plans every epoch from that manifest
alone, which is what lets it give every rank the same number of steps without reading any data
first; the manifest travels inside the pickled handle.

Filesystems: local paths and ``file://`` URLs use pyarrow's local filesystem; ``s3://``, ``gs://``,
``hdfs://`` and ``abfs://`` use pyarrow's own filesystems; any other scheme (``ftp://``,
``http://``, ``memory://``, ...) and any URL given ``storage_options`` goes through fsspec
(:mod:`sparkdl._internal.fs.storage`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sparkdl._internal.data.format.manifest import Manifest
from sparkdl._internal.data.format.scan import open_manifest
from sparkdl._internal.data.loader_options import LoaderOptions
from sparkdl._internal.data.reading.files import ParquetFiles
from sparkdl._internal.fs.storage import filesystem, normalize_url, redact

if TYPE_CHECKING:
    from sparkdl._internal.data.loader import Loader
    from sparkdl._internal.data.reading.read import Batch


class Dataset(ParquetFiles):
    """A Parquet dataset to feed PyTorch from: a small handle that pickles to every rank.

    It opens directories written by :func:`write_dataset`, by plain Spark
    (``df.write.parquet``), by pyarrow, or by Petastorm, and single Parquet files. A dataset
    Petastorm's ``materialize_dataset`` wrote keeps its ``Unischema`` in ``_common_metadata``: it
    is read without Petastorm (and without running code from the file), and the loader decodes
    the ndarray and image columns as Petastorm's reader does. The manifest
    is read (or, without one, built from the Parquet footers) when the handle is created, and it
    travels with the handle when pickled, so that every rank plans from the very same layout.

    Example::

        ds = sparkdl.Dataset("s3://bucket/features")
        for batch in ds.loader(256, rank=0, world_size=1):
            x, y = batch["features"], batch["label"]

    Args:
        path_or_url: a local path, or a URL (``file://``, ``s3://``, ``gs://``, ``hdfs://``, or
            any scheme fsspec knows, such as ``ftp://user:pw@host:port/path``).
        storage_options: keyword arguments for the fsspec filesystem (credentials, endpoints,
            timeouts). When given, even ``s3://`` and friends go through fsspec.
        fixed_lengths: for datasets not written by sparkdl: ``{"column": length}`` for list
            columns whose every row has that length, so that they come out as 2-D tensors
            rather than padded ones. A row of another length fails the loader with an error.

    Raises:
        DatasetError: the URL cannot be reached, holds no Parquet, or the files disagree.
        ConfigError: a bad argument (unknown scheme, ``fixed_lengths`` on a non-array column).
    """

    def __init__(
        self,
        path_or_url: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        fixed_lengths: Mapping[str, int] | None = None,
    ) -> None:
        url = normalize_url(path_or_url)
        options = dict(storage_options) if storage_options else None
        fs, root = filesystem(url, options)
        manifest, single_file = open_manifest(fs, root, url, fixed_lengths)
        super().__init__(url, options, manifest, single_file=single_file, opened=(fs, root))

    # -- identity ------------------------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        """Rows in the dataset."""
        return self.manifest.num_rows

    @property
    def columns(self) -> tuple[str, ...]:
        """Column names, in file order."""
        return tuple(c.name for c in self.manifest.columns)

    @property
    def schema(self) -> dict[str, str]:
        """``{column: description}``, e.g. ``{"label": "int64", "features": "array<float32>[32]"}``.

        A dataset Petastorm wrote describes its ``Unischema``'s fields as the loader gives them,
        e.g. ``"ndarray<float32>[3, 4]"``, ``"image<uint8>[?, ?, 3] (jpeg)"`` (``?``: any length).
        """
        fields = {f.name: f for f in self.manifest.fields}
        return {c.name: fields[c.name].describe() if c.name in fields else c.describe() for c in self.manifest.columns}

    def __len__(self) -> int:
        return self.num_rows

    def __repr__(self) -> str:
        cols = ", ".join(f"{k}: {v}" for k, v in self.schema.items())
        return (
            f"Dataset({redact(self.url)!r}, rows={self.num_rows}, files={len(self.manifest.files)}, "
            f"columns={{{cols}}})"
        )

    # -- reading -------------------------------------------------------------------------------

    def loader(
        self,
        batch_size: int,
        *,
        epoch: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        columns: Sequence[str] | None = None,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        reader: str = "arrow",
        transform: Callable[[Batch], Batch] | None = None,
        prefetch: int = 4,
        shuffle_window: int | None = None,
        device: Any = None,
        pin_memory: bool | None = None,
        petastorm_workers: int = 2,
        to_device: bool = False,
        decode: Mapping[str, Callable[[Any, Any], Any]] | None = None,
        decode_workers: int | None = None,
        decode_in: str = "threads",
        on_bad_sample: str = "raise",
        read_threads: int | None = None,
        workers: int = 0,
    ) -> Loader:
        """This rank's loader: an iterable of ``{column: tensor}`` batches, the same count on every rank.

        See :class:`sparkdl._internal.data.loader.Loader` for the remainder, shuffle and resume policies.

        Example::

            def train(ds):
                loader = ds.loader(256, seed=7)            # rank/world size from sparkdl.context()
                for epoch in range(10):
                    loader.set_epoch(epoch)
                    for batch in loader:                   # len(loader) steps on every rank
                        loss = model(batch["features"]).sum()

        Args:
            batch_size: rows per batch.
            epoch: the epoch to start with; each full pass moves to the next one.
            shuffle: shuffle row groups and rows, deterministically for ``(seed, epoch)``.
            seed: shuffle seed, an integer >= 0.
            columns: columns to read, in this order (default: every column).
            drop_last: ``True``: every batch is full and the remainder is dropped;
                ``False``: no row is dropped, some rows are repeated to even out the ranks.
            rank, world_size: this rank and the number of ranks; by default from
                :func:`sparkdl.context` in a run, else from an initialized ``torch.distributed``,
                else 0 and 1.
            reader: ``"arrow"`` (sparkdl's reader) or ``"petastorm"`` (Petastorm's
                ``make_batch_reader``, on the classic stack).
            transform: a function from a batch dict to a batch dict, run in the loader's
                background thread (decode images here).
            prefetch: batches prepared ahead in a background thread (0: none, no thread).
            shuffle_window: rows shuffled together (see :class:`~sparkdl._internal.data.loader.Loader`).
            device: the device batches are for (by default the run's device): memory is pinned
                when it is CUDA, and with ``to_device`` the tensors arrive on it.
            pin_memory: force pinning on or off.
            petastorm_workers: reader threads for ``reader="petastorm"``.
            to_device: ``True``: tensors arrive on ``device`` already (lists stay lists). On CUDA
                the background thread copies each batch from pinned memory on a side stream while
                earlier steps compute, up to ``prefetch`` batches ahead (they wait on the GPU), and
                the batch is ready for the training thread's current stream when handed out.
                ``False`` (the default): CPU tensors, moved by the training loop.
            decode: per-sample functions by column, ``fn(value, rng) -> array``, such as
                :class:`sparkdl.ImageDecoder`; each column's outputs are stacked into one
                tensor. ``rng`` depends on ``(seed, epoch, row)`` alone, so augmentations are
                the same with any number of workers and after a resume
                (:mod:`sparkdl._internal.data.decoding.samples`). A Petastorm dataset's ndarray and image
                columns have default decoders, from its ``Unischema``, which a function given
                here for the column replaces (:mod:`sparkdl._internal.data.decoding.petastorm_codecs`).
            decode_workers: workers running ``decode`` (default: one per core).
            decode_in: ``"threads"`` (functions that release the GIL, like Pillow's decoding)
                or ``"processes"`` (forked when the loader is made).
            on_bad_sample: ``"raise"`` (a ``decode`` function's error stops the loader, naming
                the row and column) or ``"skip"`` (the row is left out of its batch and counted
                in ``loader.skipped``).
            read_threads: threads that decode the row groups of a shuffle window at once, each a
                row group (Parquet decodes a column on one core; a fast GPU outruns one core).
                Default: a quarter of the cores, 1 to 4. Up to this many row groups are in memory
                at a time instead of one. Without shuffle a window is about one row group.
            workers: ``0`` (the default): the loader reads in threads of the training process.
                ``N >= 1``: ``N`` worker processes, forked when an iteration starts, read and decode
                the row groups, shuffle, cut and collate the batches, run ``decode`` (on
                ``decode_workers`` threads each, default the cores over ``N``) and ``transform``,
                and hand the finished tensors over in shared memory (views, no copy), out of the
                training process's GIL; pinning and ``to_device`` stay in the training process.
                Same batches, order and resume state as ``workers=0``. The workers end with the
                loop (``break``, ``close()``) and with the process, even when it is killed.
                ``reader="arrow"`` only; ``transform`` must not use CUDA in them
                (:mod:`sparkdl._internal.data.reading.workers`).
        """
        options = LoaderOptions.from_call(locals())  # first: the keywords above, and self
        # Imported here: the loader brings numpy and pyarrow, which ``import sparkdl`` must not.
        from sparkdl._internal.data.loader import Loader

        return Loader(self, options)

    def tf_dataset(self, batch_size: int, **loader_args: Any) -> Any:
        """This rank's batches as a ``tf.data.Dataset`` (``backend="tensorflow"``): the loader of
        :meth:`loader` with the same arguments, seen by TensorFlow (:mod:`sparkdl._internal.data.tfdata`).

        Create the strategy first: TensorFlow refuses ``MultiWorkerMirroredStrategy()`` after
        any other TensorFlow op ("Collective ops must be configured at program startup").

        Example::

            def train(ds):
                strategy = tf.distribute.MultiWorkerMirroredStrategy()
                with strategy.scope():
                    model = make_model()
                model.fit(ds.tf_dataset(64, seed=7).map(lambda b: (b["features"], b["label"])), epochs=3)
        """
        from sparkdl._internal.data.loader import Loader
        from sparkdl._internal.data.tfdata import tf_dataset

        return tf_dataset(Loader(self, LoaderOptions.of(batch_size, loader_args)))

def written(url: str, manifest: Manifest) -> Dataset:
    """The handle of a dataset ``write_dataset`` has just written, without reading it back."""
    ds = Dataset.__new__(Dataset)
    ds.__setstate__({"url": url, "storage_options": None, "manifest": manifest, "single_file": False})
    return ds
