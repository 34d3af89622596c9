"""Per-sample functions over a batch's columns (``ds.loader(..., decode={column: fn})``).

Each named column's values (bytes, strings, structs as dicts) go one by one through ``fn(value,
rng)`` on a pool of decode workers, threads or processes, and come back as one stacked tensor
per column (a list when the outputs' shapes differ). The batches, their order, ``len(loader)``
and the resume position are those of the plain loader; only the columns change.

**Randomness is the sample's, not the worker's.** ``rng`` is
``numpy.random.default_rng([seed, epoch, row])``, ``row`` being the sample's place in the
dataset (its row in the concatenated files, as the manifest lists them). So the same seed gives
the same pixels with 1, 2 or 8 workers, threads or processes, on any rank, and a run resumed
mid-epoch (also at another world size) sees bitwise the same augmented samples it would have
seen. Every column of a row gets a generator of the same draws, so an image and its mask are
cropped alike by the same decoder.

**Workers.** Threads suit functions that let go of the GIL (Pillow, simplejpeg, torchvision
decode); processes (forked, like torch ``DataLoader``'s workers, when the loader is made) suit
pure-Python functions. Up to two batches are decoded ahead of the one being served, so the
workers do not wait at batch boundaries. The pool lives as long as the loader: ``close()`` ends
it, and so does dropping the loader.

**Bad samples** (a function that raises: a truncated JPEG, a zero-byte file, not an image) stop
the loader with :class:`~sparkdl.DatasetError` naming the column, the row, its Parquet file and,
when the batch has one, its ``path``/``origin`` column. With ``on_bad_sample="skip"`` the row is
left out of its batch instead (every column), counted in ``loader.skipped``, and the first few
are logged; every rank still takes the same number of steps, some a smaller batch.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import itertools
import logging
import multiprocessing
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from sparkdl._internal.common.errors import DatasetError
from sparkdl._internal.data.decoding.row_transform import outcome

log = logging.getLogger("sparkdl.data")

SampleFn = Callable[[Any, np.random.Generator], Any]
ROW = "*"
"""``decode={ROW: fn}``: ``fn(row, rng)`` takes the whole row (a dict of its columns' values) and
returns the batch's columns for it (a dict); the batch is then made of those columns alone
(Petastorm's ``TransformSpec``, :mod:`sparkdl._internal.data.decoding.row_transform`)."""
_NAMING_COLUMNS = ("path", "origin", "filename", "file")
_EXAMPLES = 5


def sample_rng(seed: int, epoch: int, row: int) -> np.random.Generator:
    """The generator of one sample's random draws: a function of ``(seed, epoch, row)`` alone."""
    return np.random.default_rng([seed, epoch, row])


def default_workers() -> int:
    """One decode worker per core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class Skipped:
    """Bad samples left out (``on_bad_sample="skip"``): a count and the first few reasons."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.examples: list[str] = []

    def add(self, reason: str) -> None:
        with self._lock:
            self.count += 1
            if len(self.examples) < _EXAMPLES:
                self.examples.append(reason)
                log.warning("sparkdl loader: skipped a bad sample (on_bad_sample='skip'): %s", reason)

    def merge(self, count: int, examples: Sequence[str]) -> None:
        """Adds what was counted elsewhere (and logged there)."""
        with self._lock:
            self.count += count
            self.examples.extend(examples[: max(0, _EXAMPLES - len(self.examples))])

    def mark(self) -> tuple[int, int]:
        """Where the count stands, for :meth:`since`."""
        with self._lock:
            return self.count, len(self.examples)

    def since(self, mark: tuple[int, int]) -> tuple[tuple[int, list[str]], tuple[int, int]]:
        """What was added after ``mark`` (a count and its examples, for :meth:`merge`), and the
        mark from here on."""
        with self._lock:
            return (self.count - mark[0], self.examples[mark[1] :]), (self.count, len(self.examples))


# A process worker's functions: set once per forked worker by the pool's initializer.
_WORKER_FNS: dict[str, SampleFn] = {}


def _init_worker(fns: dict[str, SampleFn]) -> None:
    _WORKER_FNS.clear()
    _WORKER_FNS.update(fns)
    import torch

    torch.set_num_threads(1)  # a process of its own: as torch's DataLoader does in its workers


def one_torch_thread() -> None:
    """Makes torch run this thread's operations on this thread alone, and changes nothing else.

    A decode thread that calls torch (a resize, a user's tensor op) would otherwise start an
    OpenMP team of one thread per core for each call: with a decode thread per core that is
    cores x cores threads, and on 16 cores the decode rate halved (measured). ``torch.set_num_threads``
    cannot be used: it also changes the setting of threads started later, the user's included.
    OpenMP's own setting is per thread, so it is set here through the OpenMP runtime torch loaded,
    after torch has read it for this thread. Where that runtime is not found, nothing changes.
    """
    import ctypes

    import torch

    torch.get_num_threads()  # torch sets this thread's OpenMP team size on first use: let it first
    try:
        with open("/proc/self/maps") as maps:
            runtimes = sorted({line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line})
    except OSError:
        return
    for path in runtimes:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(path).omp_set_num_threads(1)


def _run(fns: Mapping[str, SampleFn], seed: int, epoch: int, work: Sequence[tuple[str, Any, int]]) -> list[Any]:
    """``fn(value, rng)`` for each ``(column, value, row)`` (a chunked function's rows at once); a
    sample that failed comes back as ``_Failed``."""
    done: list[Any] = []
    for name, group in itertools.groupby(work, key=lambda item: item[0]):
        items = list(group)
        if (chunked := getattr(fns[name], "run_chunk", None)) is not None:  # a TransformSpec's rows at once
            done.extend(chunked([v for _, v, _ in items], [sample_rng(seed, epoch, r) for _, _, r in items]))
        else:
            done.extend(outcome(fns[name], value, sample_rng(seed, epoch, row)) for _, value, row in items)
    # A failed sample is handed to the loader, which names the row.
    return [_Failed(f"{type(e).__name__}: {e}") if isinstance(e, Exception) else e for e in done]



def _run_in_worker(seed: int, epoch: int, work: Sequence[tuple[str, Any, int]]) -> list[Any]:
    return _run(_WORKER_FNS, seed, epoch, work)


class _Failed:
    def __init__(self, reason: str) -> None:
        self.reason = reason


class SampleMap:
    """The decode functions of a loader and the workers that run them.

    Args:
        fns: per-sample functions by column.
        seed: the loader's seed.
        workers: decode workers (threads or processes).
        worker_kind: ``"threads"`` or ``"processes"``.
        on_bad_sample: ``"raise"`` or ``"skip"``.
        where: a row's place for messages (its Parquet file and row there).
    """

    AHEAD = 2
    """Batches decoded ahead of the one being served."""

    def __init__(self, fns: Mapping[str, SampleFn], *, seed: int, workers: int, worker_kind: str,
                 on_bad_sample: str, where: Callable[[int], str]) -> None:
        self.fns = dict(fns)
        self.seed = seed
        self.workers = workers
        self.on_bad = on_bad_sample
        self.where = where
        # Bad samples met while decoding (the prefetch thread's or a worker's, maybe batches ahead,
        # logged as met), and those of the batches handed out: ``loader.skipped``, the same
        # whether or not batches were prepared ahead (an epoch's count does not take in the next
        # epoch's batches that the prefetch thread decoded before the loop read it).
        self.found = Skipped()
        self.skipped = Skipped()
        self._kind = worker_kind
        self._batched: dict[str, Any] = {n: f for n, f in self.fns.items() if getattr(f, "batched", False)}
        self._lock = threading.Lock()
        self._pool: cf.Executor | None = None
        self._batch_pool: cf.ThreadPoolExecutor | None = None
        self._streams: dict[str, Any] = {}
        self.ready()

    def ready(self) -> None:
        """Forks the decode processes now, in the calling thread (the loader's, not its reader's),
        if they are used and not running (again after :meth:`close`)."""
        if self._kind == "processes" and len(self._batched) < len(self.fns):
            self._open()

    def _open(self) -> cf.Executor:
        with self._lock:
            if self._pool is None:
                if self._kind == "processes":
                    pool: cf.Executor = cf.ProcessPoolExecutor(
                        self.workers, mp_context=multiprocessing.get_context("fork"),
                        initializer=_init_worker, initargs=(self.fns,))
                    pool.submit(int).result()  # fork every worker now
                else:
                    pool = cf.ThreadPoolExecutor(self.workers, thread_name_prefix="sparkdl-decode",
                                                 initializer=one_torch_thread)
                weakref.finalize(self, pool.shutdown, wait=False, cancel_futures=True)
                self._pool = pool
            return self._pool

    @contextlib.contextmanager
    def gpu_stream(self, fn: Any) -> Iterator[Any]:
        """A side CUDA stream of the decoder's device, current while it decodes a batch."""
        import torch

        device = torch.device(fn.device)
        if device.type != "cuda":
            yield None
            return
        with self._lock:
            stream = self._streams.get(str(device))
            if stream is None:
                stream = self._streams[str(device)] = torch.cuda.Stream(device=device)
        with torch.cuda.stream(stream):
            yield stream

    def close(self) -> None:
        """Ends the workers; they are started again if the loader is iterated again."""
        with self._lock:
            pools, self._pool, self._batch_pool = (self._pool, self._batch_pool), None, None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def _decode_batched(self, fn: Any, values: list[Any], rows: np.ndarray, epoch: int) -> list[Any]:
        """A batch through a batched decoder (``ImageDecoder(device=...)``), on its device's side
        stream; failures come back as ``_Failed``."""
        rngs = [sample_rng(self.seed, epoch, int(r)) for r in rows]
        with self.gpu_stream(fn) as stream:
            decoded, bad = fn.decode_batch(values, rngs)
            if stream is not None:
                stream.synchronize()  # a decode thread waits, so the training thread need not
        for i, e in bad.items():
            decoded[i] = _Failed(f"{type(e).__name__}: {e}")
        return list(decoded)

    def start(self, batch: dict[str, Any], rows: np.ndarray, epoch: int) -> Pending:
        """Sends the batch's samples to the workers; ``result()`` of what it returns waits for them."""
        cpu = [n for n in self.fns if n not in self._batched]
        work = [(n, v, int(r)) for n in cpu for v, r in zip(_row_dicts(batch) if n == ROW else batch[n], rows, strict=True)]
        futures: list[cf.Future[list[Any]]] = []
        if work:
            pool = self._open()
            chunk = max(1, -(-len(work) // (4 * self.workers)))
            for i in range(0, len(work), chunk):
                part = work[i : i + chunk]
                if self._kind == "processes":
                    futures.append(pool.submit(_run_in_worker, self.seed, epoch, part))
                else:
                    futures.append(pool.submit(_run, self.fns, self.seed, epoch, part))
        batched: dict[str, cf.Future[list[Any]]] = {}
        if self._batched:
            with self._lock:
                if self._batch_pool is None:
                    # Threads of their own, also beside decode processes: a batch decodes while
                    # the reader cuts the next ones (up to AHEAD batches at a time).
                    self._batch_pool = cf.ThreadPoolExecutor(self.AHEAD, thread_name_prefix="sparkdl-decode-batch")
                    weakref.finalize(self, self._batch_pool.shutdown, wait=False, cancel_futures=True)
                pool = self._batch_pool
            for name, fn in self._batched.items():
                batched[name] = pool.submit(self._decode_batched, fn, list(batch[name]), rows, epoch)
        return Pending(self, batch, rows, epoch, cpu, futures, batched)


class Pending:
    """A batch whose samples are being decoded."""

    def __init__(self, owner: SampleMap, batch: dict[str, Any], rows: np.ndarray, epoch: int,
                 cpu: list[str], futures: list[cf.Future[list[Any]]], batched: dict[str, cf.Future[list[Any]]]) -> None:
        self._owner, self._batch, self._rows, self._epoch = owner, batch, rows, epoch
        self._cpu, self._futures, self._batched = cpu, futures, batched

    def result(self) -> dict[str, Any]:
        """The batch with its decoded columns (bad rows raised, or left out with ``skip``)."""
        owner, batch, rows = self._owner, self._batch, self._rows
        n = len(rows)
        outputs: dict[str, list[Any]] = {}
        if self._cpu:
            flat = [x for f in self._futures for x in f.result()]
            for k, name in enumerate(self._cpu):
                outputs[name] = flat[k * n : (k + 1) * n]
        for name, future in self._batched.items():
            outputs[name] = future.result()
        bad_rows: dict[int, str] = {}
        for name, values in outputs.items():
            for i, v in enumerate(values):
                if isinstance(v, _Failed) and i not in bad_rows:
                    bad_rows[i] = self._reason(name, i, v.reason)
        if bad_rows and owner.on_bad == "raise":
            first = min(bad_rows)
            raise DatasetError(
                f"{bad_rows[first]}; fix or remove the sample, or pass on_bad_sample='skip' to leave bad "
                "samples out (they are counted in loader.skipped)"
                + (f" ({len(bad_rows) - 1} more in this batch)" if len(bad_rows) > 1 else "")
            )
        keep = [i for i in range(n) if i not in bad_rows]
        for i in sorted(bad_rows):
            owner.found.add(bad_rows[i])
        if ROW in outputs:  # the row function's columns are the batch
            done = outputs.pop(ROW)
            rows_out = [done[i] for i in keep]
            return {k: _stacked([_numeric(r[k]) for r in rows_out]) for k in (rows_out[0] if rows_out else {})}
        out = {k: v for k, v in batch.items()}
        for name, values in outputs.items():
            out[name] = _stacked([values[i] for i in keep])
        if bad_rows:
            out = _without(out, keep, set(outputs))
        return out

    def _reason(self, column: str, i: int, reason: str) -> str:
        row = int(self._rows[i])
        named = ""
        for c in _NAMING_COLUMNS:
            v = self._batch.get(c)
            if isinstance(v, list) and i < len(v) and isinstance(v[i], str):
                named = f", {c}={v[i]!r}"
                break
        what = "the row's transform (decode[ROW], a TransformSpec)" if column == ROW else f"column {column!r}"
        return f"{what}, row {row} ({self._owner.where(row)}{named}): {reason}"


def _numeric(value: Any) -> Any:
    """Numbers as 0-d arrays (a batch of them stacks to a 1-D tensor); anything else as it is."""
    return np.asarray(value) if isinstance(value, (int, float, bool, np.number, np.bool_)) else value


def _row_dicts(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """The batch's rows, each a dict of its values: numbers and arrays as numpy, the rest as read."""
    import torch

    columns = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    n = len(next(iter(columns.values()))) if columns else 0
    return [{k: v[i] for k, v in columns.items()} for i in range(n)]


def _stacked(values: list[Any]) -> Any:
    """Equal-shaped arrays or tensors as one tensor ``[n, ...]``; anything else as the list."""
    import torch

    if not values:
        return torch.empty((0,), dtype=torch.uint8)
    first = values[0]
    kind = np.ndarray if isinstance(first, np.ndarray) else torch.Tensor
    if not all(isinstance(v, kind) and v.shape == first.shape and v.dtype == first.dtype for v in values):
        return values
    if kind is np.ndarray:
        return torch.from_numpy(np.stack(values))
    if all(v.device == first.device for v in values):
        return torch.stack(values)
    return values


def _without(batch: dict[str, Any], keep: list[int], done: set[str]) -> dict[str, Any]:
    """The batch's other columns, cut to the rows in ``keep``."""
    import torch

    index = torch.tensor(keep, dtype=torch.int64)
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if k in done:
            out[k] = v
        elif isinstance(v, torch.Tensor):
            out[k] = v.index_select(0, index.to(v.device))
        elif isinstance(v, list):
            out[k] = [v[i] for i in keep]
        else:
            out[k] = v
    return out


__all__ = ["ROW", "Pending", "SampleFn", "SampleMap", "Skipped",
           "default_workers", "sample_rng"]
