"""Prefetch: one pass over an epoch's batches, prepared ahead by a background thread.

The thread holds the batch generator, a bounded queue and a stop event, never the pass or the
loader, so dropping either stops it; an error in the thread is handed over and raised in the
training thread.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TypeAlias

from sparkdl.data.read import Batch
from sparkdl.errors import DatasetError


class _End:
    pass


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = _End()
_Item: TypeAlias = Batch | _End | _Failure


def _pump(batches: Iterator[Batch], out: queue.Queue[_Item], stop: threading.Event) -> None:
    """The background thread: moves batches into the bounded queue until done or told to stop."""

    def put(item: _Item) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        for batch in batches:
            if not put(batch):
                return
        put(_END)
    except BaseException as exc:  # handed to the consumer, which raises it in the training thread
        put(_Failure(exc))
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


class Iteration:
    """One pass over an epoch; with ``prefetch`` > 0 a background thread prepares the batches.

    ``on_batch(self)`` is called after each batch is handed out and ``on_end(self)`` when the
    pass runs to its end. Both must be bound methods: they are held weakly, since the owner
    (the loader) holds its active pass and must stay collectable by refcount.
    """

    _JOIN_S = 5.0

    def __init__(
        self,
        batches: Iterator[Batch],
        prefetch: int,
        *,
        on_batch: Callable[[Iteration], None],
        on_end: Callable[[Iteration], None],
    ) -> None:
        self._callbacks: tuple[weakref.WeakMethod[Callable[[Iteration], None]], ...] | None = (
            weakref.WeakMethod(on_batch),
            weakref.WeakMethod(on_end),
        )
        self._closed = False
        self._stop = threading.Event()
        self._batches: Iterator[Batch] | None = None
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=max(1, prefetch))
        if prefetch > 0:
            # The thread holds the generator, the queue and the event, never this object, so
            # dropping the iteration stops the thread.
            self._thread = threading.Thread(
                target=_pump, args=(batches, self._queue, self._stop), name="sparkdl-prefetch", daemon=True
            )
            self._thread.start()
        else:
            self._batches = batches

    def __iter__(self) -> Iteration:
        return self

    def __next__(self) -> Batch:
        if self._closed:
            raise StopIteration
        item = self._next_item()
        on_batch, on_end = (ref() for ref in self._callbacks) if self._callbacks is not None else (None, None)
        if isinstance(item, _End):
            self.close()
            if on_end is not None:
                on_end(self)
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        if on_batch is not None:
            on_batch(self)
        return item

    def _next_item(self) -> _Item:
        if self._batches is not None:
            try:
                return next(self._batches)
            except StopIteration:
                return _END
            except BaseException as exc:
                return _Failure(exc)
        thread = self._thread
        while True:
            try:
                return self._queue.get(timeout=0.5)
            except queue.Empty:
                # Bounded by the reader thread's life: it always leaves an item before it ends.
                if thread is None or not thread.is_alive():
                    try:
                        return self._queue.get_nowait()
                    except queue.Empty:
                        return _Failure(DatasetError("the loader's reader thread ended without a result"))

    def close(self) -> None:
        """Stops the background thread and drops prepared batches."""
        if self._closed:
            return
        self._closed = True
        self._callbacks = None
        self._stop.set()
        if self._batches is not None:
            close = getattr(self._batches, "close", None)
            if close is not None:
                close()
            self._batches = None
        if self._thread is not None:
            while True:  # drain so a blocked put returns at once
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            if self._thread is not threading.current_thread():
                self._thread.join(self._JOIN_S)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
