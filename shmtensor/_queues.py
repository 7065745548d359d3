"""Queue, JoinableQueue and SimpleQueue whose messages carry arrays through shared memory.

They are the stdlib's classes (``isinstance`` and every method work as documented) on a
socket pair instead of a pipe.  This module follows CPython 3.10-3.13's
``multiprocessing/queues.py``; those four differ only where this module does not reach
(3.11 added ``Queue._terminate_broken``, 3.12 guarded ``_start_thread`` against
finalization, which :meth:`_ShmQueue._start_thread` does on every version).  What it
overrides, and why:

* ``put``: pickles at once, in the caller's thread, with shmtensor's reducers (a large array
  is copied into shared memory before ``put`` returns, so the caller may reuse its buffer),
  and while nothing waits for the feeder thread it also sends there, without blocking: no
  thread hand-off per message.  Otherwise it does what the stdlib's does (closed check,
  semaphore, feeder thread started by the first put, buffer under ``_notempty``).
* ``_start_thread`` and ``_feed``: the stdlib's, but the feeder sends the frames ``put``
  made instead of pickling objects (3.10's ``_start_thread`` names ``Queue._feed`` itself,
  so both are overridden).
* ``get``: the stdlib's, receiving a frame and its fds, atomic with respect to exceptions
  (``scm_rights.FrameReader``): a message is delivered by the call that read it, or stays
  for the next ``get`` of this process, or (an exception while it is unpickled) is
  discarded with its fds closed; ``timeout`` covers the whole frame.

Errors are reported as the stdlib reports them, and resource errors are never lost:

* An object that cannot be pickled does not raise from ``put``: the feeder thread reports
  it through ``_on_queue_feeder_error(e, obj)`` (the hook subclasses override) and the
  queue goes on, as in the stdlib.
* A send that fails for want of a resource (no fd left, no shared memory, every reader
  gone) raises from ``put`` with the limit and the fix (:func:`_connection.send_error`);
  the queue stays usable.  One that only the feeder thread meets is reported through the
  hook and recorded, and the next ``put``, ``close`` or ``join_thread`` raises it.
"""

from __future__ import annotations

import errno
import sys
import threading
import time
import weakref
from itertools import starmap
from multiprocessing import queues as _mpq
from multiprocessing.util import Finalize, debug, info, is_exiting
from queue import Empty, Full

from shmtensor.ipc import scm_rights

from . import _reductions
from ._connection import Pipe, send_error

_sentinel = _mpq._sentinel  # what the stdlib's finalizer appends to stop the feeder


class Frame:
    """A message pickled by ``put``, waiting for the feeder thread; ``obj`` is what
    ``_on_queue_feeder_error`` gets if it cannot be sent: the object if the queue keeps
    them, else None (then its pickled bytes, as the stdlib's feeder gives)."""

    __slots__ = ("data", "ctx", "obj")

    def __init__(self, data, ctx: _reductions.SendContext, obj) -> None:
        self.data, self.ctx, self.obj = data, ctx, obj


class _Unpicklable:
    """An object ``put`` could not pickle: the feeder reports it in its turn, as the
    stdlib's feeder does when its own pickling fails."""

    __slots__ = ("error", "obj")

    def __init__(self, error: Exception, obj) -> None:
        self.error, self.obj = error, obj


def _with_outcome(err: BaseException, outcome: str) -> BaseException:
    """A recorded send failure, raised again by a later call that says what it did."""
    if isinstance(err, OSError) and err.errno is not None:
        new = OSError(err.errno, f"{err.strerror}; {outcome}")
    else:
        new = type(err)(f"{err}; {outcome}")
    new.__cause__ = err
    return new


