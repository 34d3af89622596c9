"""The data path: Spark DataFrames written as Parquet for feeding (:func:`write_dataset`), and
read back on each rank as torch batches through the picklable handle :class:`Dataset`.

Importing this package imports neither pyarrow, nor torch, nor pyspark; the loader (numpy,
pyarrow) loads on the first ``Dataset.loader`` call.
"""


from sparkdl._internal.data.dataset import Dataset
from sparkdl._internal.data.writing.write import write_dataset

# The public names, also importable from sparkdl itself; the package's modules are internal.
__all__ = ["Dataset", "write_dataset"]
