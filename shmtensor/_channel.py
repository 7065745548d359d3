"""A channel of messages (bytes and fds) between shmtensor's own ends, on a ring.

The bytes of a message travel through an ``ipc.ring.Ring`` in shared memory: no syscall
per message unless a side sleeps.  A message that carries fds, or that is longer than a
record, has a record of its kind and a tag in the ring and its body in a datagram of a
``SOCK_SEQPACKET`` socket pair beside it (a message longer than a datagram in a one-shot
memfd whose fd the datagram carries).  The datagram is sent under the ring's writers' lock
before its record, and starts with the record's number and the tag, so the reader of a
record finds its datagram, and closes one whose writer died before writing its record (an
orphan: a lower number, or the same number with another tag, as the next writer reuses
the number).  See docs/architecture.md, "Queues on a channel".

What a receive takes is kept here, per process, until it is handed over
(:meth:`Channel.take`): an exception raised anywhere in a receive (a signal handler's)
leaves the message for this process's next receive, as ``scm_rights.FrameReader`` does for
the socket channels.  A record the ring offers again after such an exception (its ``head``
had not moved) is recognised by its number and not taken twice.

A channel can be waited on through an fd (:meth:`Channel.wait_fd`, which
``multiprocessing.connection.wait`` reaches through a SimpleQueue's ``_reader``): from the
first such wait on, a *waitable* channel's writers send each record that has no datagram a
*tick* (a datagram of the record's number and tag 0, no body) under the writers' lock,
before the record, and its reader takes the tick with the record, so the side socket is
readable exactly while a record waits.  Until then no record costs a syscall.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import mmap
import os
import queue
import select
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from itertools import starmap
from multiprocessing import reduction
from typing import Any, TypeVar, cast

from shmtensor.ipc import scm_rights
from shmtensor.ipc.ring import Ring

_T = TypeVar("_T")

_INLINE, _SIDE, _BIG = b"I", b"S", b"B"
_TAG = struct.Struct("=Q")  # a side record: its kind, then its datagram's tag
_HEAD = struct.Struct("=QQ")  # a datagram's head: its record's number, its tag
SIDE_MAX = 64 << 10  # a body up to this goes in the datagram itself; a longer one in a memfd
_DATAGRAM_MAX = _HEAD.size + SIDE_MAX
_ANC = socket.CMSG_SPACE(scm_rights.MAX_FDS * 4)
_TAKE = socket.MSG_DONTWAIT | getattr(socket, "MSG_CMSG_CLOEXEC", 0)
_TRUNC = int(socket.MSG_TRUNC)
CAPACITY = 1024
RECORD = 1280  # a 1 KiB array and its pickle fit a record
# The ring's user word of a waitable channel that says whether writers tick: 0 no, TICKING
# since a wait set it, SYNCED once every write begun before that is whole (see wait_fd)
_WAITED, _TICKING, _SYNCED = 2, 1, 2
_SYNC_WAIT = 1.0  # seconds a wait_fd waits for the writers' lock (a writer may wait for room)
# A receive that waits without a deadline looks for unwritten records' datagrams (see
# _drop_unwritten) after this many seconds of an empty ring, and again each time after.
_IDLE_LOOK = 1.0


# A side message's tag: this process's pid and a count, so a datagram whose writer died
# before its record (an orphan) is never taken for the record written after it at the
# same ring number by another writer.
_count = itertools.count(1)
_pid_tag = [os.getpid() << 32]
os.register_at_fork(after_in_child=lambda: _pid_tag.__setitem__(0, os.getpid() << 32))


def _new_tag() -> int:
    return _pid_tag[0] | (next(_count) & 0xFFFFFFFF)


class Lost(OSError):
    """A message whose body a reader of another process took and never finished (an
    exception, a signal handler's, cut its receive short): it is gone."""


class Channel:
    """One channel's ends in this process: ``send`` and ``receive`` of (bytes, fds)."""

    __slots__ = ("ring", "turn", "waitable", "_side_r", "_side_w", "_taken", "_last", "_raw",
                 "_made", "_handing", "_pid", "_spent", "_close", "__weakref__")

    def __init__(self, ring: Ring, side_r: socket.socket, side_w: socket.socket) -> None:
        self.ring, self._side_r, self._side_w = ring, side_r, side_w
        # the ring's fds close with the channel (its sockets are its owner's to close)
        self._close = weakref.finalize(self, ring.close)
        self._close.atexit = False  # a daemon feeder may still be sending at exit
        # whether records tick once someone waits on the fd (see wait_fd): set by the
        # owner in every process that has the channel (a SimpleQueue's are; a Queue's not)
        self.waitable = False
        self._reset()

    @classmethod
    def create(cls, side_r: socket.socket, side_w: socket.socket, capacity: int = CAPACITY,
               record_size: int = RECORD) -> Channel:
        """A new channel of ``capacity`` records whose side path is the connected
        ``SOCK_SEQPACKET`` pair (``side_r``, ``side_w``), which the caller owns: once every
        process has closed ``side_r``, ``send`` raises ``BrokenPipeError`` as a pipe's
        writer does."""
        return cls(Ring.create(capacity, record_size), side_r, side_w)

    def ring_state(self) -> Any:
        """The ring, as :meth:`attach` takes it in another process (pickled)."""
        return reduction.DupFd(self.ring.fd)

    @classmethod
    def attach(cls, ring_state: Any, side_r: socket.socket, side_w: socket.socket) -> Channel:
        """This process's ends of a channel: ``ring_state`` from :meth:`ring_state`, and
        this process's copies of its sockets."""
        fd = ring_state.detach()
        try:
            ring = Ring.attach(fd)
        finally:
            os.close(fd)
        return cls(ring, side_r, side_w)

    def _reset(self) -> None:
        # (record number, frame) taken off the ring, not yet handed over
        self._taken: list[tuple[int, scm_rights.Frame]] = []
        self._last = [-1]  # the number of the last record this process took
        self._raw: list[Any] = []  # a datagram read and not yet parsed
        self._made = 0  # the tag of the last datagram made a frame (it may linger in _raw)
        # the thread handing _taken[0] over (0: none): it lets go of the turn before it
        # drops the frame, and another thread's receive waits for that (see take)
        self._handing = 0
        self._spent: list[int] = []  # a taken record's memfd, closed by the next receive
        self._pid = os.getpid()
        # one thread of this process receives at a time, from receive to take: what a
        # receive took is this process's, and the next receive of any thread hands it over
        self.turn = threading.Lock()

    def turn_args(self, block: bool,
                  timeout: float | None) -> tuple[()] | tuple[bool] | tuple[bool, float]:
        """``turn.acquire``'s arguments for a receive with ``block`` and ``timeout`` (in
        a forked child, the parent's frames let go of first)."""
        if self._pid != os.getpid():
            self._forked()
        if not block:
            return (False,)
        return () if timeout is None else (True, max(0.0, timeout))

    # -- sending -----------------------------------------------------------------------

    def send(self, data: bytes, fds: Sequence[int] = (), block: bool = True,
             timeout: float | None = None) -> None:
        """Send one message; with a full channel, wait for room (``block``, up to
        ``timeout``) or raise ``queue.Full``.  The caller keeps ``fds`` (they are
        duplicated into the message)."""
        ring = self.ring
        if self._side_r.fileno() < 0 and self.readers_gone():
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))  # described by the caller
        if not fds and len(data) < ring.payload_max:
            if self.waitable:
                ring.put(_INLINE + data, block, timeout, hook=self._ticker(block, timeout))
            else:
                ring.put(_INLINE + data, block, timeout)
            return
        deadline = None if not block or timeout is None else time.monotonic() + timeout
        big = len(data) > SIDE_MAX
        body: list[int] = []  # the body's memfd: closed however this ends
        try:
            if big:
                if not block and ring.full():
                    raise queue.Full  # before the body is copied into a memfd for nothing
                _memfd_of(data, body)
            tag = _new_tag()

            def side(number: int) -> None:
                self._send_side(_HEAD.pack(number, tag), b"" if big else data,
                                [*body, *fds], block, deadline)
            ring.put((_BIG if big else _SIDE) + _TAG.pack(tag), block, timeout, hook=side)
        finally:
            scm_rights.close_fds(body)

    def _ticker(self, block: bool, timeout: float | None) -> Callable[[int], None]:
        """The put hook of a record with no datagram on a waitable channel: under the
        writers' lock, it sends the record's tick if someone waits on the fd."""
        deadline = None if not block or timeout is None else time.monotonic() + timeout
        user = cast(memoryview, self.ring.user)

        def tick(number: int) -> None:
            if user[_WAITED]:
                self._send_side(_HEAD.pack(number, 0), b"", [], block, deadline)
        return tick

    def _send_side(self, head: bytes, data: bytes, fds: list[int], block: bool,
                   deadline: float | None) -> None:
        sock = self._side_w
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] \
            if fds else []
        while True:
            try:
                sock.sendmsg([head, data], anc, socket.MSG_DONTWAIT)
                return
            except BlockingIOError:
                if not block:
                    raise queue.Full from None
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise queue.Full
            poller = select.poll()
            poller.register(sock, select.POLLOUT)
            poller.poll(None if left is None else max(1, int(left * 1000)))

    # -- receiving ---------------------------------------------------------------------

    def receive(self, block: bool = True, timeout: float | None = None) -> scm_rights.Frame:
        """The next message of this process, as a frame for :meth:`take`: one an earlier
        receive took and did not hand over, else the ring's next (waiting as
        ``queue.Queue.get`` does, ``queue.Empty`` at the deadline).  ``Lost`` for a
        message another process's interrupted receive took the body of."""
        if self._pid != os.getpid():
            self._forked()
        me = threading.get_ident()
        while self._handing and self._handing != me:
            time.sleep(0)  # another thread is handing taken[0] over: it drops it next
        if self._spent:  # left by a hook an exception cut short
            scm_rights.close_fds(self._spent)
            self._spent = []
        taken = self._taken
        if not taken:
            deadline = None if not block or timeout is None else time.monotonic() + timeout
            while not taken:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    self.ring.get(block, _IDLE_LOOK if left is None else left,
                                  hook=self._take_record)
                except queue.Empty:
                    if not taken:
                        self._drop_unwritten()
                    if not block or deadline is not None:
                        raise
        number, frame = taken[0]
        if frame.dead:
            self._last[0] = number; del taken[0]  # noqa: E702 (one step)
            raise Lost(errno.EPIPE, "a message on this queue was lost: a receive that "
                       "took its body did not finish (its process was killed, or "
                       "interrupted), or the message was malformed; the queue goes on")
        return frame

    def take(self, load: Callable[..., _T], held: list[bool]) -> _T:
        """``load(data, fds)`` of the frame :meth:`receive` returned (see
        ``scm_rights.FrameReader.take``: the same hand-over, with the same guarantees).
        ``held``: ``[True]`` while the caller holds :attr:`turn`, which the hand-over
        lets go of (and marks so) before it hands the result over: an exception right
        after that leaves the result for this process's next receive, never lost."""
        number, frame = self._taken[0]
        self._handing = threading.get_ident()
        if not frame.result:
            try:
                frame.result.extend(map(frame.hand_to, (load,), ((),)))
            except BaseException:
                if frame.started and not frame.result:
                    frame.dead = True
                    self._last[0] = number; del self._taken[0]  # noqa: E702
                    scm_rights.close_fds(frame.fds)
                raise
        # one line, one call (the turn let go of, first marked so): then handed over, and
        # never taken again, in one step.  A thread that gets the turn at that call's
        # return waits in receive until _handing is cleared here; an exception there
        # leaves the frame and _handing for disown (the caller's finally)
        held[0] = False; self.turn.release(); self._last[0] = number; del self._taken[0]; self._handing = 0; return frame.result[0]  # type: ignore[no-any-return]  # noqa: E702,E501

    def disown(self) -> None:
        """After a receive of this thread, in the caller's ``finally``: a frame it did not
        finish handing over (an exception) is left to the next receive of any thread."""
        if self._handing == threading.get_ident():
            self._handing = 0

    def _take_record(self, number: int, writer: int, data: bytes) -> None:
        """The ring's get hook: runs under its readers' lock before ``head`` moves."""
        taken = self._taken
        if number <= self._last[0] or (taken and taken[-1][0] >= number):
            return  # taken already by this process (an exception before head moved)
        kind = data[:1]
        if kind == _INLINE:
            if self.waitable and cast(memoryview, self.ring.user)[_WAITED]:
                self._take_tick(number)
            taken.append((number, scm_rights.Frame(data[1:], [])))
            return
        if len(data) < 1 + _TAG.size:  # malformed (not a writer's of this channel): lost
            taken.append((number, _lost()))
            return
        tag = _TAG.unpack_from(data, 1)[0]
        frame, spent = self._side_frame(number, kind == _BIG, tag)
        if frame.dead:
            taken.append((number, frame))
            return
        # the datagram is the frame's from here on (a lingering copy in _raw is known by
        # its tag), its memfd (if any) in _spent
        self._spent = spent; self._made = tag; taken.append((number, frame))  # noqa: E702
        self._raw.clear()
        scm_rights.close_fds(spent)

    def _drop_unwritten(self) -> None:
        """With the ring found empty: close the datagrams of records that were never
        written (their writer was killed between the two), which no later record's
        reader has met yet, so that the segments they name are not held meanwhile.
        Under the writers' lock no write is in progress, so a datagram numbered at or
        past ``tail`` has no record and never will.  Nothing when a writer holds the
        lock, or this process has a datagram in hand."""
        if self._raw or self._taken or not self.ring.empty():
            return
        try:
            self.ring.sync_writers(0.0, self._close_unwritten)
        except (TimeoutError, OSError):
            pass  # a writer is writing (its record comes), or the ring closed: next time

    def _close_unwritten(self) -> None:
        tail = self.ring.tail
        while (front := self._front()) is not None and not 0 <= front[0] < tail:
            self._drop_front()  # no record has its number, or junk

    def _take_tick(self, number: int) -> None:
        """Take record ``number``'s tick off the side socket, if it has one (it was
        written after the first wait_fd): the datagram at the front, looked at first.
        Orphans on the way (numbered below, or a side record's at this number) are
        closed; a later record's datagram is left."""
        while (front := self._front()) is not None and front[0] <= number:
            self._drop_front()
            if front == (number, 0):
                return

    def _front(self) -> tuple[int, int] | None:
        """The side socket's next datagram's (number, tag), left there: None when there
        is none, (-1, -1) for junk too short to have them."""
        try:
            head = self._side_r.recv(_HEAD.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        return cast("tuple[int, int]", _HEAD.unpack(head)) if len(head) == _HEAD.size \
            else (-1, -1)

    def _drop_front(self) -> None:
        """Take the side socket's next datagram and close the fds it carries."""
        raw: list[Any] = []
        try:
            raw.extend(starmap(self._side_r.recvmsg, ((_DATAGRAM_MAX, _ANC, _TAKE),)))
        finally:
            scm_rights.close_fds(scm_rights._collect(raw)[0])

    def _side_frame(self, number: int, big: bool,
                    tag: int) -> tuple[scm_rights.Frame, list[int]]:
        """The body of record ``number`` (its datagram, tagged ``tag``) off the side
        socket.  Orphans (datagrams of records never written: their writer died between
        the two) are closed on the way: numbered below the record, or at its number with
        another tag; so is junk, numbered above it.  A reader marks in the ring's header
        (``began``) the record whose datagram it goes to take, so the next reader of a
        record whose datagram a reader took and never finished with (killed, or
        interrupted in another process) finds it gone without reading a later record's
        datagram: a dead frame."""
        # began[0]: the number + 1 of the last record whose datagram a reader began to
        # take; began[1]: that reader's pid
        raw, sock, began = self._raw, self._side_r, cast(memoryview, self.ring.user)
        mine = False
        while True:
            if not raw:
                if not mine:
                    # a reader of another process began to take this record's datagram
                    # and did not finish (killed, or its receive cut short): gone, and
                    # any later datagram stays in the socket for its own record's reader.
                    # This process's own note, with nothing in _raw, is a receive cut
                    # short before its read (the read and its record are one step)
                    if began[0] > number and began[1] != self._pid:
                        return _lost(), []
                    began[1] = self._pid; began[0] = number + 1; mine = True  # noqa: E702
                try:
                    raw.extend(starmap(sock.recvmsg, ((_DATAGRAM_MAX, _ANC, _TAKE),)))
                except BlockingIOError:
                    return _lost(), []  # gone: its reader died before it stored began
            data, flags = raw[0][0], raw[0][2]
            fds, _ = scm_rights._collect(raw)
            got, its_tag = _HEAD.unpack_from(data) if len(data) >= _HEAD.size else (-1, -1)
            if its_tag == self._made:  # made a frame already (the hook was cut short after)
                raw.clear()
                continue
            if got == number and its_tag == tag:
                if flags & _TRUNC or (big and not fds):  # malformed: dropped
                    raw.clear()
                    scm_rights.close_fds(fds)
                    return _lost(), []
                if big:  # the body's memfd, closed once the frame is taken
                    try:
                        body = _read_memfd(fds[0])
                    except (OSError, ValueError, MemoryError, OverflowError):
                        # not a body (a peer's bad fd, or no memory for it): lost, once
                        raw.clear()
                        scm_rights.close_fds(fds)
                        return _lost(), []
                    return scm_rights.Frame(body, fds[1:]), fds[:1]
                return scm_rights.Frame(bytes(memoryview(data)[_HEAD.size:]), fds), []
            # an orphan, or junk: numbered past this record (a record's datagram is only
            # read by its reader, after the note): closed either way
            raw.clear()
            scm_rights.close_fds(fds)

    def readers_gone(self) -> bool:
        """Whether no process reads this channel any more: every reading end (this
        process's included) closed, as a pipe with no reader.  A syscall: ``send`` asks
        only once this process has closed its own reading end."""
        try:
            poller = select.poll()
            poller.register(self._side_w, select.POLLOUT)
            return any(ev & (select.POLLHUP | select.POLLERR) for _, ev in poller.poll(0))
        except (OSError, ValueError):  # the writing end closed too: the send says so
            return False

    def empty(self) -> bool:
        return not self._taken and self.ring.empty()

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether a message waits for this process, after waiting up to ``timeout``
        seconds (None: until one comes) for one, without taking it."""
        if self._pid != os.getpid():
            self._forked()
        return bool(self._taken) or self.ring.poll(timeout)

    def wait_fd(self) -> int:
        """An fd that polls readable while a message waits, for one wait: the ring's
        memfd (always readable) if one waits now, else the side socket, on which each
        record written from now on sends a tick (a waitable channel's).  The first call
        turns ticking on for every writer, and makes sure that no write begun before
        it is still going on (the writers' lock, taken and let go of), so a record
        written after the look for one has its tick.  A reader that waits for a
        message on another reader's behalf may be woken for one that reader has just
        taken, as with a pipe."""
        ring = self.ring
        user = cast(memoryview, ring.user)
        if user[_WAITED] != _SYNCED:
            user[_WAITED] = _TICKING
            if not ring.empty():
                return ring.fd  # ready now; the writers are made sure of by a later wait
            try:
                ring.sync_writers(_SYNC_WAIT)
            except TimeoutError:  # a writer holds the lock: ready, to look again
                return ring.fd
            user[_WAITED] = _SYNCED
        return ring.fd if not self.empty() else self._side_r.fileno()

    def _forked(self) -> None:
        """A forked child: the parent's taken frames are the parent's to deliver."""
        for _, frame in self._taken:
            scm_rights.close_fds(frame.fds)
        fds, _ = scm_rights._collect(self._raw)
        scm_rights.close_fds(fds)
        scm_rights.close_fds(self._spent)
        self._reset()

    def close(self) -> None:
        self._close()


def _lost() -> scm_rights.Frame:
    lost = scm_rights.Frame(b"", [])
    lost.dead = True
    return lost


# A long body's memfd is sealed once written: its reader maps a file whose size and bytes
# no process can change under it (a shrunk mapping would kill the reader with SIGBUS).
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def _memfd_of(data: bytes, into: list[int]) -> None:
    """A sealed memfd holding ``data``, appended to ``into`` in the step that makes it (the
    caller closes it, whatever is raised after)."""
    into.extend(map(os.memfd_create, ("shmtensor_message",),
                    (os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING,)))
    fd = into[-1]
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS | fcntl.F_SEAL_SEAL)


def _read_memfd(fd: int) -> bytes | bytearray:
    """The body in a sealed memfd; ``ValueError`` for any other fd (not a writer's of this
    channel)."""
    try:
        sealed = fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS == _SEALS
    except OSError:
        sealed = False  # not a memfd
    if not sealed:
        raise ValueError("a long message's body came in a file that is not a sealed memfd")
    size = os.fstat(fd).st_size
    if not size:
        return b""
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
        return bytearray(m)
