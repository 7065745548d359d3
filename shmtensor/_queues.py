"""Queue, JoinableQueue and SimpleQueue whose messages carry arrays through shared memory.

They are the stdlib's classes (``isinstance`` and every method work as documented) on a
channel (``_channel.Channel``: a ring in shared memory beside a socket pair) instead of a
pipe.  This module follows CPython 3.10-3.13's
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
* ``get`` (one for the three classes: :class:`_OnChannel`): the stdlib's, receiving a
  message and its fds, atomic with respect to exceptions (``Channel.take``): a message
  is delivered by the call that took it, or stays for the next ``get`` of this process,
  or (an exception while it is unpickled) is discarded with its fds closed.
* ``get_async``/``put_async`` (not in the stdlib): the same calls awaited in an event
  loop, tried on a timer (a ring has no fd to wait on).
* ``SimpleQueue``: no feeder thread, as the stdlib's: ``put`` sends in the caller's thread
  (waiting while the ring is full) and raises every error; its ``_reader`` is what the
  stdlib's Pool and executors wait on and read (:class:`_Reader`).

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

import collections
import errno
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from itertools import starmap
from multiprocessing import context
from multiprocessing import queues as _mpq
from multiprocessing.util import Finalize, debug, info, is_exiting
from queue import Empty, Full
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, final

from shmtensor.ipc import scm_rights

from . import _reductions
from ._channel import TURN_MOMENT, Channel, Lost, _raised_by_a_signal_handler
from ._connection import Connection, dumps_to_send, send_error
from ._wire import SendContext

if TYPE_CHECKING:
    from multiprocessing.synchronize import BoundedSemaphore, Condition, Lock, Semaphore

    class _QueueBase(_mpq.Queue[Any]):
        """The stdlib Queue's private members this module uses (not in its stubs)."""

        _reader: Connection
        _writer: Connection
        _rlock: Lock
        _wlock: Lock | None
        _sem: BoundedSemaphore
        _notempty: threading.Condition
        _buffer: collections.deque[Any]
        _thread: threading.Thread | None
        _jointhread: Finalize | None
        _close: Finalize | None
        _closed: bool
        _maxsize: int
        _joincancelled: bool
        _ignore_epipe: bool
        _unfinished_tasks: Semaphore  # JoinableQueue's
        _cond: Condition              # JoinableQueue's

        def _reset(self, after_fork: bool = False) -> None: ...

        @staticmethod
        def _on_queue_feeder_error(e: BaseException, obj: object) -> None: ...

    class _SimpleQueueBase(_mpq.SimpleQueue[Any]):
        """The stdlib SimpleQueue's private members this module sets."""

        _writer: Connection
    _StdQueue = _mpq.Queue[Any]
    _StdJoinableQueue = _mpq.JoinableQueue[Any]
else:  # the stdlib's classes are generic for typing only (subscripted from 3.12 at run time)
    _QueueBase = object
    _SimpleQueueBase = _mpq.SimpleQueue
    _StdQueue = _mpq.Queue
    _StdJoinableQueue = _mpq.JoinableQueue

_RING_DEPTH = 256  # records in a queue's ring; beyond, put()s wait in the feeder's buffer
# seconds the feeder waits before it tries a full channel again: doubling from the first
# to the last while the channel stays full (a reader that lags is not polled hard)
_ROOM_POLL, _ROOM_POLL_MAX = 0.0005, 0.008
# seconds an awaitable call waits before it tries the ring again: doubling up to the last
_RETRY_FIRST, _RETRY_MAX = 0.001, 0.05
_T = TypeVar("_T")
_sentinel: object = _mpq._sentinel  # type: ignore[attr-defined]  # private: the stdlib's finalizer appends it to stop the feeder


@final
class Frame:
    """A message pickled by ``put``, waiting for the feeder thread; ``obj`` is what
    ``_on_queue_feeder_error`` gets if it cannot be sent: the object if the queue keeps
    them, else None (then its pickled bytes, as the stdlib's feeder gives).  ``sent``
    gets its record number in the step that writes it to the channel: a frame that an
    exception (a signal handler's) left in the buffer after that is never sent again."""

    __slots__ = ("data", "ctx", "obj", "sent")

    def __init__(self, data: bytes, ctx: SendContext, obj: object) -> None:
        self.data, self.ctx, self.obj = data, ctx, obj
        self.sent: list[int] = []


@final
class _Unpicklable:
    """An object ``put`` could not pickle: the feeder reports it in its turn, as the
    stdlib's feeder does when its own pickling fails."""

    __slots__ = ("error", "obj")

    def __init__(self, error: Exception, obj: object) -> None:
        self.error, self.obj = error, obj


