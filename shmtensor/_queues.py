"""Queue, JoinableQueue and SimpleQueue whose messages carry arrays through shared memory.

They are the stdlib's classes (``isinstance`` and every method work as documented) on a
socket pair instead of a pipe.  ``put`` pickles at once, in the caller's thread, with
shmtensor's reducers: an unpicklable object raises in ``put`` rather than in the feeder
thread, and a large array is copied into shared memory before ``put`` returns, so the
caller may reuse its buffer.  While the reader keeps up, ``put`` also sends in the
caller's thread (a non-blocking send when nothing is waiting for the feeder): no thread
hand-off per message.  When the socket is full, frames wait for the feeder as in the
stdlib, in order.  ``put`` and ``get`` are adapted from CPython 3.11's.
"""

from __future__ import annotations

import functools
import time
from multiprocessing import queues as _mpq
from queue import Empty, Full

from shmtensor.ipc import scm_rights

from . import _reductions
from ._connection import Connection, Pipe, _stash


class Frame:
    """A message pickled in ``put``; the feeder thread hands it to the socket as it is."""

    __slots__ = ("data", "ctx")

    def __init__(self, data, ctx: _reductions.SendContext) -> None:
        self.data, self.ctx = data, ctx

    def __reduce__(self):
        # The feeder 'pickles' each item and sends the result right away, in its thread:
        # leave the frame for Connection._send_stashed and give the feeder a stand-in.
        _stash.frame = self
        return (int, ())


def _feeder_send(writer: Connection, notempty, unsent: list, pickled) -> None:
    """The feeder thread's send: the stashed frame, then one fewer frame waiting for it."""
    try:
        writer._send_stashed(pickled)
    finally:
        with notempty:
            unsent[0] -= 1


class _ShmQueue:
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._reader.close()
        self._writer.close()
        self._reader, self._writer = Pipe(duplex=False)
        self._reset()

    def _reset(self, after_fork: bool = False) -> None:
        super()._reset(after_fork) if after_fork else super()._reset()
        self._unsent = [0]  # frames given to the feeder and not yet sent (under _notempty)
        if isinstance(self._writer, Connection):  # not yet during the stdlib's __init__
            # not a bound method: the feeder thread must not keep the queue alive
            self._send_bytes = functools.partial(_feeder_send, self._writer, self._notempty,
                                                 self._unsent)

    def _send_now(self, data, ctx: _reductions.SendContext) -> bool:
        """Send a message in this thread if that keeps the queue's order and the socket
        takes it whole at once (caller holds ``_notempty``); False leaves it to the feeder
        thread, which also meets any error as the stdlib's does."""
        sock = self._writer._sock
        if self._unsent[0] or sock is None or len(data) > scm_rights.ATOMIC_MAX:
            return False
        wlock = self._wlock
        if wlock is not None and not wlock.acquire(False):
            return False
        try:
            sent = scm_rights.try_send_frame(sock, data, ctx.wire_fds())
        except OSError:  # no fds left, reader gone, ...: as the feeder would meet it
            return False
        finally:
            if wlock is not None:
                wlock.release()
        if sent:
            ctx.release()
        return sent

    def put(self, obj, block: bool = True, timeout: float | None = None) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        data, ctx = _reductions.dumps(obj)
        if not self._sem.acquire(block, timeout):
            ctx.release()
            raise Full
        joinable = getattr(self, "_cond", None)
        if joinable is not None:  # counted first, as the stdlib does, but not held while sending
            with joinable:
                self._unfinished_tasks.release()
        with self._notempty:
            if self._send_now(data, ctx):
                return
            if self._thread is None:
                self._start_thread()
            self._unsent[0] += 1
            self._buffer.append(Frame(data, ctx))
            self._notempty.notify()

    def close(self) -> None:
        """As the stdlib's; with no feeder thread ever started, close the socket here."""
        super().close()
        if self._thread is None:
            self._reader.close()
            self._writer.close()

    def get(self, block: bool = True, timeout: float | None = None):
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        if block and timeout is None:
            with self._rlock:
                data, fds = self._reader.recv_frame()
            self._sem.release()
        else:
            if block:
                deadline = time.monotonic() + timeout
            if not self._rlock.acquire(block, timeout):
                raise Empty
            try:
                if block:
                    timeout = deadline - time.monotonic()
                    if not self._poll(timeout):
                        raise Empty
                elif not self._poll():
                    raise Empty
                data, fds = self._reader.recv_frame()
                self._sem.release()
            finally:
                self._rlock.release()
        return _reductions.loads(data, fds)


class Queue(_ShmQueue, _mpq.Queue):
    """``multiprocessing.Queue`` that moves arrays through shared memory."""


class JoinableQueue(_ShmQueue, _mpq.JoinableQueue):
    """``multiprocessing.JoinableQueue`` that moves arrays through shared memory."""


class SimpleQueue(_mpq.SimpleQueue):
    """``multiprocessing.SimpleQueue`` that moves arrays through shared memory."""

    def __init__(self, *, ctx) -> None:
        super().__init__(ctx=ctx)
        self._reader.close()
        self._writer.close()
        self._reader, self._writer = Pipe(duplex=False)
        self._poll = self._reader.poll

    def get(self):
        with self._rlock:
            data, fds = self._reader.recv_frame()
        return _reductions.loads(data, fds)

    def put(self, obj) -> None:
        data, ctx = _reductions.dumps(obj)
        try:
            if self._wlock is None:
                self._writer.send_frame(data, ctx.wire_fds())
            else:
                with self._wlock:
                    self._writer.send_frame(data, ctx.wire_fds())
        finally:
            ctx.release()
