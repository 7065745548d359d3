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
* ``get_async``/``put_async`` (not in the stdlib): the same calls awaited in an event
  loop, on the socket's readiness (:mod:`._aio`).

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
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from itertools import starmap
from multiprocessing import queues as _mpq
from multiprocessing.util import Finalize, debug, info, is_exiting
from queue import Empty, Full
from typing import TYPE_CHECKING, Any, Protocol, final

from shmtensor.ipc import scm_rights

from . import _reductions
from ._channel import Channel, Lost
from ._connection import Connection, Pipe, dumps_to_send, send_error
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
        """The stdlib SimpleQueue's private members this module uses."""

        _reader: Connection
        _writer: Connection
        _rlock: Lock
        _wlock: Lock | None
        _poll: Callable[[float | None], bool]
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
_sentinel: object = _mpq._sentinel  # type: ignore[attr-defined]  # private: the stdlib's finalizer appends it to stop the feeder


@final
class Frame:
    """A message pickled by ``put``, waiting for the feeder thread; ``obj`` is what
    ``_on_queue_feeder_error`` gets if it cannot be sent: the object if the queue keeps
    them, else None (then its pickled bytes, as the stdlib's feeder gives)."""

    __slots__ = ("data", "ctx", "obj")

    def __init__(self, data: bytes, ctx: SendContext, obj: object) -> None:
        self.data, self.ctx, self.obj = data, ctx, obj


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


class _ShmQueue(_QueueBase):
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
        self._chan = Channel.attach(state[-1], self._reader._sock, self._writer._sock)
        _spin_as_set(self)

    def empty(self) -> bool:
        return self._chan.empty()

    def _reset(self, after_fork: bool = False) -> None:
        super()._reset(after_fork)
        self._unsent = [0]     # frames given to the feeder and not yet sent (under _notempty)
        self._sending = _Sending()
        # get_async's awaiters of each event loop, in line (see get_async)
        self._awaiting: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        # send failures the feeder met, not yet raised (under _notempty)
        self._failures: list[BaseException] = []

    def _send_now(self, data: bytes, ctx: SendContext) -> bool:
        """Send a message in this thread if that keeps the queue's order and the socket
        takes it whole at once (the caller holds ``_notempty``).  False leaves it to the
        feeder thread; a failure raises (the socket is untouched)."""
        if self._unsent[0] or len(data) > scm_rights.ATOMIC_MAX:
            return False  # a large one is the feeder's to send, as in the stdlib
        try:
            self._chan.send(data, ctx.wire_fds(), False)
        except Full:
            return False
        except BrokenPipeError:
            if self._ignore_epipe:  # concurrent.futures: the feeder drops it, as in the stdlib
                return False
            raise
        ctx.release()
        return True

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

    def put(self, obj: object, block: bool = True, timeout: float | None = None) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        if self._failures:
            self._raise_failures("this put() did not queue its object; the queue is usable")
        data: bytes | None
        ctx: SendContext | None
        item: Frame | _Unpicklable
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
            if data is not None and ctx is not None:  # (both or neither)
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
        if not buffer or not sending.lock.acquire(True, sending.WAIT):
            return
        try:
            while buffer:
                item = buffer[0]
                if type(item) is not Frame or len(item.data) > scm_rights.ATOMIC_MAX:
                    return  # the feeder's: it reports errors (and sends large ones)
                try:
                    if not _try_send(item, self._chan):
                        return
                except Exception:
                    return  # the frame is whole: the feeder meets the error and reports it
                buffer.popleft()
                with self._notempty:
                    self._unsent[0] -= 1
        finally:
            sending.lock.release()

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The stdlib's, receiving a frame with its fds."""
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        chan = self._chan
        acquire = chan.turn_args(block, timeout)
        deadline = None if not block or timeout is None else time.monotonic() + timeout
        held: list[bool] = []  # this thread's turn to receive (see Channel.turn)
        try:
            held.extend(starmap(chan.turn.acquire, (acquire,)))
            if not held[0]:
                raise Empty
            try:
                frame = chan.receive(block, None if deadline is None
                                     else max(0.0, deadline - time.monotonic()))
            except Lost:
                self._sem.release()  # taken off the queue, if not delivered
                raise
            _count(frame, self._sem)
            return chan.take(_reductions.loads, held)  # lets go of the turn as it hands over
        except BaseException:
            # not in finally: after a take, no call may come before the return (a signal
            # handler runs at a call's entry or return, and its exception would lose what
            # take returned)
            chan.disown()
            raise
        finally:
            if held and held[0]: chan.turn.release()  # noqa: E701 (first call of its line)

    async def get_async(self, block: bool = True, timeout: float | None = None) -> Any:
        """:meth:`get`, awaited: tries the channel on a timer (1 to 50 ms: a ring has no fd
        to wait on) in the running event loop instead of blocking it (no thread);
        ``queue.Empty`` as ``get`` raises it.  Concurrent awaiters of one loop get one
        message each, in the order they came (they wait in line, and only the first
        tries).  Cancelling it loses no message: each try is one ``get(False)``, whole or
        not begun."""
        import asyncio
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
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
            pause = 0.001
            while True:
                try:
                    return self.get(False)
                except Empty:
                    if deadline is not None and loop.time() >= deadline:
                        raise
                await asyncio.sleep(pause if deadline is None
                                    else min(pause, max(0.0, deadline - loop.time())))
                pause = min(pause * 2, 0.05)
        finally:
            line.release()

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

    def _undo_put(self, joinable: _Joinable | None) -> None:
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
            args=(self._buffer, self._notempty, self._reader.close, self._writer.close, self._ignore_epipe,
                  self._on_queue_feeder_error, self._sem, self._unsent,
                  self._failures if self._raise_later else None, self._sending,
                  self._chan),
            name="QueueFeederThread", daemon=True)
        try:
            self._thread.start()
        except BaseException:  # gh-109047: creating a thread can fail at finalization
            self._thread = None
            raise
        if not self._joincancelled:
            # (the stdlib's private finalizers are not in its stubs)
            self._jointhread = Finalize(self._thread, _mpq.Queue._finalize_join,  # type: ignore[attr-defined]
                                        [weakref.ref(self._thread)], exitpriority=-5)
        self._close = Finalize(self, _mpq.Queue._finalize_close,  # type: ignore[attr-defined]
                               [self._buffer, self._notempty], exitpriority=10)

    @staticmethod
    def _feed(buffer: collections.deque[Any], notempty: threading.Condition,
              reader_close: Callable[[], None],
              writer_close: Callable[[], None], ignore_epipe: bool,
              onerror: Callable[[BaseException, object], None], queue_sem: BoundedSemaphore,
              unsent: list[int], failures: list[BaseException] | None,
              sending: _Sending, chan: Channel) -> None:
        """The stdlib's ``Queue._feed``, sending the frames ``put`` made.  On an error it
        does what the stdlib's does (EPIPE ignored when asked, nothing reported while the
        process exits, else the semaphore given back and ``onerror(e, obj)`` called), and
        a send that failed is also recorded in ``failures``.  A frame the socket has no
        room for now goes back to the head of the buffer while the feeder waits for room,
        so that a ``put`` can send it meanwhile (see ``_help_send``)."""
        debug("starting thread to feed data to pipe")
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
                        reader_close()
                        writer_close()
                        return
                    done = True
                    try:
                        done = _send_item(item, chan)
                    except Exception as e:
                        if not _feed_failed(e, item, ignore_epipe, onerror, queue_sem,
                                            notempty, failures):
                            return
                    finally:
                        if done:
                            with notempty:
                                unsent[0] -= 1
                    if not done:
                        buffer.appendleft(item)
                if not done:
                    _wait_for_room(waits)
                    waits += 1
                else:
                    waits = 0


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
    r, w = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    q._reader = Connection(r.detach(), writable=False)
    q._writer = Connection(w.detach(), readable=False)
    # a ring as deep as maxsize never fills (the semaphore counts what is in it)
    q._chan = Channel.create(q._reader._sock, q._writer._sock, min(q._maxsize, _RING_DEPTH))
    _spin_as_set(q)
    q._reset()


