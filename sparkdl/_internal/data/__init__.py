"""The data path (:mod:`sparkdl.data` exports its public names): Spark DataFrames written as Parquet for feeding, and read back as torch batches.

Modules, each depending only on those listed before it (and on :mod:`sparkdl._internal.fs.storage`,
:mod:`sparkdl._internal.common.errors`, :mod:`sparkdl._internal.common.validate`, and :mod:`sparkdl._internal.rank.context` for the default
rank):

- :mod:`~sparkdl._internal.data.manifest`: the manifest (columns, files, row groups) and column kinds;
- :mod:`~sparkdl._internal.data.petastorm_schema`: a Petastorm dataset's ``Unischema``, read with a
  restricted unpickler into the manifest's fields;
- :mod:`~sparkdl._internal.data.scan`: a path's manifest, read or built from the Parquet footers;
- :mod:`~sparkdl._internal.data.files`: the files a loader reads, and the row-group reader;
- :mod:`~sparkdl._internal.data.plan`: each rank's share of every epoch, from the manifest alone;
- :mod:`~sparkdl._internal.data.images`: :class:`ImageDecoder`, images decoded and augmented per sample
  (simplejpeg, Pillow), or a batch at a time on a device (:mod:`~sparkdl._internal.data.image_batches`:
  nvJPEG and one sampling pass);
- :mod:`~sparkdl._internal.data.samples`: per-sample functions (``decode=``) on worker threads or
  processes, each sample's randomness from its row;
- :mod:`~sparkdl._internal.data.petastorm_codecs`: the default decoders of a Petastorm dataset's
  ndarray and image columns;
- :mod:`~sparkdl._internal.data.spares`: shuffle windows' arrays, reused;
- :mod:`~sparkdl._internal.data.read`: windows of rows read with pyarrow, cut into batches of tensors;
- :mod:`~sparkdl._internal.data.selection`: the columns a loader reads, checked, and where a row is;
- :mod:`~sparkdl._internal.data.petastorm_reader`: the same batches read by Petastorm (the classic stack);
- :mod:`~sparkdl._internal.data.prefetch`: batches prepared ahead in a background thread;
- :mod:`~sparkdl._internal.data.loader`: :class:`Loader`, one rank's batches, epoch after epoch;
- :mod:`~sparkdl._internal.data.dataset`: :class:`Dataset`, the picklable handle (imports the loader on use);
- :mod:`~sparkdl._internal.data.etl`, :mod:`~sparkdl._internal.data.cache`, :mod:`~sparkdl._internal.data.write`:
  :func:`write_dataset`, to a path or to the cache.

Importing this package imports neither pyarrow, nor torch, nor pyspark; the loader (numpy,
pyarrow) loads on the first ``Dataset.loader`` call.
"""