class _ShmQueue:
    # Give _on_queue_feeder_error the object itself (not its pickled bytes) when a send
    # fails: a subclass that must know which object failed sets it (it keeps each queued
    # object alive until sent, as the stdlib's buffer does).
    _keep_objects = False
    # Record a send failure of the feeder for the next put(), close() or join_thread() to
    # raise; a subclass whose hook delivers every failure itself turns it off.
    _raise_later = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._reader.close()
        self._writer.close()
        self._reader, self._writer = Pipe(duplex=False)
        self._reset()

    def _reset(self, after_fork: bool = False) -> None:
        super()._reset(after_fork)
        self._unsent = [0]     # frames given to the feeder and not yet sent (under _notempty)
        self._failures = []    # send failures the feeder met, not yet raised (under _notempty)

    def _send_now(self, data, ctx: _reductions.SendContext) -> bool:
        """Send a message in this thread if that keeps the queue's order and the socket
        takes it whole at once (the caller holds ``_notempty``).  False leaves it to the
        feeder thread; a failure raises (the socket is untouched)."""
        sock = self._writer._sock
        if self._unsent[0] or sock is None or len(data) > scm_rights.ATOMIC_MAX:
            return False
        wlock = self._wlock
        if wlock is not None and not wlock.acquire(False):
            return False
        try:
            sent = scm_rights.try_send_frame(sock, data, ctx.wire_fds())
        except BrokenPipeError:
            if self._ignore_epipe:  # concurrent.futures: the feeder drops it, as in the stdlib
                return False
            raise
        finally:
            if wlock is not None:
                wlock.release()
        if sent:
            ctx.release()
        return sent

    def _raise_failures(self, outcome: str) -> None:
        """Raise the first send failure the feeder recorded (and forget them all)."""
        if not self._failures:
            return
        with self._notempty:
            failures = self._failures[:]
            self._failures.clear()
        if len(failures) > 1:
            outcome = f"{len(failures)} messages were dropped this way; {outcome}"
        raise _with_outcome(failures[0], outcome)

    def put(self, obj, block: bool = True, timeout: float | None = None) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        if self._failures:
            self._raise_failures("this put() did not queue its object; the queue is usable")
        try:
            data, ctx = _reductions.dumps(obj)
        except OSError as e:  # no fd or shared memory for a segment
            raise send_error(e, "put() failed")
        except MemoryError:  # ShmSpaceError included: it says what to do
            raise
        except Exception as e:  # cannot be pickled: reported by the feeder, as in the stdlib
            data, ctx = None, None
            item = _Unpicklable(e, obj)
        if not self._sem.acquire(block, timeout):
            if ctx is not None:
                ctx.release()
            raise Full
        joinable = getattr(self, "_cond", None)
        if joinable is not None:  # counted first, as the stdlib does, but not held while sending
            with joinable:
                self._unfinished_tasks.release()
        with self._notempty:
            if self._thread is None:  # on first put, as the stdlib's, even if it sends here
                try:
                    self._start_thread()
                except BaseException:  # gh-109047: no thread at finalization
                    if ctx is not None:
                        ctx.release()
                    self._undo_put(joinable)
                    raise
            if data is not None:
                try:
                    if self._send_now(data, ctx):
                        return
                except OSError as e:
                    ctx.release()
                    self._undo_put(joinable)
                    data = None  # see send_error
                    raise send_error(e, "put() failed")
                item = Frame(data, ctx, obj if self._keep_objects else None)
            self._unsent[0] += 1
            self._buffer.append(item)
            self._notempty.notify()

    def get(self, block: bool = True, timeout: float | None = None):
        """The stdlib's, receiving a frame with its fds."""
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        reader = self._reader
        if block and timeout is None:
            frame = _read_locked(reader, self._rlock, (), None)
        elif block:
            deadline = time.monotonic() + timeout  # the whole frame within the timeout
            frame = _read_locked(reader, self._rlock, (True, timeout), deadline)
        else:
            frame = _read_locked(reader, self._rlock, (False,), 0.0)
        if frame is None:
            raise Empty
        _count(frame, self._sem)
        return reader.take(_reductions.loads)

    def _undo_put(self, joinable) -> None:
        """Give back what a put that raised had taken."""
        if joinable is not None:
            with joinable:
                self._unfinished_tasks.acquire(False)
        self._sem.release()

    def close(self) -> None:
        """As the stdlib's (a no-op for a queue never put to: its socket closes with the
        queue, and ``empty()`` still answers); raises a send failure the feeder met and
        nothing has raised yet."""
        super().close()
        self._raise_failures("the queue is closed")

    def join_thread(self) -> None:
        """As the stdlib's; then raises a send failure the feeder met while flushing."""
        super().join_thread()
        self._raise_failures("the feeder thread has exited")

    def _start_thread(self) -> None:
        """The stdlib's (3.12's, which also stands for 3.10-3.11 and 3.13), starting this
        class's :meth:`_feed`."""
        debug("Queue._start_thread()")
        self._buffer.clear()
        self._thread = threading.Thread(
            target=type(self)._feed,
            args=(self._buffer, self._notempty, self._writer, self._wlock,
                  self._reader.close, self._writer.close, self._ignore_epipe,
                  self._on_queue_feeder_error, self._sem, self._unsent,
                  self._failures if self._raise_later else None),
            name="QueueFeederThread", daemon=True)
        try:
            self._thread.start()
        except BaseException:  # gh-109047: creating a thread can fail at finalization
            self._thread = None
            raise
        if not self._joincancelled:
            self._jointhread = Finalize(self._thread, _mpq.Queue._finalize_join,
                                        [weakref.ref(self._thread)], exitpriority=-5)
        self._close = Finalize(self, _mpq.Queue._finalize_close,
                               [self._buffer, self._notempty], exitpriority=10)

    @staticmethod
    def _feed(buffer, notempty, writer, writelock, reader_close, writer_close, ignore_epipe,
              onerror, queue_sem, unsent, failures) -> None:
        """The stdlib's ``Queue._feed``, sending the frames ``put`` made.  On an error it
        does what the stdlib's does (EPIPE ignored when asked, nothing reported while the
        process exits, else the semaphore given back and ``onerror(e, obj)`` called), and
        a send that failed is also recorded in ``failures``."""
        debug("starting thread to feed data to pipe")
        while True:
            with notempty:
                if not buffer:
                    notempty.wait()
            try:
                while True:
                    item = buffer.popleft()
                    if item is _sentinel:
                        debug("feeder thread got sentinel -- exiting")
                        reader_close()
                        writer_close()
                        return
                    try:
                        _send_item(item, writer, writelock)
                    except Exception as e:
                        if not _feed_failed(e, item, ignore_epipe, onerror, queue_sem,
                                            notempty, failures):
                            return
                    finally:
                        with notempty:
                            unsent[0] -= 1
            except IndexError:
                pass