def _with_outcome(err: BaseException, outcome: str) -> BaseException:
    """A recorded send failure, raised again by a later call that says what it did."""
    new: BaseException
    if isinstance(err, OSError) and err.errno is not None:
        new = OSError(err.errno, f"{err.strerror}; {outcome}")
    else:
        new = type(err)(f"{err}; {outcome}")
    new.__cause__ = err
    return new


class _Joinable(Protocol):
    """A JoinableQueue's ``_cond`` (what ``put`` counts under)."""

    def __enter__(self) -> bool: ...

    def __exit__(self, *exc: object) -> None: ...


class _OnChannel:
    """What a queue on a channel (``_chan``) receives with, the same for Queue,
    JoinableQueue and SimpleQueue: ``get`` (atomic: see Channel.take) and ``get_async``.
    A queue says how a get starts (``_check_get``) and what it counts (``_lost``,
    ``_got``), keeps ``_awaiting``, and says ``empty`` (each raises as its stdlib
    counterpart does once closed)."""

    _chan: Channel
    _awaiting: weakref.WeakKeyDictionary[Any, Any]

    def _check_get(self) -> None:
        """Raise if the queue cannot be read (closed)."""

    def _lost(self) -> None:
        """A message was lost (``Lost``) on its way to this get."""

    def _got(self, frame: scm_rights.Frame) -> None:
        """A message was taken off the channel for this get (once per message)."""

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The stdlib's, receiving a frame with its fds."""
        self._check_get()
        chan = self._chan
        acquire = chan.turn_args(block, timeout)
        deadline = None if not block or timeout is None else time.monotonic() + timeout
        held: list[bool] = []  # this thread's turn to receive (see Channel.turn)
        sweeps, sweeping = chan.sweeps, chan.sweeping  # in this order (see sweep_idle)
        try:
            held.extend(starmap(chan.turn.acquire, (acquire,)))
            if not held[0] and (sweeping or chan.sweeping or chan.sweeps != sweeps):
                # the sweeper thread's pass (Channel.sweep_idle) had the turn: a moment
                held.clear()
                held.extend(starmap(chan.turn.acquire, ((True, TURN_MOMENT),)))
            if not held[0]:
                raise Empty
            try:
                frame = chan.receive(block, None if deadline is None
                                     else max(0.0, deadline - time.monotonic()))
            except Lost:
                self._lost()
                raise
            except ValueError:  # RingClosed, or the closed ring's words in a hook
                if not chan.ring.closed:
                    raise
                # as the stdlib's reader meets the end of its pipe, or its closed handle
                if deadline is None:
                    raise EOFError("the queue was closed while this get() waited for a "
                                   "message") from None
                raise OSError("handle is closed") from None
            self._got(frame)
            number, frame = chan.load(_reductions.loads)
            # the hand-over, in this frame (see Channel.load)
            held[0] = False; chan.turn.release(); chan._last[0] = number; del chan._taken[0]; chan._handing = 0; return frame.result[0]  # noqa: E702,E501
        except BaseException:
            # not in finally: after the hand-over, no call may come before the return (a
            # signal handler runs at a call's entry or return, and its exception would
            # lose what was handed over)
            chan.disown()
            raise
        finally:
            # an expression, not an if: on the return path (held == [False]) an if's
            # taken POP_JUMP_IF_FALSE checks the eval breaker on 3.10 (a handler's
            # exception there replaces the return); JUMP_IF_FALSE_OR_POP never does
            held and held[0] and chan.turn.release()  # type: ignore[func-returns-value]

    async def get_async(self, block: bool = True, timeout: float | None = None) -> Any:
        """:meth:`get`, awaited: tries the channel on a timer (1 to 50 ms: a ring has no fd
        to wait on) in the running event loop instead of blocking it (no thread);
        ``queue.Empty`` as ``get`` raises it.  Concurrent awaiters of one loop get one
        message each, in the order they came (they wait in line, and only the first
        tries).  Cancelling it loses no message: each try is one ``get(False)``, whole or
        not begun."""
        import asyncio
        self._check_get()
        if not block:
            return self.get(False)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        line = self._awaiting.get(loop)
        if line is None:
            line = self._awaiting[loop] = asyncio.Lock()
        # awaiters of one loop take messages in the order they came (the lock is FIFO)
        if deadline is None:
            await line.acquire()
        else:
            try:
                await asyncio.wait_for(line.acquire(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise Empty from None
        try:
            return await _retried(lambda: self.get(False), Empty, deadline)
        finally:
            line.release()


class _ShmQueue(_OnChannel, _QueueBase):
    # Give _on_queue_feeder_error the object itself (not its pickled bytes) when a send
    # fails: a subclass that must know which object failed sets it (it keeps each queued
    # object alive until sent, as the stdlib's buffer does).
    _keep_objects = False
    # Record a send failure of the feeder for the next put(), close() or join_thread() to
    # raise; a subclass whose hook delivers every failure itself turns it off.
    _raise_later = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _on_channel(self)

    def __getstate__(self) -> Any:
        # the stdlib's __getstate__ returns a tuple; its stub says object
        return (*super().__getstate__(), self._chan.ring_state())  # type: ignore[misc]

    def __setstate__(self, state: Any) -> None:
        super().__setstate__(state[:-1])
        self._chan = _attach(state[-1], self._reader, self._writer)

    def _check_get(self) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")

    def empty(self) -> bool:
        # the feeder closes the reader once close() stopped it: OSError then, as the
        # stdlib's poll of its closed reader raises (an unused queue's close does nothing)
        self._reader._check_closed()
        return self._chan.empty()

    def _lost(self) -> None:
        self._sem.release()  # taken off the queue, if not delivered

    def _got(self, frame: scm_rights.Frame) -> None:
        _count(frame, self._sem)

    def _reset(self, after_fork: bool = False) -> None:
        super()._reset(after_fork)
        self._sending = _Sending()
        # get_async's awaiters of each event loop, in line (see get_async)
        self._awaiting: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        # send failures the feeder met, not yet raised (under _notempty)
        self._failures: list[BaseException] = []

    def _send_now(self, data: bytes, ctx: SendContext, sent: list[int]) -> bool:
        """Send a message in this thread if that keeps the queue's order and the socket
        takes it whole at once (the caller holds ``_notempty``).  False leaves it to the
        feeder thread; a failure raises (the socket is untouched).  ``sent`` gets the
        record's number as it is written (see ``Ring.put``).

        Order: frames wait in the buffer, and one the feeder took off it is sent, or put
        back, under the sending lock (as a put's help sends), so with that lock held here
        (taken without waiting) and the buffer empty nothing put earlier is unsent."""
        if self._buffer or len(data) > scm_rights.ATOMIC_MAX:
            return False  # a large one is the feeder's to send, as in the stdlib
        lock = self._sending.lock
        took: list[bool] = []  # taken and let go of by C calls alone (see _locked)
        try:
            took.extend(starmap(lock.acquire, ((False,),)))
            if not took[0] or self._buffer:
                return False  # a frame is being sent, or was put back: this one after it
            try:
                self._chan.post(data, ctx, False, sent=sent)
            except Full:
                return False
            except BrokenPipeError:
                if self._ignore_epipe:  # concurrent.futures: the feeder drops it, as stdlib
                    return False
                raise
        finally:
            if took and took[0]: lock.release()  # noqa: E701 (first call of its line)
        ctx.release()
        return True

    def _take_failures(self) -> list[BaseException]:
        failures = self._failures[:]
        self._failures.clear()
        return failures

    def _raise_failures(self, outcome: str) -> None:
        """Raise the first send failure the feeder recorded (and forget them all)."""
        if not self._failures:
            return
        failures = _locked(self._notempty, self._take_failures)
        if len(failures) > 1:
            outcome = f"{len(failures)} messages were dropped this way; {outcome}"
        raise _with_outcome(failures[0], outcome)

    def put(self, obj: object, block: bool = True, timeout: float | None = None) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        if self._failures:
            self._raise_failures("this put() did not queue its object; the queue is usable")
        data: bytes | None
        ctx: SendContext | None
        item: Frame | _Unpicklable
        self._chan.prune()
        try:
            data, ctx = _reductions.dumps(obj)
        except OSError as e:  # no fd or shared memory for a segment
            raise send_error(e, "put() failed")
        except MemoryError:  # ShmSpaceError included: it says what to do
            raise
        except Exception as e:  # cannot be pickled: reported by the feeder, as in the stdlib
            if _raised_by_a_signal_handler(e):
                raise  # the caller's, as the stdlib's put (which pickles in the feeder) has it
            data, ctx = None, None
            item = _Unpicklable(e, obj)
        joinable = getattr(self, "_cond", None)
        # what this put took and what went out, each marked in the step that does it (C
        # calls from the taking to the mark: see _locked), so that a signal handler's
        # exception anywhere gives back exactly what it took and nothing on its way
        took: list[bool] = []     # [.., True] once it holds a place in the semaphore
        counted: list[None] = []  # [None] once its task is counted (a JoinableQueue's)
        sent: list[int] = []      # the record's number, in the step that writes it
        queued: list[None] = []   # [None], in the step that puts the frame in the buffer
        # the condition's own lock, taken and let go of with no Python frame in between
        # (see _locked): a signal handler's exception (torch's SIGCHLD handler raises one
        # when a DataLoader worker dies) never leaves it held by nobody
        lock: Any = self._notempty._lock  # type: ignore[attr-defined]  # Condition's lock
        held: list[bool] = []
        try:
            took.extend(starmap(self._sem.acquire, ((False,),)))
            if not took[-1]:
                _room(self._sem, self._maxsize, block, timeout, took)
                if not took[-1]:
                    raise Full
            if joinable is not None:  # counted first, as the stdlib does, not held while sending
                _locked(joinable, counted.extend,
                        starmap(self._unfinished_tasks.release, ((),)))
            held.extend(starmap(lock.acquire, ((),)))
            if self._thread is None:  # on first put, as the stdlib's, even if it sends here
                self._start_thread()  # (gh-109047: no thread at finalization)
            if data is not None and ctx is not None:  # (both or neither)
                if self._send_now(data, ctx, sent):
                    return
                item = Frame(data, ctx, obj if self._keep_objects else None)
            queued.extend(map(self._buffer.append, (item,)))  # C from the append to the mark
            self._notempty.notify()
        except BaseException as e:
            if sent or queued:  # on its way: the exception (a signal handler's) is the caller's
                if queued:
                    self._notempty.notify()
                raise
            # nothing of it went out: what the put took is given back, and a failure to
            # send (not a signal handler's exception) says what to do
            if ctx is not None:
                ctx.release()
            if counted:
                _locked(joinable, self._unfinished_tasks.acquire, False)
            if took and took[-1]:
                self._sem.release()
            if (self._closed and isinstance(e, (OSError, ValueError))
                    and not _raised_by_a_signal_handler(e)):
                # closed by another thread while this put sent: as if closed before
                raise ValueError(f"Queue {self!r} is closed") from None
            if isinstance(e, OSError) and data is not None and not _raised_by_a_signal_handler(e):
                data = None  # see send_error
                raise send_error(e, "put() failed")
            raise
        finally:
            if held: lock.release()  # noqa: E701 (first call of its line)
        self._help_send()

    def _help_send(self) -> None:
        """Send what the feeder has not sent yet, in order, as far as the channel takes it
        now.  A producer that puts faster than its reader reads would otherwise leave the
        sending to a thread that gets the GIL only when this one lets go (every switch
        interval), and starve its reader meanwhile.  Waiting for the feeder's turn lets it
        run too.  Never waits for the reader: the feeder's turn is waited for at most
        ``_Sending.WAIT``, and a frame the channel does not take now (full, too large, or
        an error) is left to the feeder, which reports errors as the stdlib's does."""
        sending, buffer = self._sending, self._buffer
        if not buffer:
            return
        # taken and let go of by C calls alone (see _locked): a signal handler's exception
        # at a call's return never leaves the feeder waiting for it for good
        held: list[bool] = []
        try:
            held.extend(starmap(sending.lock.acquire, ((True, sending.WAIT),)))
            if not held[0]:
                return
            while buffer:
                item = buffer[0]
                if type(item) is not Frame or (
                        not item.sent and len(item.data) > scm_rights.ATOMIC_MAX):
                    return  # the feeder's: it reports errors (and sends large ones)
                try:
                    if not _try_send(item, self._chan):
                        return
                except Exception as e:
                    if _raised_by_a_signal_handler(e):
                        raise  # the caller's; the frame, whole or sent, is the next sender's
                    if not item.sent:
                        return  # the frame is whole: the feeder meets the error, reports it
                    _try_send(item, self._chan)  # sent: this only lets go of its buffer
                buffer.popleft()
        finally:
            if held and held[0]: sending.lock.release()  # noqa: E701 (first call of its line)

    async def put_async(self, obj: object, block: bool = True,
                        timeout: float | None = None) -> None:
        """:meth:`put`, awaited: ``put`` never waits for the reader (its feeder thread
        sends), only for room in a queue made with ``maxsize``; this waits for that room
        in the running event loop, tried again on a timer (1 to 50 ms: a semaphore has no
        fd to wait on), then puts; ``queue.Full`` as ``put`` raises it.  A producer of
        another process that takes the room first makes it wait again (having pickled
        the object once more)."""
        from . import _aio  # asyncio loads with the first awaitable call
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        deadline = None if timeout is None else _aio.loop_time() + timeout
        while True:
            left = None if deadline is None else deadline - _aio.loop_time()
            if not await _aio.acquire(self._sem, block, left):
                raise Full
            self._sem.release()  # room now: put takes it (unless another producer does)
            try:
                return self.put(obj, False)
            except Full:
                if not block:
                    raise

    def close(self) -> None:
        """As the stdlib's (a no-op for a queue never put to: its socket closes with the
        queue, and ``empty()`` still answers); raises a send failure the feeder met and
        nothing has raised yet."""
        self._feeder_finalizers()
        super().close()
        self._raise_failures("the queue is closed")

    def join_thread(self) -> None:
        """As the stdlib's; then raises a send failure the feeder met while flushing."""
        self._feeder_finalizers()
        super().join_thread()
        self._raise_failures("the feeder thread has exited")

    def _start_thread(self) -> None:
        """The stdlib's (3.12's, which also stands for 3.10-3.11 and 3.13), starting this
        class's :meth:`_feed`."""
        debug("Queue._start_thread()")
        sending = self._sending
        feeder = sending.feeder
        if feeder is not None and _began(sending, 1.0):
            # a feeder whose start a signal handler's exception cut short (in start's wait,
            # then in the wait below): it runs, and is this queue's (a second would race
            # it, and join_thread would never see it end)
            self._thread = feeder
            self._feeder_finalizers()
            return
        self._buffer.clear()
        # made and started before it is the queue's: a put cut short (a signal handler's
        # exception) before the start leaves no unstarted thread for later puts to trust
        thread = threading.Thread(
            target=type(self)._feed,
            args=(self._buffer, self._notempty, self._reader.close, self._writer.close, self._ignore_epipe,
                  self._on_queue_feeder_error, self._sem,
                  self._failures if self._raise_later else None, self._sending,
                  self._chan),
            name="QueueFeederThread", daemon=True)
        sending.feeder = thread  # known before it runs: a start cut short may still run it
        try:
            thread.start()
        except BaseException:
            # gh-109047: creating a thread can fail at finalization; but a signal handler's
            # exception in start's wait for the new thread leaves it running, and it is
            # this queue's feeder all the same (forgotten, a second one would race it, and
            # join_thread would never see it end)
            # (the thread may also have died starting: threading's own cleanup of the
            # cut-short start removes what the new thread looks for; it then never feeds)
            if _began(sending, 1.0):
                self._thread = thread
                self._feeder_finalizers()
            raise
        self._thread = thread  # (a Python call's return runs no signal handler before it)
        self._feeder_finalizers()

    def _feeder_finalizers(self) -> None:
        """The stdlib's finalizers of a started feeder (joined at exit, sent its
        sentinel at close), each made where it is missing: also at ``close`` and
        ``join_thread``, for a feeder whose start a signal handler's exception cut short
        between the two (a close that sends no sentinel would leave ``join_thread``
        waiting for good)."""
        if self._thread is None:
            return
        if self._close is None and not self._closed:
            # (the stdlib's private finalizers are not in its stubs)
            self._close = Finalize(self, _mpq.Queue._finalize_close,  # type: ignore[attr-defined]
                                   [self._buffer, self._notempty], exitpriority=10)
        if self._jointhread is None and not self._joincancelled:
            self._jointhread = Finalize(self._thread, _mpq.Queue._finalize_join,  # type: ignore[attr-defined]
                                        [weakref.ref(self._thread)], exitpriority=-5)

    @staticmethod
    def _feed(buffer: collections.deque[Any], notempty: threading.Condition,
              reader_close: Callable[[], None],
              writer_close: Callable[[], None], ignore_epipe: bool,
              onerror: Callable[[BaseException, object], None], queue_sem: BoundedSemaphore,
              failures: list[BaseException] | None,
              sending: _Sending, chan: Channel) -> None:
        """The stdlib's ``Queue._feed``, sending the frames ``put`` made.  On an error it
        does what the stdlib's does (EPIPE ignored when asked, nothing reported while the
        process exits, else the semaphore given back and ``onerror(e, obj)`` called), and
        a send that failed is also recorded in ``failures``.  A frame the socket has no
        room for now goes back to the head of the buffer while the feeder waits for room,
        so that a ``put`` can send it meanwhile (see ``_help_send``)."""
        debug("starting thread to feed data to pipe")
        sending.began = True
        waits = 0  # tries in a row that found the channel full
        while True:
            with notempty:
                if not buffer:
                    notempty.wait()
            while True:
                with sending.lock:
                    try:
                        item = buffer.popleft()
                    except IndexError:
                        break
                    if item is _sentinel:
                        debug("feeder thread got sentinel -- exiting")
                        chan.park()  # while this process still has the reading end
                        reader_close()
                        writer_close()
                        chan.shut_if_alone()
                        return
                    done = True
                    try:
                        done = _send_item(item, chan)
                    except Exception as e:
                        if not _feed_failed(e, item, ignore_epipe, onerror, queue_sem,
                                            notempty, failures):
                            return
                    if not done:
                        buffer.appendleft(item)
                if not done:
                    _wait_for_room(waits)
                    waits += 1
                else:
                    waits = 0


# A put that finds its bounded queue full looks again on a timer, ROOM_FIRST seconds
# doubling to ROOM_MOST, and takes the room once half the queue is free; after
# ROOM_LOOKS seconds (a reader that has stopped) it waits on the semaphore.  Producers
# that outrun their reader then refill the queue in bursts, each woken about once per
# half a queue, where a wait on the semaphore wakes one producer for every message taken:
# a context switch per message, which costs more than the message where processes
# outnumber CPUs.  A put's deadline is kept: the look at it takes any room.  A queue of
# fewer than ROOM_MIN places waits on the semaphore at once: its bursts would be short,
# and each look's delay would be paid by a message or two.
ROOM_FIRST, ROOM_MOST, ROOM_LOOKS, ROOM_MIN = 100e-6, 1e-3, 0.05, 32


def _room(sem: BoundedSemaphore, maxsize: int, block: bool, timeout: float | None,
          took: list[bool]) -> None:
    """Take a place in a full queue's semaphore ``sem`` (of ``maxsize``), as
    ``sem.acquire(block, timeout)`` does: ``took`` ends with True once it is taken (in the
    step that takes it: a signal handler's exception never finds it taken and unmarked),
    else with False at the deadline."""
    if not block:
        took.append(False)
        return
    if maxsize < ROOM_MIN:
        took.extend(starmap(sem.acquire, ((True, timeout),)))
        return
    now = time.monotonic()
    deadline = None if timeout is None else now + max(0.0, timeout)
    until = now + ROOM_LOOKS if deadline is None else min(now + ROOM_LOOKS, deadline)
    half, pause = max(1, maxsize // 2), ROOM_FIRST
    while now < until:
        time.sleep(min(pause, until - now))
        pause = min(2 * pause, ROOM_MOST)
        if sem.get_value() >= half:
            took.extend(starmap(sem.acquire, ((False,),)))
            if took[-1]:
                return
        now = time.monotonic()
    took.extend(starmap(sem.acquire, ((True, None if deadline is None
                                       else max(0.0, deadline - now)),)))


def _count(frame: scm_rights.Frame, sem: BoundedSemaphore) -> None:
    """Give the queue's semaphore back once for each frame taken off the socket (a frame
    an exception left for the next get is counted once)."""
    if not frame.counted:
        frame.counted = True; sem.release()  # noqa: E702 (one line: never twice, never lost)


def _on_channel(q: Any) -> None:
    """Move a new stdlib queue ``q`` (never used) onto a channel: its pipe closed, its
    ``_reader`` and ``_writer`` made the channel's side sockets (closing ``_reader`` in
    every process is what tells a writer that nobody reads, as with the stdlib's pipe)."""
    q._reader.close()
    q._writer.close()
    # a ring as deep as maxsize never fills (the semaphore counts what is in it)
    q._reader, q._writer, q._chan = _new_channel(min(q._maxsize, _RING_DEPTH))
    q._reset()


def _new_channel(depth: int) -> tuple[Connection, Connection, Channel]:
    """A channel of ``depth`` records and its side sockets' reading and writing ends."""
    r, w = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    reader = Connection(r.detach(), writable=False)
    writer = Connection(w.detach(), readable=False)
    chan = Channel.create(reader._sock, writer._sock, depth)
    _spin_as_set(chan, reader)
    return reader, writer, chan


def _attach(ring_state: Any, reader: Connection, writer: Connection) -> Channel:
    """This process's ends of a channel that came pickled: its ring's state from
    ``Channel.ring_state()``, its side sockets' ends."""
    chan = Channel.attach(ring_state, reader._sock, writer._sock)
    _spin_as_set(chan, reader)
    return chan


def _locked(cond: Any, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` under ``cond``'s lock (a threading or multiprocessing Condition),
    taken and let go of by C calls alone: ``with cond`` runs its Python ``__enter__`` and
    ``__exit__``, at whose entry or return a signal handler's exception would leave the
    lock held by nobody (a put of the main thread, where torch's SIGCHLD handler raises
    when a DataLoader worker dies, would then hang every later put)."""
    lock = cond._lock
    held: list[bool] = []
    try:
        held.extend(starmap(lock.acquire, ((),)))
        return fn(*args)
    finally:
        if held: lock.release()  # noqa: E701 (first call of its line)


def _spin_as_set(chan: Channel, reader: Connection) -> None:
    """The channel's reader polls as ``set_receive_spin`` says (``reader``'s wait)."""
    wait = reader._wait
    chan.ring.spin = 0.0 if wait is None else wait.budget


async def _retried(attempt: Callable[[], _T], exc: type[Exception],
                   deadline: float | None) -> _T:
    """``attempt()`` in the running event loop until it does not raise ``exc``, tried
    again after 1 ms, doubling up to 50 ms (a ring has no fd to wait on, for a message
    or for room); ``exc`` again once ``deadline`` (loop time) has passed."""
    import asyncio
    loop = asyncio.get_running_loop()
    pause = _RETRY_FIRST
    while True:
        try:
            return attempt()
        except exc:
            if deadline is not None and loop.time() >= deadline:
                raise
        await asyncio.sleep(pause if deadline is None
                            else min(pause, max(0.0, deadline - loop.time())))
        pause = min(pause * 2, _RETRY_MAX)


@final
class _Sending:
    """Who takes frames off a queue's buffer to send them: the feeder, or a put helping
    it (``lock``)."""

    __slots__ = ("lock", "began", "feeder")

    WAIT = 0.005  # seconds a put waits for the feeder's turn

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.began = False  # set by the feeder as it begins (see _began)
        # the feeder thread, set before it is started (see Queue._start_thread)
        self.feeder: threading.Thread | None = None


def _began(sending: _Sending, seconds: float) -> bool:
    """Whether the feeder began, waiting up to ``seconds`` for it.  Polled, with no lock
    taken: a ``threading.Event``'s wait enters its condition by a Python ``with``, at
    whose return a signal handler's exception leaves the lock held by nobody, and every
    later wait (and the feeder's set) hangs."""
    end = time.monotonic() + seconds
    while not sending.began:
        if time.monotonic() >= end:
            return False
        time.sleep(0.0005)
    return True


def _try_send(item: Frame, chan: Channel) -> bool:
    """Send a frame if the channel takes it now: True (and its buffer let go), or False
    with nothing sent (the channel full).  An error leaves the frame whole, or sent (its
    ``sent`` says so: an exception after the write, a signal handler's)."""
    if not item.sent:
        chan.prune()
        try:
            chan.post(item.data, item.ctx, False, sent=item.sent)
        except Full:
            return False
    item.ctx.release()
    item.data = None  # type: ignore[assignment]  # let go once sent: nothing reads it after
    return True


def _send_item(item: Frame | _Unpicklable, chan: Channel) -> bool:
    """The feeder's send of a frame: False if the channel has no room for it now (nothing
    sent, the frame whole); else sent, or failed (its buffer let go either way: see
    ``send_error``)."""
    if type(item) is _Unpicklable:
        raise item.error  # reported as the stdlib's feeder reports its pickling errors
    try:
        return _try_send(item, chan)
    except BaseException:
        if item.obj is None:
            item.obj = bytes(item.data)  # what the stdlib's feeder gives its hook
        item.ctx.release()
        item.data = None  # type: ignore[assignment]
        raise


def _wait_for_room(waits: int) -> None:
    """Wait a moment before the feeder tries a full channel again, longer after each of
    ``waits`` tries that found it full (a ring has no fd to wait on for room; a put
    meanwhile sends what waits, see ``_help_send``)."""
    time.sleep(min(_ROOM_POLL * 2 ** min(waits, 8), _ROOM_POLL_MAX))


def _feed_failed(e: BaseException, item: Frame | _Unpicklable, ignore_epipe: bool,
                 onerror: Callable[[BaseException, object], None], queue_sem: BoundedSemaphore,
                 notempty: threading.Condition, failures: list[BaseException] | None) -> bool:
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


class Queue(_ShmQueue, _StdQueue):
    """``multiprocessing.Queue`` that moves arrays through shared memory."""


class JoinableQueue(_ShmQueue, _StdJoinableQueue):
    """``multiprocessing.JoinableQueue`` that moves arrays through shared memory."""


class SimpleQueue(_OnChannel, _SimpleQueueBase):
    """``multiprocessing.SimpleQueue`` that moves arrays through shared memory, on a
    channel (as Queue is).  As the stdlib's, ``put`` pickles and sends in the caller's
    thread (no feeder thread: it waits while the ring is full), so every error raises
    there; ``get`` waits for a message.  Both take ``block`` and ``timeout`` too.

    ``_reader`` and ``_writer`` are what the stdlib's Pool and executors use: ``_writer``
    the side socket's writing end (closed by a process that only reads), ``_reader`` a
    :class:`_Reader` whose ``fileno()`` ``multiprocessing.connection.wait`` waits on and
    whose ``recv()`` is ``get()``."""

    _reader: _Reader  # the stdlib's is a Connection

    def __init__(self, *, ctx: Any) -> None:  # not the stdlib's: no pipe, no locks
        self._side, self._writer, self._chan = _new_channel(_RING_DEPTH)
        self._setup()

    def _setup(self) -> None:
        self._chan.waitable = True
        self._reader = _Reader(self)
        # get_async's awaiters of each event loop, in line (see _OnChannel.get_async)
        self._awaiting = weakref.WeakKeyDictionary()

    def __getstate__(self) -> Any:
        context.assert_spawning(self)
        return self._side, self._writer, self._chan.ring_state()

    def __setstate__(self, state: Any) -> None:
        self._side, self._writer, ring_state = state
        self._chan = _attach(ring_state, self._side, self._writer)
        self._setup()

    def _check_get(self) -> None:
        self._side._check_closed()  # OSError, as the stdlib's closed reader raises

    def empty(self) -> bool:
        self._side._check_closed()
        try:
            return self._chan.empty()
        except ValueError:  # closed by another thread meanwhile
            if not self._chan.ring.closed:
                raise
            raise OSError("handle is closed") from None

    def close(self) -> None:
        """As the stdlib's: both ends closed (and the ring, in this process: first, so
        that it may still ask whether the queue is read elsewhere)."""
        self._chan.close()
        self._side.close()
        self._writer.close()

    def put(self, obj: object) -> None:
        self._writer._check_closed()
        self._chan.prune()
        data, ctx = dumps_to_send(obj, "put() failed")
        try:
            self._chan.post(data, ctx)
        except (OSError, ValueError) as e:
            data = None  # type: ignore[assignment]  # see send_error
            raise _put_failed(e, self._chan)
        finally:
            ctx.release()

    async def put_async(self, obj: object) -> None:
        """:meth:`put`, awaited: pickles in the caller's step, then sends without blocking
        the loop, tried again on a timer (1 to 50 ms) while the ring is full.  Cancelling
        it sends nothing or the whole message (each try is whole or not begun).  Sends
        from one loop keep their order."""
        self._writer._check_closed()
        self._chan.prune()
        data, ctx = dumps_to_send(obj, "put() failed")
        try:
            await _retried(lambda: self._chan.post(data, ctx, False), Full, None)
        except (OSError, ValueError) as e:
            data = None  # type: ignore[assignment]  # see send_error
            raise _put_failed(e, self._chan)
        finally:
            ctx.release()


def _put_failed(e: OSError | ValueError, chan: Channel) -> BaseException:
    """What a SimpleQueue's put raises for ``e``, raised by its channel: BrokenPipeError
    where another thread closed the queue meanwhile (``RingClosed``, or the closed ring or
    side socket met in a hook), as the stdlib's writer meets its closed pipe; else
    ``send_error``'s description of ``e``.  Nothing was sent."""
    if chan.ring.closed:
        return BrokenPipeError(errno.EPIPE, "the queue was closed while this put() waited "
                               "for room in it; the message was not sent")
    return send_error(e, "put() failed")


@final
class _Reader:
    """A SimpleQueue's ``_reader``, as the stdlib's Pool and concurrent.futures use it:
    ``multiprocessing.connection.wait([reader])`` (``fileno()``: see
    ``Channel.wait_fd``), ``recv()`` (the queue's ``get()``), ``poll()``, ``close()``
    (this process reads no more: once every process has, ``put`` raises
    ``BrokenPipeError``)."""

    __slots__ = ("_queue",)

    def __init__(self, queue: SimpleQueue) -> None:
        self._queue = weakref.ref(queue)  # the queue keeps its reader, not the reverse

    def _q(self) -> SimpleQueue:
        q = self._queue()
        if q is None:
            raise OSError(errno.EBADF, "the SimpleQueue of this reader is gone")
        return q

    def fileno(self) -> int:
        q = self._q()
        q._side._check_closed()
        return q._chan.wait_fd()

    def poll(self, timeout: float | None = 0.0) -> bool:
        q = self._q()
        q._side._check_closed()
        try:
            return q._chan.poll(timeout)
        except ValueError:  # closed while it waited: ready, and recv() says closed
            if not q._chan.ring.closed:
                raise
            return True

    def recv(self) -> Any:
        return self._q().get()

    def close(self) -> None:
        self._q()._side.close()

    @property
    def closed(self) -> bool:
        return self._q()._side.closed
