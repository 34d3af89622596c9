"""Prefetch: an epoch's batches, prepared ahead by a background thread, and moved to the device.

A :class:`Pump` is the thread: it plays an epoch from a step into a bounded queue and then goes
on into the next epochs, each from its start (the queue bounds how far ahead it gets); the next
epoch's first window is read while this epoch's last is served, so an epoch does not begin by
waiting for a read. An :class:`Iteration` is one pass over one epoch, taken from a pump or,
without prefetch, from the batch iterator directly. The thread holds the batch source, the queue and a stop event, never
the pass or the loader, so dropping them stops it; an error in the thread is handed over and
raised in the training thread.

With a :class:`DeviceCopy` (``ds.loader(..., to_device=True)``), the thread also starts each
batch's copy to the device: on CUDA, from pinned memory, with ``non_blocking`` copies on a side
stream, so that the copies of the next batches run while the GPU computes the current step. The
training thread, when it takes a batch, makes its own current stream wait for that batch's copy
(an event, not a host wait) and records the tensors' use on that stream, so that the caching
allocator does not hand their memory out again before the step that uses them is done.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from sparkdl._internal.common.errors import ConfigError, DatasetError
from sparkdl._internal.data.reading.read import Batch

if TYPE_CHECKING:
    import torch

    from sparkdl._internal.data.decoding.samples import SampleMap, Skipped

class Source(Protocol):
    """What a pump plays: ``epochs(epoch, step)``, the batches of ``epoch`` from ``step`` on,
    then of each epoch after it, None at the end of each (:meth:`~sparkdl._internal.data.reading.reshard.Reading.epochs`)."""

    def epochs(self, epoch: int, step: int) -> Generator[Batch | None, None, None]: ...


class _End:
    pass


class Failure:
    """An error of the batches' producer (thread or worker process), for the consumer to raise."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Copying:
    """A batch whose copies to ``device`` were issued; ``event`` marks their end (CUDA only)."""

    def __init__(self, batch: Batch, device: torch.device, event: Any) -> None:
        self.batch = batch
        self.device = device
        self.event = event

    def ready(self) -> Batch:
        """The batch, ready for work queued from now on in the calling thread (no host wait)."""
        if self.event is None:
            return self.batch
        import torch

        current = torch.cuda.current_stream(self.device)
        current.wait_event(self.event)
        for value in self.batch.values():
            if isinstance(value, torch.Tensor) and value.is_cuda:
                value.record_stream(current)
        return self.batch


class DeviceCopy:
    """Moves the tensors of each batch to ``device``; lists (strings, bytes) stay as they are.

    :meth:`start` runs where batches are prepared (the prefetch thread) and issues the copies;
    the training thread calls ``ready()`` on what it returned when the batch is handed out. On
    CUDA the copies go on a side stream of their own, and ``ready()`` orders the caller's current
    stream after them and marks the tensors as used there; elsewhere ``start`` copies at once.
    """

    def __init__(self, device: torch.device) -> None:
        import torch

        self.device = device
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def start(self, batch: Batch) -> _Copying:
        import torch

        if self._stream is None:
            return _Copying({k: _moved(v, self.device) for k, v in batch.items()}, self.device, None)
        with torch.cuda.stream(self._stream):
            moved = {k: _moved(v, self.device) for k, v in batch.items()}
            event = torch.cuda.Event()
            event.record(self._stream)
        # The pinned host memory of the sources is not reused before the copies end: torch's
        # pinned-memory allocator records each copy on its stream.
        return _Copying(moved, self.device, event)


def _moved(value: Any, device: torch.device) -> Any:
    import torch

    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value


def device_and_pin(device: Any, pin_memory: bool | None, to_device: bool, default: Callable[[], Any]) -> tuple[Any, bool]:
    """The batches' device (``torch.device``; CUDA with its index when batches go there) and
    whether to pin memory. ``default()`` gives the device when ``device`` is None."""
    import torch

    target, cuda = torch.device(device if device is not None else default()), torch.cuda.is_available()
    if to_device and target.type == "cuda" and not cuda:
        raise ConfigError(f"to_device=True with device={device!r}, but torch.cuda.is_available() is False "
                          "here; pass device='cpu', or leave to_device out")
    if to_device and target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    pin = target.type == "cuda" if pin_memory is None else bool(pin_memory)
    return target, pin and cuda


END = _End()
"""The end of an epoch, in a pump's stream of items."""
Item: TypeAlias = Batch | _Copying | _End | Failure
"""What a pump hands over: a batch (or its copy under way), an epoch's end, or a failure."""


_Found: TypeAlias = tuple[int, list[str]]
"""Bad samples met while a batch was made (``on_bad_sample="skip"``): a count and examples."""
_NONE_FOUND: _Found = (0, [])


