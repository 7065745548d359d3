"""Queue, JoinableQueue and SimpleQueue whose messages carry arrays through shared memory.

They are the stdlib's classes (``isinstance`` and every method work as documented) on a
socket pair instead of a pipe.  ``put`` pickles at once, in the caller's thread, with
shmtensor's reducers: an unpicklable object raises in ``put`` rather than in the feeder
thread, and a large array is copied into shared memory before ``put`` returns, so the
caller may reuse its buffer.  ``get`` is adapted from CPython 3.11's ``Queue.get``.
"""

from __future__ import annotations

import time
from multiprocessing import queues as _mpq
from queue import Empty

from . import _reductions
from ._connection import Connection, Pipe, _stash


class Frame:
    """A message pickled in ``put``; the feeder thread hands it to the socket as it is."""

    __slots__ = ("data", "ctx")

    def __init__(self, obj) -> None:
        self.data, self.ctx = _reductions.dumps(obj)

    def __reduce__(self):
        # The feeder 'pickles' each item and sends the result right away, in its thread:
        # leave the frame for Connection._send_stashed and give the feeder a stand-in.
        _stash.frame = self
        return (int, ())


class _ShmQueue:
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._reader.close()
        self._writer.close()
        self._reader, self._writer = Pipe(duplex=False)
        self._reset()

    def _reset(self, after_fork: bool = False) -> None:
        super()._reset(after_fork) if after_fork else super()._reset()
        if isinstance(self._writer, Connection):  # not yet during the stdlib's __init__
            self._send_bytes = self._writer._send_stashed

    def put(self, obj, block: bool = True, timeout: float | None = None) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        super().put(Frame(obj), block, timeout)

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
