"""The data path (:mod:`sparkdl.data` exports its public names): Spark DataFrames written as Parquet for feeding, and read back as torch batches.

A folder per stage, each importing only the stages listed before it (and
:mod:`sparkdl._internal.fs`, :mod:`sparkdl._internal.common`, and :mod:`sparkdl._internal.rank.context`
for the default rank); ``tests/unit/test_layout.py`` checks the order:

- ``format/``: what a dataset on disk is. The manifest (columns, files, row groups, column kinds:
  :mod:`~sparkdl._internal.data.format.manifest`, Arrow types: :mod:`~sparkdl._internal.data.format.arrow`),
  read or built from the Parquet footers (:mod:`~sparkdl._internal.data.format.scan`); a Petastorm
  dataset's ``Unischema``, read with a restricted unpickler
  (:mod:`~sparkdl._internal.data.format.petastorm_schema`).
- ``decoding/``: a sample's columns into arrays. Per-sample functions (``decode=``) on worker threads
  or processes, each sample's randomness from its row (:mod:`~sparkdl._internal.data.decoding.samples`);
  :class:`ImageDecoder` (:mod:`~sparkdl._internal.data.decoding.images`, with its file formats,
  :mod:`~sparkdl._internal.data.decoding.image_files`, nvJPEG batches,
  :mod:`~sparkdl._internal.data.decoding.image_batches`, and DALI,
  :mod:`~sparkdl._internal.data.decoding.dali_engine`); Petastorm's ``TransformSpec`` a row at a time
  (:mod:`~sparkdl._internal.data.decoding.row_transform`) and its codecs
  (:mod:`~sparkdl._internal.data.decoding.petastorm_codecs`).
- ``reading/``: one rank's rows. Its share of every epoch from the manifest alone
  (:mod:`~sparkdl._internal.data.reading.plan`); the files and the row-group reader
  (:mod:`~sparkdl._internal.data.reading.files`); windows of rows read with pyarrow and cut into
  batches (:mod:`~sparkdl._internal.data.reading.read`, with reused arrays,
  :mod:`~sparkdl._internal.data.reading.spares`, and the columns checked,
  :mod:`~sparkdl._internal.data.reading.selection`); the same batches read by Petastorm
  (:mod:`~sparkdl._internal.data.reading.petastorm_reader`); batches prepared ahead in a thread
  (:mod:`~sparkdl._internal.data.reading.prefetch`); an epoch resumed at another world size
  (:mod:`~sparkdl._internal.data.reading.reshard`).
- The loader that joins them: its settings as one checked object
  (:mod:`~sparkdl._internal.data.loader_options`), :class:`Loader` (:mod:`~sparkdl._internal.data.loader`), one rank's
  batches epoch after epoch, as a ``tf.data`` dataset too (:mod:`~sparkdl._internal.data.tfdata`);
  :class:`Dataset` (:mod:`~sparkdl._internal.data.dataset`), the picklable handle that travels to the
  ranks (it imports the loader on use).
- ``writing/``: :func:`write_dataset`, a DataFrame to a path or to the cache
  (:mod:`~sparkdl._internal.data.writing.write`, :mod:`~sparkdl._internal.data.writing.etl`,
  :mod:`~sparkdl._internal.data.writing.cache`); it hands back a :class:`Dataset`.

Importing this package imports neither pyarrow, nor torch, nor pyspark; the loader (numpy,
pyarrow) loads on the first ``Dataset.loader`` call.
"""
