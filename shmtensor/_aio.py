"""Awaitable receive and send on a ``Connection``, driven by the event loop's readiness.

``Connection.recv_async``/``send_async`` wait in the running event loop for the
connection's socket (``loop.add_reader``/``add_writer``) and never block it: no thread per
call, no thread at all.  (The queues, on a ring, try it on a timer: see ``_queues``; their
semaphore waits use :func:`acquire`.)  Facts this module is built on:

* asyncio keeps one reader callback per fd per loop, so the awaiters of one socket in one
  loop wait in line (:class:`_Line`): the first one (the head) watches the socket, the
  others wait for their turn.  The head reads without blocking (``read_frame`` with a
  deadline already passed), and when the frame is not whole yet it waits for readability
  again; what it read stays in the connection's ``FrameReader``.
* Nothing is taken off the socket for an awaiter that will not run: the head reads the
  frame and unpickles it with no ``await`` in between, and passes its turn on as it
  leaves, however it leaves.  A cancelled awaiter (waiting in line, watching the socket,
  or woken and not yet run) therefore loses no message, and a frame it read in part stays
  in the ``FrameReader`` for the next receive of this process, synchronous or not.  It
  leaves no reader registered.
* A queue's semaphore has no fd to wait on: it is tried again on a timer, after 1 ms,
  doubling up to 50 ms.
* A send that the socket takes whole at once (a frame of at most ``ATOMIC_MAX`` bytes and
  room in the socket) is done in the caller's step.  Otherwise the frame goes to the
  connection's sender in this loop (:class:`_Sender`, one task per connection and loop,
  in order), which writes it piece by piece without blocking, each piece's fds on its
  first byte, waiting for writability between pieces.  A send cancelled before its first
  byte went out sends nothing; one cancelled after is finished by the sender (a socket is
  never left mid-frame), so its message is delivered.  If the loop itself stops (its
  tasks cancelled) mid-frame, the sender finishes that frame with blocking writes.

Rules for the caller, as for the synchronous calls: one loop reads a ``Connection``, and a
synchronous ``send()`` on an end whose ``send_async`` has not finished (awaited, or its
task done) may interleave with it: await the asynchronous sends first.
"""

from __future__ import annotations

import asyncio
import collections
import socket
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from shmtensor.ipc import scm_rights

from . import _log

if TYPE_CHECKING:
    from ._connection import Connection
    from ._wire import SendContext

__all__ = ["read_frame", "acquire", "send", "closing", "loop_time"]

_T = TypeVar("_T")
_RETRY_FIRST = 0.001        # a semaphore held elsewhere: first retry after (s)
_RETRY_MAX = 0.05           # ... doubling up to this


class _Lock(Protocol):
    """A multiprocessing Lock or Semaphore (their C ``acquire``/``release``)."""

    def acquire(self, block: bool = ..., timeout: float | None = ...) -> bool: ...

    def release(self) -> None: ...


def _settle(fut: asyncio.Future[_T], value: _T) -> None:
    if not fut.done():
        fut.set_result(value)


def _running() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class _Line:
    """The awaiters of one socket's readable end in one loop, served one at a time, in
    the order they came.  ``busy``: a head is reading, or has been handed the turn and
    has not run yet; ``watch``: what the head waits on (woken when the channel closes)."""

    __slots__ = ("loop", "waiting", "busy", "watch")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.waiting: collections.deque[asyncio.Future[bool]] = collections.deque()
        self.busy = False
        self.watch: asyncio.Future[None] | None = None

    async def enter(self, deadline: float | None) -> bool:
        """Wait for this awaiter's turn; False if ``deadline`` (loop time) passed first."""
        if not self.busy:
            self.busy = True
            return True
        turn: asyncio.Future[bool] = self.loop.create_future()
        self.waiting.append(turn)
        timer = None if deadline is None else self.loop.call_at(deadline, _settle, turn, False)
        try:
            mine = await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled() and turn.result():
                self.leave()  # handed the turn, then cancelled before it ran: pass it on
            else:
                self._drop(turn)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if not mine:
            self._drop(turn)
        return mine

    def _drop(self, turn: asyncio.Future[bool]) -> None:
        try:
            self.waiting.remove(turn)
        except ValueError:
            pass

    def leave(self) -> None:
        """Hand the turn to the next awaiter still waiting, or free the line."""
        while self.waiting:
            turn = self.waiting.popleft()
            if not turn.done():
                turn.set_result(True)  # the line stays busy: the turn is its
                return
        self.busy = False


def _line(conn: Connection, loop: asyncio.AbstractEventLoop) -> _Line:
    lines = conn._lines
    if lines is None:
        lines = conn._lines = {}
    line = lines.get(loop)
    if line is None:
        line = lines[loop] = _Line(loop)
    return line


