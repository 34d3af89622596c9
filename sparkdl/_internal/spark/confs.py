"""Every Spark conf sparkdl reads (``spark.sparkdl.*``), in one place: the modules that read one take
its name from here, and the settings reference of the documentation is generated from this list
(a unit test fails on a ``spark.sparkdl.*`` name in the package that is missing here)."""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "spark.sparkdl."


@dataclass(frozen=True)
class SparkConf:
    """One ``spark.sparkdl.*`` conf: its name, its default (in words) and what it does."""

    name: str
    default: str
    what: str


RUN_DIR = SparkConf(
    "spark.sparkdl.runDir",
    "`<fs.defaultFS>/user/<user>/sparkdl/runs` when Hadoop's default file system is not local (HDFS on "
    "YARN) and the driver can create it there; else `<temp dir>/sparkdl-<uid>/runs`, private to the user "
    "(a directory on the driver's disk)",
    "Where runs get their directories, `<runDir>/<run id>` (checkpoints of runs without `checkpoint_dir`, "
    "metrics). On a cluster of several hosts it must be storage every executor reaches (HDFS, S3, a shared "
    "mount): a run that checkpoints to a directory an executor does not see is refused before training; "
    "with the driver's temp dir as the default, a run that never saves still runs, and its first save fails.",
)
CACHE_DIR = SparkConf(
    "spark.sparkdl.cacheDir",
    "`<temp dir>/sparkdl-<uid>/cache`, private to the user",
    "Where `write_dataset` without a path keeps its Parquet copies, keyed by the DataFrame's plan. On "
    "several hosts: shared storage, as for `runDir`.",
)
CHANNEL = SparkConf(
    "spark.sparkdl.channel",
    "`direct` on a classic session; `auto` on Spark Connect",
    "How the ranks report to the driver: `direct` (live, over an authenticated channel to the driver), "
    "`relay` (through Spark itself, at the end of each attempt) or `auto` (direct when the executors reach "
    "the driver, else relay).",
)
CHANNEL_HOST = SparkConf(
    "spark.sparkdl.channelHost",
    "`spark.driver.host`; on Spark Connect, this machine's address on its route to the server",
    "The address the driver's channel listens on, when the default is not the one the executors reach the "
    "driver (or Spark Connect client) at.",
)
MLFLOW = SparkConf(
    "spark.sparkdl.mlflow.enabled",
    "`false`",
    "Log every run's metrics and final model to MLflow, unless `RunConfig.mlflow` says otherwise.",
)
DECODE_THREADS = SparkConf(
    "spark.sparkdl.ml.decodeThreads",
    "the cores a task has: `spark.task.cpus`; on GPU executors (`spark.executor.cores`, "
    "`spark.executor.resource.gpu.amount` and `spark.task.resource.gpu.amount` set), the executor's cores "
    "divided among the tasks its GPUs run at once",
    "How many threads each `TorchModel.transform` task decodes its rows on, when the model has a "
    "`featuresDecoder` (images). Read from the session when `transform` is called (`spark.conf.set`).",
)
TRUST_SAVED_MODELS = SparkConf(
    "spark.sparkdl.ml.trustSavedModels",
    "`false`",
    "Load saved models (`TorchModel`, and stages inside a `PipelineModel`) from local paths that another "
    "user owns or that group or others may write; without it such a path is refused before anything is read, "
    "since loading unpickles code. Same as `TorchModel.load(path, trusted=True)`.",
)

ALL = (RUN_DIR, CACHE_DIR, CHANNEL, CHANNEL_HOST, MLFLOW, TRUST_SAVED_MODELS, DECODE_THREADS)