def _count(frame: scm_rights.Frame, sem) -> None:
    """Give the queue's semaphore back once for each frame taken off the socket (a frame
    an exception left for the next get is counted once)."""
    if not frame.counted:
        frame.counted = True; sem.release()  # noqa: E702 (one line: never twice, never lost)


def _read_locked(reader, rlock, acquire: tuple, deadline: float | None):
    """``reader.read_frame(deadline)`` under the queue's read lock, taken with ``acquire``
    (its arguments): the frame, or None (the lock or the frame not had in time).  What
    the lock's acquire returned is recorded with no point between where a signal handler
    runs (see ``scm_rights._FIRST``), and its release is the first call of its line, so an
    exception never leaves the lock held (the stdlib Lock's ``__exit__`` is Python code,
    where a handler can run: ``with`` is not used)."""
    held: list = []
    try:
        held.extend(starmap(rlock.acquire, (acquire,)))
        return reader.read_frame(deadline) if held[0] else None
    finally:
        if held and held[0]: rlock.release()  # noqa: E701 (one line: see above)


def _send_item(item, writer, writelock) -> None:
    """Send a frame (and let go of its buffer, sent or not: see ``send_error``)."""
    if type(item) is _Unpicklable:
        raise item.error  # reported as the stdlib's feeder reports its pickling errors
    try:
        if writelock is None:
            writer.send_frame(item.data, item.ctx.wire_fds())
        else:
            with writelock:
                writer.send_frame(item.data, item.ctx.wire_fds())
    except BaseException:
        if item.obj is None:
            item.obj = bytes(item.data)  # what the stdlib's feeder gives its hook
        raise
    finally:
        item.ctx.release()
        item.data = None


def _feed_failed(e: Exception, item, ignore_epipe: bool, onerror, queue_sem, notempty,
                 failures: list | None) -> bool:
    """The feeder's error handling (inside its ``except``); False stops the feeder."""
    if ignore_epipe and getattr(e, "errno", 0) == errno.EPIPE:
        return False
    lost = type(item) is Frame and isinstance(e, (OSError, MemoryError))
    if lost:
        e = send_error(e, "the feeder thread could not send a message put() earlier",
                       "that message was dropped")
    if is_exiting():  # as the stdlib's: nobody is left to tell but stderr
        if lost:
            sys.stderr.write(f"shmtensor: a queued message was lost at exit: {e}\n")
        info("error in queue thread: %s", e)
        return False
    queue_sem.release()  # the message is not in the queue: as if taken off it
    if lost and failures is not None:
        with notempty:
            failures.append(e)
    obj = item.obj
    try:
        raise e  # the hook's default prints the exception being handled: this one
    except BaseException as err:
        onerror(err, obj)
    return True


class Queue(_ShmQueue, _mpq.Queue):
    """``multiprocessing.Queue`` that moves arrays through shared memory."""


class JoinableQueue(_ShmQueue, _mpq.JoinableQueue):
    """``multiprocessing.JoinableQueue`` that moves arrays through shared memory."""


class SimpleQueue(_mpq.SimpleQueue):
    """``multiprocessing.SimpleQueue`` that moves arrays through shared memory.  As the
    stdlib's, ``put`` pickles and sends in the caller's thread, so every error raises
    there."""

    def __init__(self, *, ctx) -> None:
        super().__init__(ctx=ctx)
        self._reader.close()
        self._writer.close()
        self._reader, self._writer = Pipe(duplex=False)
        self._poll = self._reader.poll

    def get(self):
        _read_locked(self._reader, self._rlock, (), None)
        return self._reader.take(_reductions.loads)

    def put(self, obj) -> None:
        try:
            data, ctx = _reductions.dumps(obj)
        except OSError as e:  # no fd or shared memory for a segment
            raise send_error(e, "put() failed")
        try:
            if self._wlock is None:
                self._writer.send_frame(data, ctx.wire_fds())
            else:
                with self._wlock:
                    self._writer.send_frame(data, ctx.wire_fds())
        except OSError as e:
            data = None  # see send_error
            raise send_error(e, "put() failed")
        finally:
            ctx.release()