def _forget(conn: Connection, loop: asyncio.AbstractEventLoop, line: _Line) -> None:
    """Drop ``loop``'s line once nobody is in it (a line keeps no loop alive)."""
    lines = conn._lines
    if not line.busy and not line.waiting and lines is not None and lines.get(loop) is line:
        del lines[loop]


async def _ready(loop: asyncio.AbstractEventLoop, fd: int, write: bool, until: float | None,
                 line: _Line | None = None, stop: asyncio.Future[None] | None = None,
                 watch: asyncio.Future[None] | None = None) -> None:
    """Wait until ``fd`` is readable (``write``: writable), loop time ``until`` passes,
    ``stop`` is done or ``watch`` (the future waited on) is woken; the watch is removed
    however the wait ends."""
    fut: asyncio.Future[None] = loop.create_future() if watch is None else watch
    timer = None if until is None else loop.call_at(until, _settle, fut, None)
    def stopped(_: object) -> None:
        _settle(fut, None)
    if stop is not None:
        stop.add_done_callback(stopped)
    if write:
        loop.add_writer(fd, _settle, fut, None)
    else:
        loop.add_reader(fd, _settle, fut, None)
    if line is not None:
        line.watch = fut
    try:
        await fut
    finally:
        if line is not None:
            line.watch = None
        if stop is not None:
            stop.remove_done_callback(stopped)
        if timer is not None:
            timer.cancel()
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


async def read_frame(conn: Connection, block: bool = True,
                     timeout: float | None = None) -> scm_rights.Frame | None:
    """Wait in the running loop, without blocking it, until a whole frame is ready in
    ``conn``'s reader: the frame (``conn.take`` hands it over: the caller does so with no
    ``await`` in between), or None when ``block`` is false and none is ready, or when
    ``timeout`` (seconds, for the whole frame) passed first."""
    loop = asyncio.get_running_loop()
    now = loop.time()
    deadline = now if not block else None if timeout is None else now + max(timeout, 0.0)
    line = _line(conn, loop)
    if not block and line.busy:
        return None  # a head is waiting: nothing whole is there
    try:
        entered = await line.enter(deadline)
    except BaseException:
        _forget(conn, loop, line)
        raise
    if not entered:
        _forget(conn, loop, line)
        return None
    try:
        while True:
            frame = conn.read_frame(0.0)  # never blocks; what it read stays in the reader
            if frame is not None:
                return frame
            if deadline is not None and loop.time() >= deadline:
                return None
            await _ready(loop, conn.fileno(), False, deadline, line)
    finally:
        line.leave()
        _forget(conn, loop, line)