def _spin_as_set(q: Any) -> None:
    """The channel's reader polls as ``set_receive_spin`` says (its ``_reader``'s wait)."""
    wait = q._reader._wait
    q._chan.ring.spin = 0.0 if wait is None else wait.budget


class ReadTurn:
    """This process's side of a queue's read lock.

    A frame this process has read part of (a ``get(timeout)`` that ran out, an exception
    a signal handler raised mid-frame) stays in its reader; until the rest is read, the
    socket is mid-frame for every other reader, so the queue's read lock stays held by
    this process (``kept``) and the next get of any of its threads resumes the frame.
    ``lock`` lets one thread of this process read at a time: a thread waiting for its
    turn takes over a kept read lock as soon as the turn is its (a thread waiting on the
    read lock itself would wait for good).  Made anew in a forked child, which owns
    neither (its reader lets go of the parent's part-read frame)."""

    __slots__ = ("lock", "kept", "__weakref__")

    KEPT = (("rlock", False),)  # ``kept.pop``'s arguments: take the kept lock over, or not

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kept: dict[str, bool] = {}


_turns: weakref.WeakSet[ReadTurn] = weakref.WeakSet()


def _read_turn() -> ReadTurn:
    turn = ReadTurn()
    _turns.add(turn)
    return turn


def _forked() -> None:
    for turn in list(_turns):
        turn.lock = threading.Lock()
        turn.kept = {}


os.register_at_fork(after_in_child=_forked)

def _then(acquire: tuple[()] | tuple[bool] | tuple[bool, float],
          deadline: float | None) -> tuple[()] | tuple[bool] | tuple[bool, float]:
    """``acquire`` for a second lock, within what is left of ``deadline``."""
    if deadline is None or len(acquire) < 2:
        return acquire
    return True, max(0.0, deadline - time.monotonic())