def _pump(source: Source, epoch: int, step: int, out: queue.Queue[tuple[Item, _Found]], stop: threading.Event,
          copy: DeviceCopy | None, found: Skipped | None) -> None:
    """The background thread: epoch after epoch into the bounded queue, until told to stop; each
    item with the bad samples met while it was made (from ``found``)."""
    mark = found.mark() if found is not None else (0, 0)

    def put(item: Item) -> bool:
        nonlocal mark
        met = _NONE_FOUND
        if found is not None:
            met, mark = found.since(mark)
        while not stop.is_set():
            try:
                out.put((item, met), timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    items = source.epochs(epoch, step)
    try:
        for batch in items:
            if not put(END if batch is None else copy.start(batch) if copy is not None else batch):
                return
    except BaseException as exc:  # handed to the consumer, which raises it in the training thread
        put(Failure(exc))
    finally:
        items.close()


class Pump:
    """A thread that prepares the batches of ``epoch`` from ``step`` on, then of the epochs
    after it, into a queue of ``prefetch`` batches (with ``copy``, on the device). With
    ``samples``, the bad samples its decoding met (``samples.found``) are counted in
    ``samples.skipped`` as their batches are taken, not as they are made ahead."""

    _JOIN_S = 5.0

    def __init__(self, source: Source, epoch: int, step: int, prefetch: int, copy: DeviceCopy | None,
                 samples: SampleMap | None = None) -> None:
        self._queue: queue.Queue[tuple[Item, _Found]] = queue.Queue(maxsize=max(1, prefetch))
        self._stop = threading.Event()
        self._closed = False
        self._skipped = samples.skipped if samples is not None else None
        # The thread holds the source, the queue and the event, never this object.
        self._thread = threading.Thread(target=_pump, name="sparkdl-prefetch", daemon=True,
                                        args=(source, epoch, step, self._queue, self._stop, copy,
                                              samples.found if samples is not None else None))
        self._thread.start()

    def get(self) -> Item:
        while True:
            try:
                return self._taken(self._queue.get(timeout=0.5))
            except queue.Empty:
                # Bounded by the thread's life: it always leaves an item before it ends.
                if not self._thread.is_alive():
                    try:
                        return self._taken(self._queue.get_nowait())
                    except queue.Empty:
                        return Failure(DatasetError("the loader's reader thread ended without a result"))

    def _taken(self, entry: tuple[Item, _Found]) -> Item:
        item, met = entry
        if met[0] and self._skipped is not None:
            self._skipped.merge(*met)
        return item

    def close(self) -> None:
        """Stops the thread and drops the batches it prepared."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
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


class Feed(Protocol):
    """What a pass takes its items from: a :class:`Pump`, or the loader's worker processes."""

    def get(self) -> Item: ...

    def close(self) -> None: ...


class Iteration:
    """One pass over an epoch: from a :class:`Pump`, or from the batch iterator itself.

    A pass that runs to its end leaves its pump running into the next epoch, for the owner to
    hand to the next pass; one closed before its end stops it. Without a pump, ``copy`` moves
    each batch to its device when it is asked for. ``on_batch(self)`` is called after each batch
    is handed out and ``on_end(self)`` when the pass runs to its end. Both must be bound methods:
    they are held weakly, since the owner (the loader) holds its active pass and must stay
    collectable by refcount.
    """

    def __init__(
        self,
        batches: Feed | Iterator[Batch],
        *,
        on_batch: Callable[[Iteration], None],
        on_end: Callable[[Iteration], None],
        copy: DeviceCopy | None = None,
    ) -> None:
        self._callbacks: tuple[weakref.WeakMethod[Callable[[Iteration], None]], ...] | None = (
            weakref.WeakMethod(on_batch),
            weakref.WeakMethod(on_end),
        )
        self._closed = False
        self._ended = False
        # A pump (the prefetch thread, or the worker processes: anything with get() and close()),
        # or the batch iterator itself.
        self._pump = None if isinstance(batches, Iterator) else batches
        self._batches = batches if isinstance(batches, Iterator) else None
        self._copy = copy

    def __iter__(self) -> Iteration:
        return self

    def __next__(self) -> Batch:
        if self._closed:
            raise StopIteration
        item = self._next_item()
        on_batch, on_end = (ref() for ref in self._callbacks) if self._callbacks is not None else (None, None)
        if isinstance(item, _End):
            self._ended = True
            self.close()
            if on_end is not None:
                on_end(self)
            raise StopIteration
        if isinstance(item, Failure):
            self.close()
            raise item.exc
        batch = item.ready() if isinstance(item, _Copying) else item
        if on_batch is not None:
            on_batch(self)
        return batch

    def _next_item(self) -> Item:
        if self._pump is not None:
            return self._pump.get()
        if self._batches is None:
            return END
        try:
            batch = next(self._batches)
            return self._copy.start(batch) if self._copy is not None else batch
        except StopIteration:
            return END
        except BaseException as exc:
            return Failure(exc)

    def close(self) -> None:
        """Ends the pass: stops its pump unless the pass ran to its end, closes its iterator."""
        if self._closed:
            return
        self._closed = True
        self._callbacks = None
        if self._batches is not None:
            close = getattr(self._batches, "close", None)
            if close is not None:
                close()
            self._batches = None
        if self._pump is not None:
            if not self._ended:
                self._pump.close()
            self._pump = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
