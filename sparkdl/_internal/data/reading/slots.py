"""Shared-memory slots: how a loader worker hands batches to the training process
(:mod:`sparkdl._internal.data.reading.workers`).

A slot is an anonymous ``memfd`` a worker created and handed over once, by its file descriptor
(no file in ``/dev/shm``, so nothing is left behind however either side ends). A worker writes a
batch into a free slot, a small pickled header (offsets, dtypes, shapes; strings and bytes
columns as values) and then its tensors (:class:`Slots`), and publishes the slot's number in a
ring in shared memory (:class:`Mailbox`); the training process takes it from there, with no
system call, and makes the batch of views of the slot, no copy (:class:`Mapped`). When the last
of them is let go the slot goes back to its worker through another ring (:class:`Returns`), or
by message past it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import pickle
import struct
import weakref
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any

import numpy as np

from sparkdl._internal.data.reading.read import Batch

ALIGN = 64  # every tensor of a slot starts on a cache line (and any dtype's alignment)
LOCK_S = 0.1  # the longest either side waits for a ring's lock (held for a few stores, unless its holder died)
HEADER = struct.Struct("<q")
"""The length of a slot's pickled header, at its start; the tensors follow from the next ``ALIGN``."""
NUMPY = {name: np.dtype(name) for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32",
                                            "float64", "complex64", "complex128")}
"""torch dtypes (by name) that numpy has too."""


class Returns:
    """Slots the loop let go, on their way back to one worker: a ring of slot numbers in shared
    memory, under a lock neither side holds for more than a few stores. Unlike a message, this
    costs the training process no system call and wakes nobody (a wake-up between processes
    cost 30-60 us of the loop's CPU per batch here, more than the rest of a hand-over)."""

    SIZE = 256

    def __init__(self, context: Any) -> None:
        self._ring = context.RawArray(ctypes.c_int64, self.SIZE)
        self._counts = context.RawArray(ctypes.c_int64, 3)  # slots written, slots read, messages sent
        self._lock = context.Lock()

    def put(self, slots: list[int]) -> list[int]:
        """Puts in what fits; gives back the rest (then sent as a message)."""
        if not self._lock.acquire(timeout=LOCK_S):  # its worker died holding it
            return slots
        try:
            written, read = self._counts[0], self._counts[1]
            room = self.SIZE - (written - read)
            for slot in slots[:room]:
                self._ring[written % self.SIZE] = slot
                written += 1
            self._counts[0] = written
        finally:
            self._lock.release()
        return slots[room:]

    def sent_by_message(self) -> None:
        """Counts a message of slots that did not fit, for :meth:`messages` to tell."""
        self._counts[2] += 1  # only the training process writes it

    def messages(self) -> int:
        """Messages of slots sent so far (the worker reads its socket when this grows)."""
        return int(self._counts[2])

    def take(self) -> list[int]:
        """The slots put in since the last take."""
        if not self._lock.acquire(timeout=LOCK_S):
            return []
        try:
            written, read = self._counts[0], self._counts[1]
            self._counts[1] = written
            return [self._ring[i % self.SIZE] for i in range(read, written)]
        finally:
            self._lock.release()


class Mailbox:
    """The batches one worker published, by slot, for the training process to take in order: a
    ring of slot numbers in shared memory, a count of the batches published, a count of the
    worker's messages (new slots, dropped slots, its error: read from its socket when this
    grows), and whether the loop waits, under a lock neither side holds for more than a few
    loads and stores (which also orders the slot's contents before its number, on any CPU).

    Taking a batch costs the loop no system call; the worker wakes the loop with a message only
    when the loop found nothing and said that it waits."""

    def __init__(self, context: Any, capacity: int) -> None:
        self._capacity = capacity  # more than the batches a worker may have untaken (its `ahead`)
        self._ring = context.RawArray(ctypes.c_int64, capacity)
        self._counts = context.RawArray(ctypes.c_int64, 3)  # published, messages sent, the loop waits
        self._lock = context.Lock()

    def publish(self, slot: int, orphaned: Callable[[], bool]) -> bool | None:
        """Publishes the batch in ``slot`` (the worker's side): True when the loop waits for it
        (the worker then sends a wake-up), None when ``orphaned()`` while the lock is not had."""
        while not self._lock.acquire(timeout=LOCK_S):
            if orphaned():
                return None
        try:
            n = self._counts[0]
            self._ring[n % self._capacity] = slot
            self._counts[0] = n + 1
            waits, self._counts[2] = bool(self._counts[2]), 0
        finally:
            self._lock.release()
        return waits

    def sent(self) -> None:
        """Counts a message the worker is about to write to its socket (only the worker writes this
        count; counted first, so that a loop woken by the message finds it counted)."""
        self._counts[1] += 1

    def messages(self) -> int:
        """The worker's messages so far."""
        return int(self._counts[1])

    def take(self, index: int) -> int | None:
        """The slot of the worker's batch number ``index`` (from 0) when it is published (the
        loop's side); else None, and the worker is asked to wake the loop when it publishes."""
        if not self._lock.acquire(timeout=LOCK_S):  # its worker died holding it: the loop's wait finds out
            return None
        try:
            if self._counts[0] > index:
                self._counts[2] = 0
                return int(self._ring[index % self._capacity])
            self._counts[2] = 1
            return None
        finally:
            self._lock.release()


