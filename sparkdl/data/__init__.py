"""The data path: Spark DataFrames written as Parquet for feeding, and read back as torch batches.

Modules, each depending only on those listed before it (and on :mod:`sparkdl.storage`,
:mod:`sparkdl.errors`, :mod:`sparkdl._validate`, and :mod:`sparkdl.rank.context` for the default
rank):

- :mod:`~sparkdl.data.manifest`: the manifest (columns, files, row groups) and column kinds;
- :mod:`~sparkdl.data.scan`: a path's manifest, read or built from the Parquet footers;
- :mod:`~sparkdl.data.files`: the files a loader reads, and the row-group reader;
- :mod:`~sparkdl.data.plan`: each rank's share of every epoch, from the manifest alone;
- :mod:`~sparkdl.data.images`: :class:`ImageDecoder`, images decoded and augmented per sample
  (simplejpeg, Pillow), or a batch at a time on a device (:mod:`~sparkdl.data.image_batches`:
  nvJPEG and one sampling pass);
- :mod:`~sparkdl.data.samples`: per-sample functions (``decode=``) on worker threads or
  processes, each sample's randomness from its row;
- :mod:`~sparkdl.data.spares`: shuffle windows' arrays, reused;
- :mod:`~sparkdl.data.read`: windows of rows read with pyarrow, cut into batches of tensors;
- :mod:`~sparkdl.data.selection`: the columns a loader reads, checked, and where a row is;
- :mod:`~sparkdl.data.petastorm_reader`: the same batches read by Petastorm (the classic stack);
- :mod:`~sparkdl.data.prefetch`: batches prepared ahead in a background thread;
- :mod:`~sparkdl.data.loader`: :class:`Loader`, one rank's batches, epoch after epoch;
- :mod:`~sparkdl.data.dataset`: :class:`Dataset`, the picklable handle (imports the loader on use);
- :mod:`~sparkdl.data.etl`, :mod:`~sparkdl.data.cache`, :mod:`~sparkdl.data.write`:
  :func:`write_dataset`, to a path or to the cache.

Importing this package imports neither pyarrow, nor torch, nor pyspark; the loader (numpy,
pyarrow) loads on the first ``Dataset.loader`` call.
"""

from sparkdl.data.dataset import Dataset
from sparkdl.data.write import write_dataset

# The public names, also importable from sparkdl itself; the package's modules are internal.
__all__ = ["Dataset", "write_dataset"]
