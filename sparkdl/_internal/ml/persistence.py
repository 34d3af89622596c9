"""Saving and loading the estimator and the model through Spark ML's ``MLWriter``/``MLReader``.

JSON-able params go to the usual ``metadata`` file, so ``save``/``load`` and saved
``Pipeline``/``PipelineModel`` work as for Spark's own stages. Values that are not JSON (a module,
a model factory, an optimizer factory, a loss function) and the trained module are cloudpickled
into ``data/``: Parquet, written and read by Spark, so any filesystem Spark reaches works.

Loading unpickles, which runs code from the saved files: load only models from a trusted source.
On a local path (no scheme, or ``file:``) :class:`ParamsReader` first refuses, with a
:class:`ConfigError`, a saved directory of which any file or directory belongs to another user
(root excepted) or is writable by group or others: such a model may have been planted or altered
by someone else. ``trusted=True`` (``TorchModel.load(path, trusted=True)``) or the Spark conf
``spark.sparkdl.ml.trustSavedModels=true`` (which also reaches stages inside a
``PipelineModel``) skips that check. Other filesystems are not checked, and a warning says so:
among them a path without a scheme where ``fs.defaultFS`` is not the local disk (YARN's HDFS),
which Spark reads there, not from the driver's disk.

From a Spark Connect client (pyspark >= 4) the same files are written and read through the
session's DataFrames (there is no SparkContext), so a model saved from a classic session loads
over Connect and the other way round. The trust check then looks at the path on the client's
machine: a path the client does not see (the server's own disk) is not checked.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast
from urllib.parse import urlsplit

from pyspark.ml.param import Params
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from sparkdl._internal.common.config import RunConfig
from sparkdl._internal.common.errors import ConfigError, SparkDLError
from sparkdl._internal.fs.storage import redact
from sparkdl._internal.spark import confs, spark_api

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["TRUST_CONF", "ParamsReader", "ParamsWriter", "Persistable", "check_connect_client"]

TRUST_CONF = confs.TRUST_SAVED_MODELS.name
log = logging.getLogger(__name__)
_P = TypeVar("_P", bound="Persistable")

# Saved blobs are cut into Parquet rows of this size.
_BLOB_CHUNK = 16 * 1024 * 1024
_FORMAT = 1
_JSON_SCALARS = (str, int, float, bool, type(None))


def check_connect_client(session: Any, what: str) -> None:
    """ConfigError for a Spark Connect client older than pyspark 4, whose Spark ML has no Connect side."""
    if not spark_api.is_remote(session):
        return
    import pyspark

    if int(pyspark.__version__.split(".")[0]) < 4:
        raise ConfigError(
            f"{what} over Spark Connect needs pyspark >= 4 on the client (this is pyspark {pyspark.__version__}, "
            "whose Spark ML needs a SparkContext). Upgrade the client (pip install 'sparkdl[connect]'), or run "
            "it on a classic session (the cluster's driver, spark-submit)"
        )


def _metadata_target(session: Any) -> Any:
    # pyspark 3.5 reads and writes the metadata through a SparkContext only; pyspark 4 also through
    # a session, the one way a Connect client has.
    return session if spark_api.is_remote(session) else session.sparkContext


class Persistable(Params):
    """A stage that :class:`ParamsWriter` can save: its params split into JSON ones and pickled ones.

    A subclass with state beyond its params (the model's module and history) overrides
    :meth:`_extra_state` and :meth:`_set_extra_state`.
    """

    def _json_and_pickled(self) -> tuple[dict[str, Any], dict[str, Any]]:
        json_params: dict[str, Any] = {}
        pickled: dict[str, Any] = {}
        for param, value in self._paramMap.items():
            if isinstance(value, RunConfig):
                json_params[param.name] = value.to_dict()
            elif isinstance(value, _JSON_SCALARS):
                json_params[param.name] = value
            else:
                pickled[param.name] = value
        return json_params, pickled

    def _extra_state(self) -> tuple[dict[str, Any], dict[str, bytes]]:
        """Metadata and blobs of the instance beyond its params."""
        return {}, {}

    def _set_extra_state(self, meta: Mapping[str, Any], blobs: Mapping[str, bytes]) -> None:
        """Restores what :meth:`_extra_state` saved."""

    @classmethod
    def load(cls: type[_P], path: str, *, trusted: bool = False) -> _P:
        """The instance saved under ``path`` with ``save``.

        Loading unpickles what was saved (the module, factories, the loss), which runs code from
        the saved files: load only from a trusted source. A local ``path`` of which any file or
        directory belongs to another user (root excepted) or is writable by group or others is
        refused with a :class:`ConfigError` before anything is read. ``trusted=True`` (or the
        Spark conf ``spark.sparkdl.ml.trustSavedModels=true``, which also reaches stages loaded
        by ``PipelineModel.load``) skips that check.
        """
        return cast(_P, ParamsReader(cls, trusted=trusted).load(path))


class ParamsWriter(MLWriter):
    """Writes a :class:`Persistable`: params and extra metadata to ``metadata``, blobs to ``data/``."""

    def __init__(self, instance: Persistable) -> None:
        super().__init__()
        self.instance = instance

    def save(self, path: str) -> None:
        """Writes the instance under ``path``, replacing what is there with ``overwrite()``."""
        session = self.sparkSession
        if not spark_api.is_remote(session):
            super().save(path)  # its overwrite goes through the JVM, which only a classic session has
            return
        check_connect_client(session, f"saving a {type(self.instance).__name__}")
        if self.shouldOverwrite:
            from pyspark.ml.connect.readwrite import RemoteMLWriter

            # What pyspark's own Connect writers do: the server deletes the path.
            RemoteMLWriter.handleOverwrite(path, True)
        self.saveImpl(path)

    def saveImpl(self, path: str) -> None:
        """Writes the instance under ``path`` (``save`` has handled overwrite)."""
        import cloudpickle

        json_params, pickled = self.instance._json_and_pickled()
        meta, blobs = self.instance._extra_state()
        blobs = dict(blobs)
        if pickled:
            try:
                blobs["params"] = cloudpickle.dumps(pickled, protocol=5)
            except Exception as exc:
                raise ConfigError(
                    f"the params {sorted(pickled)} of {self.instance.uid} cannot be pickled for saving "
                    f"({type(exc).__name__}: {exc}); they must not hold a SparkSession, lock or open file"
                ) from exc
        extra = {"sparkdl": {"format": _FORMAT, **meta, "blobs": sorted(blobs)}}
        DefaultParamsWriter.saveMetadata(
            self.instance, path, _metadata_target(self.sparkSession), extraMetadata=extra, paramMap=json_params
        )
        if blobs:
            _write_blobs(self.sparkSession, os.path.join(path, "data"), blobs)


class ParamsReader(MLReader[Any]):
    """Reads back what :class:`ParamsWriter` wrote, as an instance of ``cls`` (and only of it)."""

    def __init__(self, cls: type[Persistable], *, trusted: bool = False) -> None:
        super().__init__()
        self.cls = cls
        self.trusted = trusted

    def load(self, path: str) -> Any:
        """The instance saved under ``path``; SparkDLError for another class or format.

        Unless ``trusted`` or the Spark conf ``spark.sparkdl.ml.trustSavedModels`` is true, a
        local ``path`` is first checked (:func:`check_trusted_files`); nothing is read before.
        """
        import cloudpickle

        session = self.sparkSession
        check_connect_client(session, f"loading a {self.cls.__name__}")
        if not self.trusted and str(session.conf.get(TRUST_CONF, "false")).lower() != "true":
            check_trusted_files(path, self.cls.__name__, default_fs=_default_fs(session))
        metadata = DefaultParamsReader.loadMetadata(path, _metadata_target(session))
        saved = metadata.get("sparkdl") or {}
        expected = f"{self.cls.__module__}.{self.cls.__name__}"
        if metadata.get("class") != expected:
            raise SparkDLError(
                f"{path} holds a {metadata.get('class')}, not a {expected}; load it with that class "
                "(or with PipelineModel.load / Pipeline.load for a saved pipeline)"
            )
        if saved.get("format") != _FORMAT:
            raise SparkDLError(
                f"{path} holds a {metadata.get('class')} saved in format {saved.get('format')!r}; this "
                f"sparkdl reads format {_FORMAT}. Load it with the sparkdl version that saved it"
            )
        instance: Any = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        names = list(saved.get("blobs") or [])
        blobs = _read_blobs(session, os.path.join(path, "data"), names) if names else {}
        if "params" in blobs:
            instance._set(**cloudpickle.loads(blobs["params"]))
        instance._set_extra_state(saved, blobs)
        return instance


def _write_blobs(spark: SparkSession, path: str, blobs: Mapping[str, bytes]) -> None:
    rows = [
        (name, i, bytearray(data[start : start + _BLOB_CHUNK]))
        for name, data in sorted(blobs.items())
        for i, start in enumerate(range(0, max(len(data), 1), _BLOB_CHUNK))
    ]
    # Spark writes it, so the model goes wherever the metadata goes (HDFS, S3, ...).
    spark.createDataFrame(rows, "name string, chunk int, data binary").coalesce(1).write.parquet(path)


def _read_blobs(spark: SparkSession, path: str, names: Sequence[str]) -> dict[str, bytes]:
    pieces: dict[str, list[tuple[int, bytes]]] = {name: [] for name in names}
    for row in spark.read.parquet(path).collect():
        pieces.setdefault(row["name"], []).append((int(row["chunk"]), bytes(row["data"])))
    missing = [n for n in names if not pieces.get(n)]
    if missing:
        raise SparkDLError(f"{path} lacks the saved part(s) {missing}; the saved model is incomplete")
    return {name: b"".join(data for _, data in sorted(parts)) for name, parts in pieces.items()}


def _default_fs(session: Any) -> str | None:
    try:
        return spark_api.of(session).default_fs()
    except Exception:  # a session that cannot say: a path without a scheme is taken as local
        return None


def check_trusted_files(path: str, what: str, *, default_fs: str | None = None) -> None:
    """Refuses (ConfigError) a saved local ``path`` that another user could have written.

    Every directory and file under ``path`` (symlinks followed) must belong to this user or to
    root and be writable by neither group nor others. A path on another store (a URL, or a path
    without a scheme where Spark's ``fs.defaultFS`` is not the local disk, as on YARN) is not
    checked, and a warning says so: the local file of the same name, if any, is not the one Spark
    reads.
    """
    parts = urlsplit(path)
    default_scheme = urlsplit(default_fs or "").scheme
    if parts.scheme == "file":
        local = parts.path
    elif len(parts.scheme) <= 1 and default_scheme in ("", "file") and os.path.lexists(path):  # local (or a drive)
        local = path
    else:
        store = path if len(parts.scheme) > 1 else f"{path} on {redact(default_fs or '')}"
        log.warning(
            "sparkdl: the %s saved at %s was not checked for files other users could have written: sparkdl "
            "checks local paths only, and loading it runs code from its files. Load models only from storage "
            "where only you (and those you trust) can write", what, redact(store) if len(parts.scheme) > 1 else store,
        )
        return
    me = os.geteuid()
    seen: set[tuple[int, int]] = set()
    stack = [os.path.abspath(local)]
    while stack:
        current = stack.pop()
        info = os.stat(current)
        if info.st_uid not in (me, 0) or info.st_mode & 0o022:
            raise _untrusted(path, what, current, info, me)
        if stat.S_ISDIR(info.st_mode) and (info.st_dev, info.st_ino) not in seen:
            seen.add((info.st_dev, info.st_ino))
            stack.extend(os.path.join(current, name) for name in sorted(os.listdir(current)))


def _untrusted(path: str, what: str, culprit: str, info: os.stat_result, me: int) -> ConfigError:
    if info.st_uid not in (me, 0):
        why = f"belongs to uid {info.st_uid}, not to this user (uid {me})"
    else:
        why = f"is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    return ConfigError(
        f"refusing to load the {what} saved at {path}: {culprit} {why}, so someone else may have "
        f"written it, and loading a {what} runs code from its files (what it saved is unpickled). "
        f"If you trust its source, load it with {what}.load(path, trusted=True), or set the Spark "
        f"conf {TRUST_CONF}=true (also for a PipelineModel holding it); otherwise make the files "
        f"your own and private (chown -R, chmod -R go-w {path}) after checking them"
    )