async def acquire(sem: _Lock, block: bool, timeout: float | None) -> bool:
    """``sem.acquire(block, timeout)`` without blocking the loop (a semaphore has no fd to
    wait on: it is tried again on a timer).  True: acquired, and nothing awaited since."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + max(timeout, 0.0)
    retry = _RETRY_FIRST
    while not sem.acquire(False):
        now = loop.time()
        if not block or (deadline is not None and now >= deadline):
            return False
        await asyncio.sleep(retry if deadline is None else min(retry, deadline - now))
        retry = min(retry * 2, _RETRY_MAX)
    return True


def closing(conn: Connection) -> None:
    """``conn`` is closing: wake each loop's reader and sender that watch its socket; their
    next step raises (``handle is closed``) instead of watching a closed fd."""
    running = _running()
    watchers: list[_Line | _Sender] = [*(conn._lines or {}).values(),
                                        *(conn._senders or {}).values()]
    for w in watchers:
        fut, loop = w.watch, w.loop
        if fut is None:
            continue
        if loop is running:
            _settle(fut, None)
            continue
        try:
            loop.call_soon_threadsafe(_settle, fut, None)
        except RuntimeError:  # that loop is closed: nothing waits in it any more
            pass


# -- sending ------------------------------------------------------------------------------


def _pieces(data: Any, fds: list[int]) -> list[tuple[memoryview, list[int]]]:
    """The frame ``scm_rights.send_frame`` sends, as pieces a writer sends one after the
    other: each piece's fds ride on its first byte (the header carries the first
    ``MAX_FDS``, a one-byte piece each ``MAX_FDS`` more), then the payload."""
    view = memoryview(data).cast("B")
    most = scm_rights.MAX_FDS
    pieces = [(memoryview(scm_rights._header(len(view), fds)), fds[:most])]
    pieces += [(memoryview(b"\0"), fds[i:i + most]) for i in range(most, len(fds), most)]
    if len(view):
        pieces.append((view, []))
    return pieces


class _Job:
    """One frame for a :class:`_Sender`: its pieces, how far it went, and the future its
    ``send`` awaits (cancelled: send nothing unless a byte already went out)."""

    __slots__ = ("pieces", "ctx", "done", "at", "pos", "started")

    def __init__(self, data: Any, ctx: SendContext, done: asyncio.Future[None]) -> None:
        self.pieces = _pieces(data, ctx.wire_fds())
        self.ctx: SendContext | None = ctx
        self.done = done
        self.at = self.pos = 0    # the piece being sent, and how much of it went
        self.started = False      # a byte went out: the frame must be finished

    def release(self) -> None:
        """Let go of the message (its segments' pins, its bytes), once."""
        ctx, self.ctx = self.ctx, None
        self.pieces = []
        if ctx is not None:
            ctx.release()

    def dropped(self) -> bool:
        """Its ``send`` was cancelled before a byte went out: it is not sent."""
        return self.done.cancelled() and not self.started

    def write(self, sock: socket.socket, flags: int) -> bool:
        """Send what the socket takes (``flags``: MSG_DONTWAIT, or 0 to block until all
        went); True once the whole frame went out."""
        while self.at < len(self.pieces):
            buf, fds = self.pieces[self.at]
            try:
                sent = sock.sendmsg([buf[self.pos:]], [] if self.pos else scm_rights._anc(fds),
                                    flags)
            except BlockingIOError:
                return False
            self.started = True
            self.pos += sent
            if self.pos == len(buf):
                self.at, self.pos = self.at + 1, 0
        return True


class _Sender:
    """The frames waiting to go out on one connection from one loop, sent in order by one
    task, which ends when none is left."""

    __slots__ = ("conn", "loop", "jobs", "task", "watch")

    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop) -> None:
        self.conn, self.loop = conn, loop
        self.jobs: collections.deque[_Job] = collections.deque()
        self.task: asyncio.Task[None] | None = None
        self.watch: asyncio.Future[None] | None = None

    async def run(self, what: str) -> None:
        try:
            while self.jobs:
                await self._send(self.jobs[0], what)
                self.jobs.popleft()
        finally:
            for job in self.jobs:  # the loop is stopping: what never began is not sent
                if not job.started:
                    job.done.cancel()
                job.release()
            self.jobs.clear()
            senders = self.conn._senders
            if senders is not None and senders.get(self.loop) is self:
                del senders[self.loop]

    async def _send(self, job: _Job, what: str) -> None:
        from ._connection import send_error
        try:
            while not job.dropped():
                if job.write(self.conn._writer_socket(), socket.MSG_DONTWAIT):
                    _settle(job.done, None)
                    return
                fut = self.watch = self.loop.create_future()
                try:
                    await _ready(self.loop, self.conn.fileno(), True, None, stop=job.done,
                                 watch=fut)
                finally:
                    self.watch = None
        except asyncio.CancelledError:
            if job.started:  # the loop is stopping mid-frame: finish it, blocking
                job.write(self.conn._writer_socket(), 0)
                _settle(job.done, None)
            raise
        except OSError as e:
            job.release()  # see send_error: the error keeps no reference to the message
            err = send_error(e, what)
            if job.done.done():  # its caller went away: nobody else hears of it
                _log.warning("a message whose send_async() was cancelled after it began "
                             "was lost: %s", err)
            else:
                job.done.set_exception(err)
        finally:
            job.release()


async def send(conn: Connection, data: Any, ctx: SendContext, what: str) -> None:
    """Send one frame on ``conn`` from the running loop, after the frames this loop has in
    flight on it (see the module's docstring); ``what``: the call, for errors ("send()
    failed").  ``ctx`` is this call's, released here."""
    from ._connection import send_error
    loop = asyncio.get_running_loop()
    senders = conn._senders
    if senders is None:
        senders = conn._senders = {}
    sender = senders.get(loop)
    if sender is None:  # nothing in flight from this loop: all of it now, if there is room
        try:
            if conn.try_send_frame(data, ctx.wire_fds()):
                ctx.release()
                return
            job = _Job(data, ctx, loop.create_future())
        except BaseException as e:
            ctx.release()
            if isinstance(e, OSError):
                data = None  # see send_error
                raise send_error(e, what)
            raise
        sender = senders[loop] = _Sender(conn, loop)
    else:
        job = _Job(data, ctx, loop.create_future())
    sender.jobs.append(job)
    if sender.task is None:
        sender.task = loop.create_task(sender.run(what))
    try:
        await asyncio.shield(job.done)
    except asyncio.CancelledError:
        if not job.started:
            job.done.cancel()  # not begun: it never will be (the sender skips it)
            if job in sender.jobs and sender.jobs[0] is not job:
                sender.jobs.remove(job)
                job.release()
        raise


def loop_time() -> float:
    """The running loop's clock (what deadlines here are in)."""
    return asyncio.get_running_loop().time()