def _read_locked(reader: Connection, rlock: Lock, turn: ReadTurn,
                 acquire: tuple[()] | tuple[bool] | tuple[bool, float],
                 deadline: float | None) -> scm_rights.Frame | None:
    """``reader.read_frame(deadline)`` with this process's read turn and the queue's read
    lock, each taken with ``acquire`` (its arguments) within ``deadline``: the frame, or
    None (a lock or the frame not had in time).  A read lock this process kept for a
    part-read frame (see :class:`ReadTurn`) is taken over instead of acquired, and kept
    again while a frame stays part-read.  What each acquire (and the take-over) returned
    is recorded with no point between where a signal handler runs (see
    ``scm_rights._FIRST``), and each release is the first call of its line, inside
    ``finally`` blocks, so an exception never leaves a lock held by nobody (the stdlib
    Lock's ``__exit__`` is Python code, where a handler can run: ``with`` is not used)."""
    held: list[bool] = []  # [the turn, the kept read lock taken over, (the read lock)]
    try:
        held.extend(starmap(turn.lock.acquire, (acquire,)))
        if not held[0]:
            return None
        held.extend(starmap(turn.kept.pop, turn.KEPT))
        if not held[1]:
            held.extend(starmap(rlock.acquire, (_then(acquire, deadline),)))
        return reader.read_frame(deadline) if held[-1] else None
    finally:
        try:
            if held[1:] and held[-1]:
                # no call before the keep or the release: the frame's state decides
                if reader._frames._parts: turn.kept["rlock"] = True  # noqa: E701
                else: rlock.release()  # noqa: E701
        finally:
            if held and held[0]: turn.lock.release()  # noqa: E701 (first call of its line)


@final
class _Sending:
    """Who takes frames off a queue's buffer to send them: the feeder, or a put helping
    it (``lock``)."""

    __slots__ = ("lock",)

    WAIT = 0.005  # seconds a put waits for the feeder's turn

    def __init__(self) -> None:
        self.lock = threading.Lock()


def _try_send(item: Frame, chan: Channel) -> bool:
    """Send a frame if the channel takes it now: True (and its buffer let go), or False
    with nothing sent (the channel full).  An error leaves the frame whole."""
    try:
        chan.send(item.data, item.ctx.wire_fds(), False)
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


class SimpleQueue(_SimpleQueueBase):
    """``multiprocessing.SimpleQueue`` that moves arrays through shared memory.  As the
    stdlib's, ``put`` pickles and sends in the caller's thread, so every error raises
    there."""

    def __init__(self, *, ctx: Any) -> None:
        super().__init__(ctx=ctx)
        self._reader.close()
        self._writer.close()
        self._reader, self._writer = Pipe(duplex=False)
        self._poll = self._reader.poll
        self._turn = _read_turn()  # this process's side of the read lock

    def __setstate__(self, state: Any) -> None:
        super().__setstate__(state)
        self._turn = _read_turn()

    def get(self) -> Any:
        _read_locked(self._reader, self._rlock, self._turn, (), None)
        return self._reader.take(_reductions.loads)

    async def get_async(self) -> Any:
        """:meth:`get`, awaited: waits for the socket to be readable in the running event
        loop instead of blocking it (no thread); see :meth:`Queue.get_async`."""
        from . import _aio  # asyncio loads with the first awaitable call
        await _aio.read_frame(self._reader, self._rlock, self._turn)
        return self._reader.take(_reductions.loads)

    async def put_async(self, obj: object) -> None:
        """:meth:`put`, awaited: pickles in the caller's step, then sends without blocking
        the loop.  A frame the socket takes whole is sent at once; a larger one (or one
        that finds the socket full) goes out piece by piece on writer readiness, under the
        queue's write lock, which it holds until the frame is whole (taken without
        blocking, tried again on a timer while another writer holds it).  A call
        cancelled before its frame began sends nothing; one cancelled after it began is
        finished in the background (never half a frame), so its object is delivered.
        Sends from one loop keep their order.  Await it before a :meth:`put` in the
        same thread: that ``put`` would wait for the write lock this loop holds."""
        from . import _aio  # asyncio loads with the first awaitable call
        data, ctx = dumps_to_send(obj, "put() failed")
        await _aio.send(self._writer, data, ctx, self._wlock, "put() failed")

    def put(self, obj: object) -> None:
        data, ctx = dumps_to_send(obj, "put() failed")
        try:
            if self._wlock is None:
                self._writer.send_frame(data, ctx.wire_fds())
            else:
                with self._wlock:
                    self._writer.send_frame(data, ctx.wire_fds())
        except OSError as e:
            data = None  # type: ignore[assignment]  # see send_error
            raise send_error(e, "put() failed")
        finally:
            ctx.release()
