"""Loader workers (``ds.loader(..., workers=N)``): the loader's work in child processes.

Reading and decoding row groups, the shuffle, cutting and collating batches, per-sample decoding
(``decode=``) and the user's ``transform`` run in ``N`` forked processes, so that none of it takes
the training process's GIL. The training process only maps finished batches.

**Order.** An epoch's share is read in units (shuffle windows, or about a row group without
shuffle), each a whole number of batches. Worker ``i`` plays units ``i, i + N, i + 2N, ...`` of
every epoch from the loader's position on (:meth:`Reading.epochs` with ``part``), and the
training process takes each batch from the worker whose unit it belongs to
(:meth:`Reading.unit_batches` counts them). Every worker computes its units from the plan as the
thread path does, so the rows, their order and the resume position are the thread path's, for
any ``N``. A worker reads its next unit while it serves one, and the next epoch's first during
this epoch's last.

**Shared memory** (:mod:`~sparkdl._internal.data.reading.slots`). A worker writes each finished
batch into a slot, a small pickled header (offsets, dtypes, shapes; strings and bytes columns as
values) and the tensors; a slot is an anonymous ``memfd`` it created and handed to the training
process once, over their socket (no file in ``/dev/shm``, so nothing is left behind however
either side ends). It publishes the slot's number in a ring in shared memory, where the training
process takes it without a system call; the tensors it hands out are views of the slot, not
copies. When the last tensor of a batch is let go, its slot goes back to the worker for a later
batch (through another ring), so a few slots serve the whole run, and a loop that keeps its
batches makes the worker map new slots rather than wait (and unmap them once they come back).
``prefetch`` bounds the batches the workers have ready ahead of the loop: the loop counts the
batches it took in shared memory and a worker that is ahead polls that count, so taking a batch
wakes no other process (each wake-up cost the loop 30-60 us here). Only a loop that found nothing
ready waits on the socket, and the worker then wakes it with a message when it publishes. What
the socket carries (new slots, dropped slots, the worker's error) is counted in shared memory
too, so the loop reads it only when there is something; an error is raised after the batches
the worker published before it.

**Lifetime.** Workers are children of the rank: forked when an iteration starts (and kept for
the epochs after it, like the prefetch thread), ended by :meth:`Workers.close` (``break``, a new
position, ``loader.close()``, the loader dropped), each wait bounded. A worker forked by the main
thread gets ``PR_SET_PDEATHSIG`` (SIGKILL when the rank dies, even by SIGKILL); every worker also
checks its parent while it waits for the loop, which it does within ``prefetch`` batches of a
loop that stopped taking them. An error in a worker reaches the loop as itself (a
:class:`~sparkdl.DatasetError` naming the column, as on threads); a worker that dies is named
with its exit code.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import pickle
import select
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import TYPE_CHECKING, Any

from sparkdl._internal.common import proctree
from sparkdl._internal.common.errors import DatasetError
from sparkdl._internal.data.decoding.samples import default_workers
from sparkdl._internal.data.reading.prefetch import END, DeviceCopy, Failure, Item
from sparkdl._internal.data.reading.read import Batch, pin_batch
from sparkdl._internal.data.reading.slots import Mailbox, Mapped, Returns, Slots

if TYPE_CHECKING:
    from sparkdl._internal.data.decoding.samples import SampleMap, Skipped
    from sparkdl._internal.data.reading.reshard import Reading

_POLL_S = 0.1  # how often a waiting side looks at its peer's life and the stop flag
_ROOM_POLL_S = 0.005  # the longest a worker that is ahead sleeps between two looks at the loop


def _die_with_parent(parent: int, by_main_thread: bool) -> None:
    """SIGKILL when the parent dies (Linux); only for a fork by the main thread, since the signal
    follows the forking thread's life, not the process's."""
    if by_main_thread:
        proctree.die_with_parent()
    if os.getppid() != parent:  # it died before the signal was set
        os._exit(1)


def _wait_for_room(taken: Any, i: int, sent: int, ahead: int, stop: Any, parent: int) -> bool:
    """Waits until fewer than ``ahead`` of worker ``i``'s batches are untaken; False when told to
    stop or orphaned. It polls (the loop never signals), backing off to ``_ROOM_POLL_S``, which
    the other ``ahead - 1`` ready batches cover, as does any step that takes longer."""
    pause = 0.0002
    while sent - taken[i] >= ahead:
        if stop.is_set() or os.getppid() != parent:
            return False
        time.sleep(pause)
        pause = min(pause * 2, _ROOM_POLL_S)
    return True


def _work(source: Reading, part: tuple[int, int], epoch: int, step: int, conn: Connection, taken: Any,
          returns: Returns, mailbox: Mailbox, ahead: int, stop: Any, parent: int, by_main_thread: bool,
          found: Skipped | None) -> None:
    """A worker: its units' batches, epoch after epoch, into slots, until stopped or orphaned;
    each with the bad samples its decoding met (``found``) while it was made."""
    _die_with_parent(parent, by_main_thread)
    import torch

    torch.set_num_threads(1)  # a process of its own, as torch's DataLoader workers
    import pyarrow

    # Arrow decodes a row group's columns on its own threads: each worker gets its share of the
    # cores rather than all of them (2 workers on 2 cores: 6-10% less peak memory, same rows/s).
    pyarrow.set_cpu_count(max(1, default_workers() // part[1]))
    # Arrow's own pool (mimalloc) stays: with the system allocator a worker read 0.6-0.7x as
    # fast (every row group's buffers mapped and faulted in afresh) for the same peak memory,
    # and handing its free memory back after each batch (release_unused) saved 35-45 MiB of a
    # worker's peak but read 0.6-0.75x as fast.
    slots, sent = Slots(conn, parent, returns, mailbox, keep=ahead + 2), 0
    mark = found.mark() if found is not None else (0, 0)
    items, given = source.epochs(epoch, step, part), 0

    def orphaned() -> bool:
        return stop.is_set() or os.getppid() != parent

    try:
        for batch in items:
            if batch is None:  # the end of an epoch
                if not given and step == 0 and not (source.resume is not None and source.resume.epoch == epoch):
                    return  # more workers than an epoch's units: this one has none in any epoch
                epoch, step, given = epoch + 1, 0, 0
                continue
            given += 1
            met: tuple[Any, ...] = ()
            if found is not None:
                met, mark = found.since(mark)
            slot = slots.pack(batch, met)
            del batch
            if not _wait_for_room(taken, part[0], sent, ahead, stop, parent):
                return
            sent += 1
            waits = mailbox.publish(slot, orphaned)
            if waits is None:
                return
            if waits:  # the loop found nothing and waits on the socket
                mailbox.sent()
                conn.send(("wake",))
    except BaseException as exc:  # handed to the training process, which raises it after the batches before it
        with contextlib.suppress(Exception):
            try:
                failure = pickle.dumps(exc)
            except Exception:
                failure = pickle.dumps(DatasetError(f"{type(exc).__name__}: {exc}"))
            mailbox.sent()
            conn.send(("failure", failure))
    finally:
        items.close()
        with contextlib.suppress(Exception):
            conn.close()


class Workers:
    """``workers`` processes playing ``source`` from ``(epoch, step)`` on, epoch after epoch; the
    training process's side. ``get()`` gives the next item as :class:`~sparkdl._internal.data.reading.prefetch.Pump`
    does (a batch, the end of an epoch, or a failure), pinned with ``pin``, copied with ``copy``.
    ``samples``: the workers' bad samples (``on_bad_sample="skip"``) are counted in its
    ``skipped`` as their batches are taken."""

    JOIN_S = 2.0
    """How long :meth:`close` lets the workers end on their own before it kills them."""

    def __init__(self, source: Reading, epoch: int, step: int, *, workers: int, prefetch: int, pin: bool,
                 copy: DeviceCopy | None, samples: SampleMap | None) -> None:
        context = multiprocessing.get_context("fork")
        self._source, self._copy, self._pin = source, copy, pin
        self._skipped = samples.skipped if samples is not None else None
        self._stop = context.Event()
        self._polls: list[select.poll] = []
        self._conns: list[Connection] = []
        # Batches each worker handed over that the loop took: written here, read by the worker,
        # in shared memory, so that taking a batch costs the loop no system call and no wake-up.
        self._taken = context.RawArray(ctypes.c_int64, workers)
        self._returns = [Returns(context) for _ in range(workers)]
        self._mapped = Mapped(self._returns)
        ahead = max(1, -(-prefetch // workers))
        self._mailboxes = [Mailbox(context, ahead + 2) for _ in range(workers)]
        self._read = [0] * workers  # messages read from each worker's socket
        self._failed: list[BaseException | None] = [None] * workers  # raised once its batches before it are taken
        self._procs: list[Any] = []
        self._closed = False
        by_main = threading.current_thread() is threading.main_thread()
        for i in range(workers):
            mine, theirs = context.Pipe(duplex=True)
            proc = context.Process(
                target=_work, name=f"sparkdl-loader-{i}", daemon=True,
                args=(source, (i, workers), epoch, step, theirs, self._taken, self._returns[i], self._mailboxes[i], ahead,
                      self._stop, os.getpid(), by_main, samples.found if samples is not None else None))
            proc.start()
            theirs.close()
            self._conns.append(mine)
            self._polls.append(select.poll())
            self._polls[-1].register(mine.fileno(), select.POLLIN)
            self._procs.append(proc)
        self._order = self._schedule(epoch, step, workers)

    @property
    def pids(self) -> list[int]:
        """The workers' process ids."""
        return [p.pid for p in self._procs]

    def _schedule(self, epoch: int, step: int, workers: int) -> Iterator[int | None]:
        """The worker of each batch in turn, None at each epoch's end."""
        while True:
            for j, count in enumerate(self._source.unit_batches(epoch, step)):
                for _ in range(count):
                    yield j % workers
            yield None
            epoch, step = epoch + 1, 0

    def get(self) -> Item:
        if self._closed:
            return Failure(DatasetError("the loader's workers were closed"))
        w = next(self._order)
        if w is None:
            return END
        try:
            batch = self._receive(w)
        except BaseException as exc:
            return Failure(exc)
        if batch is None:
            self._procs[w].join(self.JOIN_S)  # its socket closed: its exit code comes at once
            code = self._procs[w].exitcode
            how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
            return Failure(DatasetError(f"the loader's worker process {w} (pid {self._procs[w].pid}) {how} "
                                         "before it handed over its batch; its output (stderr) says why"))
        if self._pin:
            pin_batch(batch)
        return self._copy.start(batch) if self._copy is not None else batch

    def _receive(self, w: int) -> Batch | None:
        """The next batch from worker ``w``: None when it died; its error raised (after the
        batches it published before it)."""
        if not self._closed:
            self._mapped.give_back(self._conns)
        mailbox, proc = self._mailboxes[w], self._procs[w]
        while True:
            if mailbox.messages() != self._read[w] and not self._read_messages(w):
                return None
            slot = mailbox.take(self._taken[w])
            if slot is not None:
                while not self._mapped.has(w, slot):  # its ("slot", ...) message came before it: read it
                    if not self._read_messages(w, wait=True):
                        return None
                self._taken[w] += 1
                batch, met = self._mapped.unpack(w, slot)
                if met and met[0] and self._skipped is not None:
                    self._skipped.merge(*met)
                return batch
            failed = self._failed[w]
            if failed is not None:
                raise failed
            # Nothing published: the worker wakes the loop by a message when it publishes.
            # Bounded by the worker's life: it publishes a batch, sends its error, or ends.
            # One poll object per worker, kept: Connection.poll builds a selector each call.
            readable = self._polls[w].poll(_POLL_S * 1000)
            if mailbox.messages() != self._read[w]:
                continue
            if not proc.is_alive():  # it ended: what it published and sent before is all there is
                if mailbox.take(self._taken[w]) is None and mailbox.messages() == self._read[w]:
                    return None
            elif readable:  # messages are counted before they are sent: its socket closed as it ends
                time.sleep(0.001)

    def _read_messages(self, w: int, wait: bool = False) -> bool:
        """Reads worker ``w``'s messages counted so far (with ``wait``, at least one, waiting for
        it): new slots mapped, dropped ones let go, its error kept to raise after the batches it
        published before it. False when its socket closed (it died)."""
        conn = self._conns[w]
        while self._read[w] < self._mailboxes[w].messages() or wait:
            wait = False
            while not self._polls[w].poll(_POLL_S * 1000):
                if not self._procs[w].is_alive() and not conn.poll(0):
                    return False
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return False
            self._read[w] += 1
            kind = message[0]
            if kind == "slot":
                _, slot, size = message
                fd = recv_handle(conn)
                try:
                    self._mapped.add(w, slot, fd, size)
                finally:
                    os.close(fd)
            elif kind == "drop":
                self._mapped.drop(w, message[1])
            elif kind == "failure":
                self._failed[w] = pickle.loads(message[1])
        return True

    def close(self) -> None:
        """Ends the workers (killed if they do not end within ``JOIN_S``) and lets their slots go
        once the loop's tensors do."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for conn in self._conns:
            conn.close()
        deadline = time.monotonic() + self.JOIN_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(self.JOIN_S)
        for proc in self._procs:
            with contextlib.suppress(ValueError):
                proc.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


__all__ = ["Workers"]