class Slots:
    """A worker's slots: memfd mappings, each handed to the training process once by its number
    (a ``("slot", number, size)`` message, then its file descriptor), over ``conn``; ``keep``:
    the free slots kept for later batches (the rest are unmapped, and ``("drop", number)`` sent).
    Each message is counted in ``mailbox`` before it is sent."""

    def __init__(self, conn: Connection, parent: int, returns: Returns, mailbox: Mailbox, keep: int) -> None:
        self._conn, self._parent, self._returns, self._mailbox, self._keep = conn, parent, returns, mailbox, keep
        self._messages = 0  # of slots, read from the socket
        self._maps: dict[int, mmap.mmap] = {}
        self._views: dict[int, Any] = {}  # a uint8 tensor over each slot, to copy batches into
        self._free: list[int] = []
        self._next = 0

    def pack(self, batch: Any, extra: tuple[Any, ...] = ()) -> int:
        """Writes the batch into a free slot: its header (with ``extra``), then its tensors; the
        slot's number, to publish."""
        import torch

        layout: dict[str, tuple[int, int, str, tuple[int, ...]]] = {}
        at = 0
        if not isinstance(batch, dict):  # a transform's own type: pickled whole
            header = pickle.dumps(("own", batch, extra), protocol=5)
        else:
            for k, v in batch.items():
                if isinstance(v, torch.Tensor) and v.device.type == "cpu":
                    n = v.numel() * v.element_size()
                    layout[k] = (at, n, str(v.dtype)[6:], tuple(v.shape))  # "torch.float32" -> "float32"
                    at += -(-n // ALIGN) * ALIGN
            rest = {k: v for k, v in batch.items() if k not in layout}
            header = pickle.dumps(("batch", layout, rest, list(batch), extra), protocol=5)
        base = _base(len(header))
        slot = self._take(base + at)
        HEADER.pack_into(self._maps[slot], 0, len(header))
        self._maps[slot][HEADER.size : HEADER.size + len(header)] = header
        whole = self._views[slot]
        for k, (offset, n, _, shape) in layout.items():
            if n:
                v = batch[k]
                whole[base + offset : base + offset + n].view(v.dtype).view(shape).copy_(v)
        return slot

    def _take(self, nbytes: int) -> int:
        self._free.extend(self._returns.take())  # slots the training process let go
        if self._returns.messages() != self._messages:  # more of them, sent when the ring was full
            while self._conn.poll(0):
                message = self._conn.recv()
                if message[0] == "free":
                    self._free.extend(message[1])
                    self._messages += 1
        # Slots beyond the few that keep the loop fed (a loop that held many batches let them
        # go) are unmapped: their memory goes back, as the thread path's batches' would.
        while len(self._free) > self._keep:
            self._drop(min(self._free, key=lambda s: len(self._maps[s])))
        fits = [s for s in self._free if len(self._maps[s]) >= nbytes]
        if fits:
            slot = min(fits, key=lambda s: len(self._maps[s]))
            self._free.remove(slot)
            return slot
        if len(self._free) > 2:  # slots too small for today's batches: let the smallest go
            self._drop(min(self._free, key=lambda s: len(self._maps[s])))
        size = max(mmap.PAGESIZE, -(-int(nbytes * 1.25) // mmap.PAGESIZE) * mmap.PAGESIZE)
        fd = os.memfd_create(f"sparkdl-loader-{self._next}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            import torch

            self._maps[self._next] = mmap.mmap(fd, size)
            self._views[self._next] = torch.frombuffer(self._maps[self._next], dtype=torch.uint8)
            self._mailbox.sent()
            self._conn.send(("slot", self._next, size))
            send_handle(self._conn, fd, self._parent)
        finally:
            os.close(fd)
        self._next += 1
        return self._next - 1

    def _drop(self, slot: int) -> None:
        self._free.remove(slot)
        del self._views[slot]
        self._maps.pop(slot).close()
        self._mailbox.sent()
        self._conn.send(("drop", slot))


def _base(header: int) -> int:
    """Where a slot's tensors start, after a header of ``header`` bytes."""
    return -(-(HEADER.size + header) // ALIGN) * ALIGN


def _released(freed: deque[tuple[int, int]], watched: dict[tuple[int, int], Any], key: tuple[int, int], _: Any) -> None:
    """A batch's tensors are gone: its slot goes back (a weakref callback; it holds no Mapped)."""
    watched.pop(key, None)
    freed.append(key)



class Mapped:
    """The training process's side: the slots of every worker, mapped; batches made of views of
    them; and the slots whose batches the loop let go, on their way back (:class:`Returns`)."""

    def __init__(self, returns: list[Returns]) -> None:
        self._returns = returns
        self.maps: list[dict[int, mmap.mmap]] = [{} for _ in returns]
        self._freed: deque[tuple[int, int]] = deque()  # (worker, slot) let go by the loop's tensors
        self._watched: dict[tuple[int, int], weakref.ref[np.ndarray]] = {}  # slots the loop holds

    def add(self, w: int, slot: int, fd: int, size: int) -> None:
        """Maps worker ``w``'s new slot (the descriptor stays the caller's to close)."""
        self.maps[w][slot] = mmap.mmap(fd, size)

    def drop(self, w: int, slot: int) -> None:
        """Lets go of a slot the worker unmapped (the mapping lasts while a tensor views it)."""
        self.maps[w].pop(slot, None)

    def has(self, w: int, slot: int) -> bool:
        """Whether worker ``w``'s ``slot`` is mapped (its ``("slot", ...)`` message was read)."""
        return slot in self.maps[w]

    def unpack(self, w: int, slot: int) -> tuple[Batch, tuple[Any, ...]]:
        """The batch that worker ``w`` wrote into ``slot``, and the ``extra`` it came with."""
        import torch

        mapped = self.maps[w][slot]
        (size,) = HEADER.unpack_from(mapped, 0)
        header = pickle.loads(mapped[HEADER.size : HEADER.size + size])
        if header[0] == "own":  # a transform's own type, unpickled: the slot goes back at once
            self._freed.append((w, slot))
            return header[1], header[2]
        _, layout, rest, keys, extra = header
        base = _base(size)
        end = base + max((offset + n for offset, n, _, _ in layout.values()), default=0)
        # One array over the slot that every tensor views; when the last tensor goes, so does it,
        # and the slot goes back to its worker.
        whole = np.frombuffer(mapped, dtype=np.uint8, count=end)
        self._watched[(w, slot)] = weakref.ref(whole, functools.partial(_released, self._freed, self._watched, (w, slot)))
        out: Batch = {}
        for k in keys:
            if k in layout:
                offset, n, dtype, shape = layout[k]
                part = whole[base + offset : base + offset + n]
                if dtype in NUMPY:  # one numpy view, then one torch call: the cheaper way
                    out[k] = torch.from_numpy(part.view(NUMPY[dtype]).reshape(shape))
                else:  # bfloat16 and the like, which numpy lacks
                    out[k] = torch.from_numpy(part).view(getattr(torch, dtype)).view(shape)
            else:
                out[k] = rest[k]
        return out, extra

    def give_back(self, conns: list[Connection]) -> None:
        """Hands the slots let go since the last call back to their workers: into their rings,
        and what does not fit as a ``("free", slots)`` message over ``conns``."""
        freed: dict[int, list[int]] = {}
        while self._freed:
            w, slot = self._freed.popleft()
            freed.setdefault(w, []).append(slot)
        for w, slots in freed.items():
            rest = self._returns[w].put(slots)
            if rest:
                with contextlib.suppress(OSError, ValueError):
                    conns[w].send(("free", rest))
                    self._returns[w].sent_by_message()


__all__ = ["ALIGN", "HEADER", "NUMPY", "Mailbox", "Mapped", "Returns", "Slots"]
