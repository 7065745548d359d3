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

import array
import collections
import errno
import fcntl
import functools
import hashlib
import itertools
import mmap
import os
import pickle
import queue
import resource
import select
import signal
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from itertools import starmap
from multiprocessing import reduction
from multiprocessing.util import Finalize, register_after_fork
from typing import Any, TypeVar, cast

from shmtensor.ipc import ofd_lease, scm_rights, shm_space
from shmtensor.ipc.posix_shm import process_tag
from shmtensor.ipc.ring import MAX_PROCS, Ring

from . import _reductions
from ._wire import LaneContext, Payload, SendContext

_T = TypeVar("_T")

_INLINE, _SIDE, _BIG = b"I", b"S", b"B"
_ANN, _HELD = b"A", b"H"  # a handle's announce (a side record), and its record without fds
_TAG = struct.Struct("=Q")  # a side record: its kind, then its datagram's tag
# an announce: its datagram's tag, the inodes of the memory's memfd (0: in no file) and of
# its lease file, the writer's fd number of the memfd, its process index in the ring, and 1
# for a segment of its own (0 for a slab)
_ANN_HEAD = struct.Struct("=QQQiiB")
# a handle's record without fds: the writer's pid, its fds of the memory's memfd and of
# the lease file, their inodes, and the reader word it was written under
_HELD_HEAD = struct.Struct("=IiQiQQ")
# a record without fds that sends memory back to the process that made it (see post): the
# maker's tag (of its lease table's id: _tag) and the memory's slot in that table, then
# the fields of a handle's record (_HELD_HEAD: this writer's fds, for another reader)
_FWD = b"F"
_FWD_HEAD = struct.Struct("=QI")
# The ring's user word that names the channel's readers: a generation (16 bits), then the
# sole reader's process index (16 bits) and pid (32 bits), or pid 0 for several readers;
# 0 before any read.  Only readers change it, under the readers' lock.
_READER = 3
_PID = 0xFFFFFFFF
# The ring's user word that names the sole reader's lease table: the reader word's
# generation (16 bits) and the tag of its table's id (48 bits), or 0 while the reader word
# names no sole reader.  Stored just before the reader word, as readers store it.
_MAKER = 4
_TAG_MASK = (1 << 48) - 1
# The ring's user word that counts the fds in the lot (see _park), roughly: parkers add
# theirs, a reader that went through the lot sets what it parked again (0: none).
_PARKED = 5
# A reader word that names nobody, of a new generation: the sole reader let go of the
# queue (writers send with fds; the next reader to take a record is the sole reader)
_VACANT = 0xFFFF << 32
# A parking datagram, sent the other way on the side socket (into the writing end's
# receive queue, which nothing else reads): the ring's tail when it was sent (every
# record it serves is below it), how many files, then their inodes; their fds with it.
_PARK_HEAD = struct.Struct("=QH")
_PARK_FDS = 250  # files per parking datagram (the kernel takes at most 253 fds in one)
_PARK_MAX = _PARK_HEAD.size + 8 * _PARK_FDS
_FD_MARGIN = 16  # fds a pass through the lot leaves free under the fd limit
_LOT_SECONDS = 1.0  # how often a reader looks through the lot while the hint is set
_UNSYNCED = 1 << 62  # see _sent_back_until
_ANNOUNCED_MAX = 1024  # what a writer remembers having announced, per channel
_HOT_MAX = 64  # writers whose last slab a reader keeps held while records wait
_KEEP_FILES = 64  # files a sole reader keeps per channel (see _keep_max for the process)
# bytes of memory whose memfds a sole reader keeps per channel before it starts a new
# generation: what its receive cache may keep mapped while idle (which pins as much)
_KEEP_BYTES = 2 << 30
_SWEEP_SECONDS = 1.0  # how often a reader that drains its queue looks for freed memfds
TURN_MOMENT = 0.1  # the longest a get waits for the sweeper thread's turn (sweep_idle)
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
# this process's pid, kept here: ``os.getpid`` is a syscall, and the paths of every put and
# get ask for it to notice a fork
_me = [os.getpid()]


def _forked_here() -> None:
    _me[0] = os.getpid()
    _pid_tag[0] = _me[0] << 32


os.register_at_fork(after_in_child=_forked_here)


def _new_tag() -> int:
    return _pid_tag[0] | (next(_count) & 0xFFFFFFFF)


class Lost(OSError):
    """A message whose body a reader of another process took and never finished (an
    exception, a signal handler's, cut its receive short): it is gone."""


class Channel:
    """One channel's ends in this process: ``send`` and ``receive`` of (bytes, fds)."""

    __slots__ = ("ring", "turn", "waitable", "_side_r", "_side_w", "_taken", "_last", "_raw",
                 "_made", "_handing", "_pid", "_spent", "_close", "_keep", "_old", "_mine",
                 "_announced", "_announced_at", "_once", "_pending", "_dev", "_hot", "_origin",
                 "_sweep_at", "sweeping", "sweeps", "_closing", "_names", "_lot_at", "__weakref__")

    def __init__(self, ring: Ring, side_r: socket.socket, side_w: socket.socket) -> None:
        self.ring, self._side_r, self._side_w = ring, side_r, side_w
        # As sole reader: the files (memfds of memory, lease files) writers sent once,
        # by inode, for records that come without fds; and those of earlier generations,
        # with the tail after which no record names them.
        self._keep: dict[int, int] = {}
        self._old: list[tuple[int, dict[int, int]]] = []
        # a kept memfd's writer pid (0: not to be looked at), its fd number there, the
        # memory's size and the writer's process index in the ring, by inode
        # (for the sweep that lets go of what its writer freed)
        self._origin: dict[int, tuple[int, int, int, int]] = {}
        self._sweep_at = 0.0
        self._lot_at = 0.0  # when this reader may next look through the lot (_clean_lot)
        # set while a pass of the sweeper thread holds the turn, and those passes counted
        # (sweep_idle): a receive that found the turn taken by a pass waits a moment for
        # it; and what close() and the sweeper's pass take, so that a close never drops
        # what a pass holds in hand
        self.sweeping = False
        self.sweeps = 0
        self._closing = threading.RLock()
        # As writer: the reader word each file was last announced under; and the anchors
        # of records sent without fds, kept until ``head`` passes them (their reader holds
        # the memory by then)
        self._announced: dict[int, int] = {}
        self._once: dict[int, int] = {}  # the same for segments of their own sent once
        self._announced_at: dict[int, int] = {}  # a segment of its own's last announce
        self._pending: collections.deque[tuple[int, object]] = collections.deque()
        self._dev = -1
        self._hot: dict[int, object] = {}  # writer pid -> its last slab's anchor (_attach)
        # whether this process named itself sole reader here: records may then send its
        # memory back to it without fds, which names_own looks for
        self._names = [False]
        # the ring's fds close with the channel (its sockets are its owner's to close);
        # anchors still in flight keep the ring until their records are taken, and so do
        # records that send this process's memory back to it (names_own)
        self._close = weakref.finalize(self, _closed, ring, self._pending, self._keep,
                                       self._old, self._hot, self._names, side_r, side_w)
        self._close.atexit = False  # a daemon feeder may still be sending at exit
        # whether records tick once someone waits on the fd (see wait_fd): set by the
        # owner in every process that has the channel (a SimpleQueue's are; a Queue's not)
        self.waitable = False
        self._reset()
        with _channels_lock:
            _channels.add(self)

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
        self._mine = 0  # the reader word while it names this process as sole reader
        # one thread of this process receives at a time, from receive to take: what a
        # receive took is this process's, and the next receive of any thread hands it over
        self.turn = threading.Lock()

    def turn_args(self, block: bool,
                  timeout: float | None) -> tuple[()] | tuple[bool] | tuple[bool, float]:
        """``turn.acquire``'s arguments for a receive with ``block`` and ``timeout`` (in
        a forked child, the parent's frames let go of first)."""
        if self._pid != _me[0]:
            self._forked()
        if not block:
            return (False,)
        return () if timeout is None else (True, max(0.0, timeout))

    # -- sending -----------------------------------------------------------------------

    def send(self, data: bytes, fds: Sequence[int] = (), block: bool = True,
             timeout: float | None = None, sent: list[int] | None = None) -> None:
        """Send one message; with a full channel, wait for room (``block``, up to
        ``timeout``) or raise ``queue.Full``.  The caller keeps ``fds`` (they are
        duplicated into the message).  ``sent``: as ``Ring.put``'s, a list that gets the
        message's record number in the step that writes it."""
        ring = self.ring
        if self._side_r.fileno() < 0 and self.readers_gone():
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))  # described by the caller
        if not fds and len(data) < ring.payload_max:
            if self.waitable:
                ring.put(_INLINE + data, block, timeout, hook=self._ticker(block, timeout),
                         sent=sent)
            else:
                ring.put(_INLINE + data, block, timeout, sent=sent)
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
            ring.put((_BIG if big else _SIDE) + _TAG.pack(tag), block, timeout, hook=side,
                     sent=sent)
        finally:
            scm_rights.close_fds(body)

    def post(self, data: bytes, ctx: SendContext, block: bool = True,
             timeout: float | None = None, sent: list[int] | None = None) -> None:
        """Send a message pickled with ``ctx``, as :meth:`send` does with its fds.  A
        one-array message of memory this process made (``ctx.handle``: in a memfd, or a
        CUDA IPC allocation, which its handle in the message names) goes without fds to a
        channel's sole reader that was sent them once, as a record of its own (see
        docs/channel-design.md, "fds only when new"): the first message of each memfd
        (and lease file) to that reader *announces* it (its fds go with it, and the reader
        keeps them), and each later one names it.  Its anchor (``ctx.keep``) is
        then kept here until the reader took the record, and so holds the memory
        meanwhile.  The caller releases ``ctx`` after, as after :meth:`send`, and calls
        :meth:`prune` before it pickles.  A one-array message of memory another process
        made (``ctx.forward``) goes without fds where that process is the sole reader
        (:meth:`_send_back`).  ``sent`` as :meth:`send`'s."""
        if ctx.forward is not None and self._send_back(data, ctx, block, timeout, sent):
            return
        handle = ctx.handle
        if handle is None or len(data) > SIDE_MAX:
            self.send(data, ctx.wire_fds(), block, timeout, sent)
            return
        if self._pid != _me[0]:
            self._forked()
        ring, user = self.ring, self.ring.user
        w = user[_READER]
        seg_fd, seg_ino, shard_fd, shard_ino, own = handle
        if own and not self._nameable(seg_ino, w, own):
            self.send(data, ctx.wire_fds(), block, timeout, sent)
            return
        if w & _PID and 1 + _HELD_HEAD.size + len(data) <= ring.payload_max:
            record = b"".join((_HELD, _HELD_HEAD.pack(_me[0], seg_fd, seg_ino, shard_fd,
                                                      shard_ino, w), data))
            try:
                ring.put(record, block, timeout, hook=self._named(
                    w, seg_ino, shard_ino, own, ctx.keep[0], block, timeout), sent=sent)
                return
            except _Unknown:
                w = user[_READER]
        if not w & _PID:  # no sole reader to announce to
            self.send(data, ctx.wire_fds(), block, timeout, sent)
            return
        fds = ctx.wire_fds()
        deadline = None if not block or timeout is None else time.monotonic() + timeout
        tag = _new_tag()
        announced, inos, at = self._announced, (seg_ino, shard_ino), self._announced_at

        def side(number: int) -> None:
            self._send_side(_HEAD.pack(number, tag), data, fds, block, deadline)
            if len(announced) >= _ANNOUNCED_MAX:
                announced.clear()
                at.clear()
            w = user[_READER]
            for ino in inos:
                if ino:  # 0: memory in no file of its own (a CUDA IPC allocation)
                    announced[ino] = w
            if own:
                at[seg_ino] = number
        ring.put(_ANN + _ANN_HEAD.pack(tag, *inos, seg_fd, ring.index, own > 0), block,
                 timeout, hook=side, sent=sent)

    def _send_back(self, data: bytes, ctx: SendContext, block: bool,
                   timeout: float | None, sent: list[int] | None) -> bool:
        """Send a received array back to the process that made its memory, while that
        process is the channel's sole reader (its maker word names the memory's lease
        table), as a record without fds (``_FWD``) that names the memory's slot; False
        (nothing sent) otherwise.  Nothing here holds the memory in flight, so this
        process may exit right after: the maker reuses none of its memory that a record
        not yet taken names (:func:`names_own`), and holds it as it takes the record.
        The record also carries this process's fds of the memory, through which another
        reader (the channel's readers changed meanwhile) holds it, as for a record of an
        earlier generation."""
        if self._pid != _me[0]:
            self._forked()
        ring, user, lane = self.ring, self.ring.user, cast(LaneContext, ctx)
        w = user[_READER]
        maker = _tag(lane.table_id)
        word = (w >> 48) << 48 | maker
        if not w & _PID or user[_MAKER] != word:
            return False
        seg_fd, seg_ino, shard_fd, shard_ino, _ = ctx.forward  # type: ignore[misc]
        record = b"".join((_FWD, _FWD_HEAD.pack(maker, lane.slot),
                           _HELD_HEAD.pack(self._pid, seg_fd, seg_ino, shard_fd, shard_ino, w),
                           data))
        if len(record) > ring.payload_max:
            return False
        tick = self._ticker(block, timeout) if self.waitable else None

        def back(number: int) -> None:  # under the writers' lock: the reader is the same
            if user[_READER] != w or user[_MAKER] != word:
                raise _Unknown
            if tick is not None:
                tick(number)
        try:
            ring.put(record, block, timeout, hook=back, sent=sent)
        except _Unknown:
            return False
        return True

    def _nameable(self, ino: int, w: int, size: int) -> bool:
        """Whether a message of a segment of its own (not a slab) of ``size`` bytes may go
        without fds, or announce it, to the sole reader of word ``w``.  Announced under
        ``w``: once that announce is taken (a reader may refuse to keep a segment, which
        only the word it changes then tells; a record written before that would name
        what it lacks).  Else: announced only once sent to it before (most arrays are
        sent once, and a reader that kept their fds would pin memory their writer gives
        back), and while keeping it leaves the memory room a cgroup needs (as idle memory
        does: under half its limit used)."""
        if self._announced.get(ino) == w:
            return self.ring.head > self._announced_at.get(ino, 1 << 62)
        once = self._once
        if not w & _PID:
            return False
        if once.get(ino) != w:
            if len(once) >= _ANNOUNCED_MAX:
                once.clear()
            once[ino] = w
            return False
        room = shm_space.memory_room()
        return size <= room.free - (room.free * 3 // 4 if room.limit is None
                                    else room.limit // 2)

    def prune(self) -> None:
        """Let go of the anchors of records without fds taken since (and of closed
        channels'): a put calls it before it pickles (so that the memory of a message its
        reader took and let go of is free for the next one), and before it posts what a
        feeder thread holds."""
        if self._pending or _lingering:
            _prune(self._pending, self.ring.head)

    def _named(self, w: int, seg_ino: int, shard_ino: int, own: int, anchor: object,
               block: bool, timeout: float | None) -> Callable[[int], None]:
        """The put hook of a record without fds: under the writers' lock, it raises
        ``_Unknown`` (nothing is written) unless the reader word is still ``w`` and both
        files were announced under it (the reader it names takes those announces first:
        records are taken in order), and, for a segment of its own (``own``), ``head``
        has passed that announce (another thread's may have just been written: see
        :meth:`_nameable`); else the anchor is kept until the record is taken (``post``
        lets go of those of records taken since, first)."""
        ring, announced, pending = self.ring, self._announced, self._pending
        user, at = ring.user, self._announced_at
        tick = self._ticker(block, timeout) if self.waitable else None

        def named(number: int) -> None:
            if (user[_READER] != w
                    or seg_ino and announced.get(seg_ino) != w
                    or announced.get(shard_ino) != w
                    or own and ring.head <= at.get(seg_ino, 1 << 62)):
                raise _Unknown
            if tick is not None:
                tick(number)
            pending.append((number, anchor))
        return named

    def _ticker(self, block: bool, timeout: float | None) -> Callable[[int], None]:
        """The put hook of a record with no datagram on a waitable channel: under the
        writers' lock, it sends the record's tick if someone waits on the fd."""
        deadline = None if not block or timeout is None else time.monotonic() + timeout
        user = self.ring.user

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
        if self._pid != _me[0]:
            self._forked()
        me = threading.get_ident()
        while self._handing and self._handing != me:
            time.sleep(0)  # another thread is handing taken[0] over: it drops it next
        if _lingering:  # a closed channel's anchors, let go of once their records went
            _prune(self._pending, self.ring.head)
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
                        if (self.ring.user[_PARKED]
                                and time.monotonic() >= self._lot_at):
                            self._idle_lot()
                        if self._origin and time.monotonic() >= self._sweep_at:
                            self._sweep()
                        if self._old:  # every record was taken: close what none names
                            self._drop_old(self.ring.head)
                    if not block or deadline is not None:
                        raise
        number, frame = taken[0]
        if frame.dead:
            self._last[0] = number; del taken[0]  # noqa: E702 (one step)
            raise Lost(errno.EPIPE, "a message on this queue was lost: a receive that "
                       "took its body did not finish (its process was killed, or "
                       "interrupted), or the message was malformed; the queue goes on")
        return frame

    def load(self, load: Callable[..., Any]) -> tuple[int, scm_rights.Frame]:
        """``load(data, fds)`` of the frame :meth:`receive` returned (see
        ``scm_rights.FrameReader.load``: the same guarantees): ``(number, frame)``, its
        ``result`` made, still taken (``_taken[0]``) and marked as being handed over by
        this thread (``_handing``).  An exception here, or as it returns, leaves it for
        this process's next receive.

        The hand-over is the caller's, one line in its own frame, with the caller
        holding :attr:`turn` (``held == [True]``)::

            held[0] = False; chan.turn.release(); chan._last[0] = number; del chan._taken[0]; chan._handing = 0; return frame.result[0]

        The turn is let go of (first marked so), then the frame dropped and its result
        returned in one step: no call, and no jump that checks for signals, comes
        between them.  A thread that gets the turn as ``release`` returns waits in
        receive until ``_handing`` is cleared; an exception there leaves the frame and
        ``_handing`` for :meth:`disown` (the caller's ``finally``).  It cannot be a
        function of its own: CPython 3.10 runs a signal handler as any call returns
        (a Python function's too), which would lose what it returned."""
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
        return number, frame

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
        if (self._hot or self._origin) and self.ring.tail - number <= 1:
            # nothing waits after this record
            if self._hot:
                self._hot.clear()  # keep no slab (_attach)
            if self._origin and time.monotonic() >= self._sweep_at:
                self._sweep()
        user = self.ring.user
        if user[_READER] != self._mine or not self._mine:
            self._join()
        if self._old:
            self._drop_old(number)
        if user[_PARKED] and time.monotonic() >= self._lot_at:
            self._clean_lot(number)
        kind = data[:1]
        if kind == _INLINE or kind == _HELD or kind == _FWD:
            if self.waitable and self.ring.user[_WAITED]:
                self._take_tick(number)
            taken.append((number, scm_rights.Frame(data[1:], []) if kind == _INLINE
                          else self._held(number, data, kind == _FWD)))
            return
        if len(data) < 1 + _TAG.size:  # malformed (not a writer's of this channel): lost
            taken.append((number, _lost()))
            return
        tag = _TAG.unpack_from(data, 1)[0]
        frame, spent = self._side_frame(number, kind == _BIG, tag)
        if frame.dead:
            taken.append((number, frame))
            return
        if kind == _ANN:
            frame, spent = self._announce(number, frame, data)
        # the datagram is the frame's from here on (a lingering copy in _raw is known by
        # its tag), its memfd (if any) in _spent
        self._spent = spent; self._made = tag; taken.append((number, frame))  # noqa: E702
        self._raw.clear()
        scm_rights.close_fds(spent)

    # -- records without fds (see post) ---------------------------------------------------

    def _join(self) -> None:
        """Before this process takes a record (under the readers' lock): make the reader
        word name it as the sole reader if no other live process reads, else say there are
        several; a word that no longer names it retires what it kept."""
        user, ring, pid = self.ring.user, self.ring, os.getpid()
        w = user[_READER]
        index = (w >> 32) & 0xFFFF
        if w & _PID == pid and index == ring.index:
            new = w  # named already (by another of this process's channels of the ring)
        elif w == 0 or (w & _PID and not ring.alive(index)) or w & _VACANT == _VACANT:
            new = _word(w, ring.index, pid)
        elif w & _PID:
            new = _word(w, 0, 0)  # another live reader: several
        else:
            new = w  # several already
        if new != w:
            self._name_reader(new)
        if self._mine and new != self._mine:
            self._retire()
        self._mine = new if new & _PID else 0
        if self._mine and not self._names[0]:
            self._names[0] = True
            with _scans_lock:
                if id(self.ring) not in _scans:
                    _scans[id(self.ring)] = _Scanned(self.ring)

    def _name_reader(self, new: int) -> None:
        """Store the reader word ``new`` (under the readers' lock), its maker word first:
        this process's tag where the word names it, a writer that reads both words
        seeing the same generation in each reads one reader's."""
        _name_reader_word(self.ring, new)

    def _retire(self) -> None:
        """What this reader kept becomes old: records up to the tail may name it."""
        if self._keep:
            self._old.append((self.ring.tail, dict(self._keep)))
            self._keep.clear()
            self._origin.clear()

    def _sweep(self) -> None:
        """Let go of kept memfds whose writer closed its fd of them (it destroyed the
        memory, or exited): kept on, they would pin memory nobody uses.  Records before
        the tail may still name them (a writer that exited right after its puts), so
        they close as an earlier generation's do, once ``head`` reaches the tail: their
        writer, which closed its fd before the tail was read, writes no record that
        names them from the tail on (as an earlier generation's writers may, at the
        tail itself)."""
        self._sweep_at = time.monotonic() + _SWEEP_SECONDS
        keep, gone = self._keep, dict[int, int]()
        for ino, (pid, fd_no, _, index) in list(self._origin.items()):
            if (not _is_file(f"/proc/{pid}/fd/{fd_no}", self._dev, ino, True) if pid
                    else 0 <= index < MAX_PROCS and not self.ring.alive(index)):
                del self._origin[ino]
                if ino in keep:  # moved in one step (C): an exception never loses it
                    _consume(map(gone.__setitem__, (ino,), map(keep.pop, (ino,))))
        if gone:
            self._old.append((self.ring.tail - 1, gone))

    def sweep_idle(self) -> bool:
        """The sweeper thread's pass (see :func:`sweep_all`): as a receive that finds the
        ring empty does, let go of kept memfds whose writer closed its fd of them, and of
        earlier generations' files no record from ``head`` on names, unless a thread of
        this process is receiving (it sweeps itself as it drains or waits).  True while
        anything is kept."""
        if self._pid != _me[0]:
            return False  # a forked copy: its files closed as the fork ended (_after_fork)
        if not self.turn.acquire(False):
            return bool(self._keep or self._old)
        # Marked while the turn is held, and counted: a get that found the turn taken
        # (it read the count, then the mark, before it tried) sees either the mark then,
        # or the mark or a new count after (see _queues' get), and waits for the turn
        try:
            self.sweeping = True; self.sweeps += 1  # noqa: E702
            with self._closing:
                if not self._taken and self._close.alive:  # a frame in hand: its receive's
                    if self._origin and time.monotonic() >= self._sweep_at:
                        self._sweep()
                    if self._old:
                        self._drop_old(self.ring.head)
                return bool(self._keep or self._old)
        finally:
            self.sweeping = False
            self.turn.release()

    def _drop_old(self, number: int) -> None:
        """Close kept files of earlier generations that no record from ``number`` on names
        (a writer is at most one record into a write: none past the tail noted when the
        generation ended was written under it)."""
        while self._old and self._old[0][0] < number:
            fds = list(self._old[0][1].values())
            del self._old[0]
            scm_rights.close_fds(fds)

    def _announce(self, number: int, frame: scm_rights.Frame,
                  data: bytes) -> tuple[scm_rights.Frame, list[int]]:
        """An announce's frame (a one-array message with its fds: the memory's memfd, if
        it is in one, then an in-flight description of its lease file) and the fds to
        close once it is taken.  As this channel's sole reader: keep a new fd of the memfd
        (once: a repeat finds it kept), and attach the memory here, as for a record
        without fds, which leaves this process a description of the lease file
        (``ofd_lease``'s holding) through which later records are held; the message's own
        fds are then spent.  Memory in no file (inode 0: a CUDA IPC allocation, which its
        handle in the message names) keeps nothing but that description."""
        fds = frame.fds
        if not self._mine or len(data) < 1 + _ANN_HEAD.size:
            return frame, []  # loaded as any message (the loader says what is malformed)
        keep = self._keep
        tag, seg_ino, _, seg_no, index, own = _ANN_HEAD.unpack_from(data, 1)
        if len(fds) != (2 if seg_ino else 1):
            return frame, []
        if seg_ino and seg_ino not in keep:
            try:
                if (len(keep) >= _KEEP_FILES or _kept_files() >= _keep_max()
                        or own and _fds_short()):
                    raise OSError(errno.EMFILE, "kept enough")
                self._note_origin(seg_ino, tag >> 32, seg_no, index, fds[0])
                _consume(map(keep.__setitem__, (seg_ino,), map(os.dup, (fds[0],))))
            except OSError:  # a new generation (writers announce again), kept from empty
                self._retire()
                self._mine = _word(self.ring.user[_READER],
                                   self.ring.index, os.getpid())
                self._name_reader(self._mine)
                return frame, []
        return self._attach(number, tag >> 32, frame.data, lambda: fds[0],
                            lambda: fds[-1]), fds

    def _note_origin(self, ino: int, pid: int, fd_no: int, index: int, fd: int) -> None:
        """Note where a memfd about to be kept comes from, for :meth:`_sweep`: raises
        ``OSError`` if keeping it would pass :data:`_KEEP_BYTES`.  One whose writer (of
        process index ``index`` in the ring) still has the ring, and an fd this process
        cannot see (another pid namespace, or it closed it already), is swept only once
        that writer has let go of the ring (pid 0); one whose writer no longer has the
        ring (exited, or closed the queue) is swept at the next sweep."""
        size = os.fstat(fd).st_size
        if sum(o[2] for o in self._origin.values()) + size > _KEEP_BYTES:
            raise OSError(errno.ENOSPC, "kept enough bytes")
        if self._dev < 0:
            self._dev = os.fstat(self.ring.fd).st_dev
        seen = (_is_file(f"/proc/{pid}/fd/{fd_no}", self._dev, ino)
                or 0 <= index < MAX_PROCS and not self.ring.alive(index))
        self._origin[ino] = (pid if seen else 0, fd_no, size, index)

    def _held(self, number: int, data: bytes, back: bool) -> scm_rights.Frame:
        """The frame of a record without fds (``back``: one that sends memory back to
        its maker, which has it): its memory attached and held here (before ``head``
        moves past it), from the files this process keeps, or else opened through its
        writer's or its sole reader's fds.  An error (but one a signal handler raised,
        which leaves the record for the next receive) is the frame's, raised as it is
        taken: the message is lost, and the error says why."""
        opened: list[int] = []
        at = 1 + _FWD_HEAD.size if back else 1
        try:
            if len(data) < at + _HELD_HEAD.size:
                return _Held(b"", None, None, None, OSError(errno.EBADMSG,
                                                            "a malformed record"))
            pid, seg_no, seg_ino, shard_no, shard_ino, w = _HELD_HEAD.unpack_from(data, at)
            # (memory sent back is this process's own: not its writer's slab to keep hot)
            return self._attach(number, 0 if back else pid, data[at + _HELD_HEAD.size:],
                                lambda: self._kept(seg_ino, pid, seg_no, w, number, opened),
                                lambda: self._kept(shard_ino, pid, shard_no, w, number,
                                                   opened))
        finally:
            if opened:
                scm_rights.close_fds(opened)

    def _attach(self, number: int, writer: int, payload: Payload, seg_fd: Callable[[], int],
                lease: Callable[[], int]) -> _Held:
        """A frame of a one-array message whose memory is attached and held here now (see
        ``_reductions.held_attach``), or of the error that lost it: the message can never
        be attached here (no fd or lock to be had, a malformed record).  Any other
        exception (a signal handler's) goes on, and the record stays for the next
        receive."""
        try:
            anchor, view, load = _reductions.held_attach(payload, seg_fd, lease)
        except _FAILURES as e:
            if _raised_by_a_signal_handler(e):
                raise
            return _Held(b"", None, None, None, OSError(
                getattr(e, "errno", None) or errno.EBADMSG,
                f"a shared array on this queue was lost: {e}"))
        # While more records wait, each writer's last slab stays held here: its next
        # record's attach then finds the anchor alive (no hold, no release, no anchor
        # made).  Let go of when that writer sends another slab, or the ring empties.
        hot = self._hot
        if self.ring.tail - number > 1:
            if writer and len(hot) < _HOT_MAX:
                hot[writer] = anchor
        elif hot:
            hot.clear()
        return _Held(payload, anchor, view, load, None)

    def _kept(self, ino: int, pid: int, fd_no: int, w: int, number: int,
              opened: list[int]) -> int:
        """This process's fd of the file of inode ``ino``, for record ``number``: kept,
        else opened (into ``opened``) through its writer ``pid``'s fd ``fd_no``, else
        through an fd of the sole reader that reader word ``w`` names (which keeps the
        memory's memfd, and a description of the lease file while it holds anything of
        it), else one that a process parked as it let go of the queue (see _park)."""
        fd = self._keep.get(ino, -1)
        if fd >= 0:
            return fd
        for _, old in self._old:
            if ino in old:
                return old[ino]
        if self._dev < 0:
            self._dev = os.fstat(self.ring.fd).st_dev
        if _open_file(f"/proc/{pid}/fd/{fd_no}", self._dev, ino, opened):
            return opened[-1]
        reader = w & _PID
        if reader:
            try:
                names = os.listdir(f"/proc/{reader}/fd")
            except OSError:
                names = []
            for name in names:
                if _open_file(f"/proc/{reader}/fd/{name}", self._dev, ino, opened):
                    return opened[-1]
        if self._through_lot(number, ino, opened):
            return opened[-1]
        raise OSError(errno.ENOENT, f"it came without fds, and neither its writer (process "
                      f"{pid}) nor the reader it was sent to (process {reader}) has its "
                      "memory open any more (each exited or closed the queue, or they run "
                      "in another pid namespace)")

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
        raw, sock, began = self._raw, self._side_r, self.ring.user
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

    def park(self) -> None:
        """Park the files that records without fds not yet taken name, that this
        process has (see :func:`_park`): as it lets go of the queue."""
        if self._pid == os.getpid():
            _park(self.ring, self._side_r, self._keep, self._old)

    def _clean_lot(self, number: int) -> None:
        """Under the readers' lock, taking record ``number`` (or with the ring empty,
        ``head``): close the parked files no record from it on may name, park the others
        again."""
        self._lot_at = time.monotonic() + _LOT_SECONDS
        self._through_lot(number, 0, [])

    def _idle_lot(self) -> None:
        """With the ring found empty: go through the lot under the readers' lock, taken
        without waiting (another reader waits, or takes a record, and does it then), so
        that parked files whose records were all taken pin nothing while the queue
        idles."""
        ring = self.ring
        try:
            ring.sync_readers(0.0, lambda: self._clean_lot(ring.head))
        except (TimeoutError, OSError, ValueError):
            self._lot_at = time.monotonic() + _LOT_SECONDS

    def _through_lot(self, number: int, ino: int, opened: list[int]) -> int:
        """Under the readers' lock (so that no other reader misses a datagram this one
        has in hand), taking record ``number``: take the parking datagrams (as many as
        this process has fds free for: a datagram whose fds it could not take would lose
        them), park again the files a record from ``number`` on may need, merged into as
        few datagrams as they fit under the latest tail of those it merges (each fd in
        flight counts against its sender's user's fd limit), and close the others.
        Where one is the file of inode ``ino``, a new fd of it goes into ``opened``.
        Returns the datagrams parked again, or for ``ino``, whether the file was found."""
        sock, user = self._side_w, self.ring.user
        found, top, files = 0, 0, dict[int, int]()  # files: inode -> fd (in ``taken``)
        taken: list[Any] = []  # recvmsg results, each stored by the call's own step
        seen = user[_PARKED]
        room = _fds_free() - _FD_MARGIN
        try:
            while sock.fileno() >= 0:  # all taken first: one parked again comes back
                try:
                    head = sock.recv(_PARK_HEAD.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                    n = _PARK_HEAD.unpack(head)[1] if len(head) == _PARK_HEAD.size else 1
                    if n > room:
                        break  # left for a pass with fds to spare
                    room -= n
                    taken.extend(starmap(sock.recvmsg, ((_PARK_MAX, _ANC, _TAKE),)))
                except OSError:  # empty (BlockingIOError), or closed
                    break
            for msg in taken:
                data, fds = msg[0], scm_rights._collect((msg,))[0]
                if len(data) < _PARK_HEAD.size:
                    continue
                tail, n = _PARK_HEAD.unpack_from(data)
                if tail <= number or len(data) != _PARK_HEAD.size + 8 * n or len(fds) != n:
                    continue  # stale: every record it served was taken (or junk)
                top = max(top, tail)
                for i, fd in zip(struct.unpack_from(f"={n}Q", data, _PARK_HEAD.size), fds):
                    files.setdefault(i, fd)
            again = _send_files(self._side_r, top, files)
            # the hint: what this pass parked again, and what others parked meanwhile
            user[_PARKED] = max(0, user[_PARKED] - seen) + (len(files) if again else 0)
            fd = files.get(ino, -1) if ino else -1
            if self._dev < 0:
                self._dev = os.fstat(self.ring.fd).st_dev
            if fd >= 0 and _same_file(fd, self._dev, ino):
                _consume(map(opened.append, map(os.dup, (fd,))))
                found = 1
        finally:
            scm_rights.close_fds(scm_rights._collect(taken)[0])
        return found if ino else again

    def readers_gone(self) -> bool:
        """Whether no process reads this channel any more: every reading end (this
        process's included) closed, as a pipe with no reader.  A syscall: ``send`` asks
        only once this process has closed its own reading end."""
        try:
            return _hung_up(self._side_w)
        except (OSError, ValueError):  # the writing end closed too: the send says so
            return False

    def empty(self) -> bool:
        return not self._taken and self.ring.empty()

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether a message waits for this process, after waiting up to ``timeout``
        seconds (None: until one comes) for one, without taking it."""
        if self._pid != _me[0]:
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
        user = ring.user
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
        _let_go(self._keep, self._old)
        self._origin.clear()
        self._hot.clear()
        self._announced.clear()
        self._once.clear()
        self._announced_at.clear()
        self._pending.clear()  # this process's copies of the parent's anchors
        self._names[0] = False
        self.sweeping = False
        self._closing = threading.RLock()
        self._reset()

    def close(self) -> None:
        """Close this process's ends: its threads waiting in the ring raise ``RingClosed``
        (the ring is shut at once, even where it lingers for records not yet taken)."""
        self.ring.shut()
        with self._closing:
            self._close()

    def shut_if_alone(self) -> None:
        """As a queue's last writer in this process goes (its feeder ended after close)
        with no other process on the ring, nothing can come any more: threads of this
        process waiting for a message raise ``RingClosed`` once the ring is empty, as
        a pipe's reader meets its end once every writer closed it."""
        try:
            alone = not self.ring.peers_alive()
        except OSError:  # closed here already: nothing waits in it
            return
        if alone:
            self.ring.shut()


# What attaching a message's memory raises when it never can be: the message is lost
_FAILURES = (OSError, ValueError, TypeError, LookupError, AttributeError, EOFError,
             MemoryError, OverflowError, pickle.UnpicklingError, struct.error,
             RuntimeError,  # a CUDA error: a handle its exporter's death made invalid
             ImportError)  # an adapter whose library no longer imports (CuPy)


class _Unknown(Exception):
    """A record without fds would name a file its reader was not sent: announce it."""


class _Held(scm_rights.Frame):
    """The frame of a record without fds: its memory attached (``anchor``, which holds
    it), loaded by the adapter that attached it (``load(anchor, view)``), or the error
    that lost it."""

    __slots__ = ("anchor", "view", "load", "error")

    def __init__(self, data: Payload, anchor: object, view: object,
                 load: Callable[[Any, Any], Any] | None, error: BaseException | None) -> None:
        super().__init__(data, [])
        self.anchor, self.view, self.load, self.error = anchor, view, load, error

    def hand_to(self, load: Callable[..., _T], extra: tuple[object, ...]) -> _T:
        # a view of memory held already: an exception (a signal handler's) leaves the
        # frame whole for the next receive, unlike a load that consumes its fds
        if self.error is not None:
            self.started = True
            raise self.error
        try:
            return self.load(self.anchor, self.view)  # type: ignore[misc,no-any-return]
        except _FAILURES as e:  # a view its memory cannot have (a malformed record): lost
            if _raised_by_a_signal_handler(e):
                raise
            self.started = True
            raise OSError(errno.EBADMSG, f"a shared array on this queue was lost: the "
                          f"record that named it was malformed ({e})") from e


def _keep_max() -> int:
    """Files this process keeps as a sole reader, over all its channels and their
    generations still open, before a channel starts a new generation: the kept budget
    (the fd limit's share for kept fds of a kind), at least 4."""
    return max(4, ofd_lease.kept_budget())


def _fds_short() -> bool:
    """Whether this process has half its fd limit open: it then keeps no memfd of a
    segment of its own (one array's, where a slab's serves many), whose lease slots
    would each cost it a description of their lease file too; such messages come with
    their fds instead."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return False
    try:
        return len(os.listdir("/proc/self/fd")) > soft // 2
    except OSError:
        return True


def _kept_files() -> int:
    """The files this process keeps as a sole reader, generations still open included."""
    with _channels_lock:
        channels = list(_channels)
    return sum(len(c._keep) + sum(len(old) for _, old in c._old) for c in channels)


def _word(w: int, index: int, pid: int) -> int:
    """A reader word of the generation after ``w``'s, naming ``pid`` (0: several)."""
    return ((w >> 48) + 1 & 0xFFFF or 1) << 48 | index << 32 | pid


@functools.lru_cache(maxsize=256)
def _tag(table_id: str) -> int:
    """48 bits that stand for a lease table's id in the ring (the maker word, _FWD)."""
    return int.from_bytes(hashlib.blake2b(table_id.encode(), digest_size=6).digest(), "little")


class _Scanned:
    """What :func:`names_own` saw of one ring: every record below ``upto``, and of those
    not yet taken, the ones that send memory back to a maker (number -> (tag, slot))."""

    __slots__ = ("ring", "upto", "found")

    def __init__(self, ring: Ring) -> None:
        self.ring, self.upto = ring, 0
        self.found: dict[int, tuple[int, int]] = {}

    def update(self) -> None:
        """Look at the records written since, and forget those taken."""
        ring, found = self.ring, self.found
        tail = ring.tail
        if tail == self.upto and not found:
            return
        head = ring.head
        for number in [n for n in found if n < head]:
            del found[number]
        for number in range(max(head, self.upto), tail):
            rec = ring.peek(number, 1 + _FWD_HEAD.size)
            if rec is not None and rec[:1] == _FWD and len(rec) == 1 + _FWD_HEAD.size:
                found[number] = _FWD_HEAD.unpack_from(rec, 1)
        self.upto = max(self.upto, tail)


# the rings where this process named itself sole reader, by id (the entry keeps the ring),
# until names_own finds one closed (a closing channel's lingers while records may send
# this process's memory back: see _sent_back_until)
_scans: dict[int, _Scanned] = {}
_scans_lock = threading.Lock()


def names_own(table_id: str, slot: int) -> bool | None:
    """Whether a record not yet taken sends ``slot`` of this process's lease table
    ``table_id`` back to it (``_FWD``): nothing else holds that memory in flight, so it
    is neither reused nor destroyed meanwhile (``_segments.namers``).  It looks at the
    rings where this process named itself sole reader (each record once: see
    ``_Scanned``).  None where there is no such ring."""
    if not _scans:
        return None
    want = (_tag(table_id), slot)
    named = False
    with _scans_lock:
        for key, scan in list(_scans.items()):
            try:
                scan.update()
            except ValueError:  # closed: its records were taken, or nobody else has it
                del _scans[key]
                continue
            named = named or want in scan.found.values()
    return named


def _is_file(path: str, dev: int, ino: int, denied: bool = False) -> bool:
    """Whether ``path`` (a /proc fd link) is the file (``dev``, ``ino``); ``denied`` where
    this process may not look (its process made itself undumpable), which says neither."""
    try:
        st = os.stat(path)
    except PermissionError:
        return denied
    except OSError:
        return False
    return st.st_ino == ino and st.st_dev == dev


def _open_file(path: str, dev: int, ino: int, into: list[int]) -> bool:
    """Open ``path`` (a /proc fd link) into ``into`` if it is the file (``dev``, ``ino``)."""
    try:
        into.extend(map(os.open, (path,), (os.O_RDWR | os.O_CLOEXEC,)))
    except OSError:
        return False
    st = os.fstat(into[-1])
    if st.st_ino == ino and st.st_dev == dev:
        return True
    scm_rights.close_fds(into[-1:])
    del into[-1]
    return False


_consume = collections.deque[object](maxlen=0).extend  # runs an iterator out, in C

# Closed channels' anchors of records not yet taken, with their rings: let go of as the
# records are taken (at later posts), or once no other process has the ring.
_lingering: list[tuple[Ring, collections.deque[tuple[int, object]]]] = []
_prune_lock = threading.Lock()
# this process's channels (for what counts or prunes them all: a thread may make one as
# another goes through them)
_channels: weakref.WeakSet[Channel] = weakref.WeakSet()
_channels_lock = threading.Lock()


def _after_fork() -> None:
    """In a forked child: every channel closes the memfds it kept for the parent (kept
    on, they would pin the parent's memory for the child's life; no sweeper pass touches
    a copy, see sweep_idle).  Only files: an anchor let go of here would release its hold
    through the description the child shares with the parent, before ``ofd_lease`` gives
    the child descriptions of its own, and so drop the parent's lock.  The rest goes at
    the copy's first use (:meth:`Channel._forked`)."""
    global _channels_lock, _scans_lock
    _channels_lock = threading.Lock()  # another thread may have held it across the fork
    _scans_lock = threading.Lock()
    _scans.clear()  # the parent's
    for channel in list(_channels):
        if channel._pid != os.getpid():
            _let_go(channel._keep, channel._old)
            channel._origin.clear()
            channel._names[0] = False


os.register_at_fork(after_in_child=_after_fork)


def prune_all() -> None:
    """Let go of every channel's anchors of records taken (``_segments.releasers``):
    before a segment is made, so that one whose message its reader took since the last
    put is reused instead; and before idle memory is given back."""
    with _channels_lock:
        channels = list(_channels)
    for channel in channels:
        channel.prune()


def sweep_all() -> bool:
    """:meth:`Channel.sweep_idle` of every channel (``_segments.sweepers``): a reader that
    stops calling ``get`` lets go, within a pass of the sweeper thread, of what it kept for
    memory its writers freed, instead of pinning it until its next receive.  True while
    any channel keeps files."""
    with _channels_lock:
        channels = list(_channels)
    busy = False
    for channel in channels:
        if channel._keep or channel._old:
            busy = channel.sweep_idle() or busy
    if _lingering:  # closed channels' rings, let go of once taken even with no queue left
        _prune(collections.deque(), 0)
    return busy or bool(_lingering)


def _closed(ring: Ring, pending: collections.deque[tuple[int, object]], keep: dict[int, int],
            old: list[tuple[int, dict[int, int]]], hot: dict[int, object],
            names: list[bool], side_r: socket.socket, side_w: socket.socket) -> None:
    """A channel's end in this process: the files of records not yet taken parked (see
    _park), what it kept closed; anchors of records not yet taken wait in ``_lingering``
    with the ring (see _prune), and so does a ring whose records not yet taken may send
    this process's memory back to it (names_own)."""
    hot.clear()
    _park(ring, side_r, keep, old)
    _let_go(keep, old)
    if names[0]:
        try:
            last = _sent_back_until(ring)
            if last >= 0:  # the ring lingers until head passes it
                pending.append((last, _Readers(side_w)))
        except (OSError, ValueError):  # closed already
            pass
    if pending:
        try:
            head = ring.head
            while pending and pending[0][0] < head:
                pending.popleft()
            if pending and (ring.peers_alive() or _reader_may_come(pending)):
                _lingering.append((ring, pending))
                return
        except (OSError, ValueError):  # closed already
            pass
        pending.clear()
    ring.close()


def _park(ring: Ring, side_r: socket.socket, keep: dict[int, int],
          old: list[tuple[int, dict[int, int]]]) -> None:
    """As this process lets go of a queue (closes it, or exits) with records without fds
    not yet taken: the files they name that it has (as their writer, its memfds and
    lease files; as the reader they were sent to, the memfds it kept and its
    descriptions of the lease files) go into the side socket the other way round, where
    the kernel keeps them while any process has the queue.  A reader that later lacks
    one (its writer and the reader it was sent to both gone) finds it there
    (``Channel._through_lot``).  Lease files go as new descriptions, which hold nothing.
    Never blocks, never raises: a full socket parks nothing (such records are then lost
    once both processes are gone, as before)."""
    opened: list[int] = []
    try:
        me, user = os.getpid(), ring.user
        w = user[_READER]
        ahead = 0  # records a write in progress may still add under the old word
        if w & _PID == me and (w >> 32) & 0xFFFF == ring.index:
            # the sole reader lets go (even with its reading end closed already): writers
            # send with fds from now on (else a writer that goes on sending to it, then
            # is killed, would lose those records), and the writes begun under the old
            # word are whole first, or counted in the tail
            _name_reader_word(ring, _word(w, 0, 0) | _VACANT)
            try:
                ring.sync_writers(0)
            except TimeoutError:
                ahead = 1
        if side_r.fileno() < 0:
            return
        head, tail = ring.head, ring.tail + ahead
        files = dict[int, tuple[int, bool]]()  # inode -> (fd, lease file)
        olds = [k for _, k in old]
        if ahead:  # the write in progress names files this reader was sent: all of them
            for k in (keep, *olds):
                for ino, fd in k.items():
                    files.setdefault(ino, (fd, False))
            for ino, fd in ofd_lease.held_files():
                files.setdefault(ino, (fd, True))
        for number in range(head, tail - ahead):
            rec = ring.peek(number, 1 + _FWD_HEAD.size + _HELD_HEAD.size)
            kind = rec[:1] if rec else b""
            at = 1 + _FWD_HEAD.size if kind == _FWD else 1 if kind == _HELD else 0
            if not at or len(rec) < at + _HELD_HEAD.size:  # type: ignore[arg-type]
                continue
            pid, seg_no, seg_ino, shard_no, shard_ino, _ = _HELD_HEAD.unpack_from(
                rec, at)  # type: ignore[arg-type]
            if pid != me:  # sent to this process: what it kept
                seg_no = next((k[seg_ino] for k in (keep, *olds) if seg_ino in k), -1)
                shard_no = ofd_lease.file_of(shard_ino)
            files.setdefault(seg_ino, (seg_no, False))
            files.setdefault(shard_ino, (shard_no, True))
        sent: dict[int, int] = {}
        for ino, (fd, lease) in files.items():
            try:
                if not ino or fd < 0 or os.fstat(fd).st_ino != ino:
                    continue  # (a record read as it was taken, and written again)
                if lease:
                    _consume(map(opened.append, map(os.open, (f"/proc/self/fd/{fd}",),
                                                    (os.O_RDWR | os.O_CLOEXEC,))))
                    fd = opened[-1]
            except OSError:
                continue
            sent[ino] = fd
        if sent and user[_PARKED] + len(sent) <= _lot_max():
            if _send_files(side_r, tail, sent):
                user[_PARKED] += len(sent)
    except (OSError, ValueError):  # the ring or the socket closed already
        pass
    finally:
        scm_rights.close_fds(opened)


def _lot_max() -> int:
    """The fds the lot of a queue holds at most: each fd in flight counts against its
    sender's user's fd limit, which every fd-passing send of that user then shares (past
    it, sends fail with ``ETOOMANYREFS``)."""
    return max(8, ofd_lease.kept_budget() // 2)


def _fds_free() -> int:
    """How many more fds this process may open (its soft limit, less those open)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    try:
        return soft - len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def _same_file(fd: int, dev: int, ino: int) -> bool:
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return st.st_ino == ino and st.st_dev == dev


def _name_reader_word(ring: Ring, new: int) -> None:
    """Store the reader word ``new`` and its maker word (see ``Channel._name_reader``)."""
    user = ring.user
    user[_MAKER] = (new >> 48) << 48 | _tag(process_tag()) if new & _PID else 0
    user[_READER] = new


def _send_files(side_r: socket.socket, tail: int, files: dict[int, int]) -> int:
    """Park ``files`` (inode -> fd) for the records below ``tail``: the datagrams sent."""
    inos, sent = list(files), 0
    for i in range(0, len(inos), _PARK_FDS):
        part = inos[i:i + _PARK_FDS]
        sent += _to_lot(side_r, _PARK_HEAD.pack(tail, len(part))
                        + struct.pack(f"={len(part)}Q", *part), [files[k] for k in part])
    return sent


def _to_lot(side_r: socket.socket, data: bytes, fds: list[int]) -> int:
    """Send one parking datagram (its fds duplicated in flight): 1, or 0 where the
    socket had no room (or the sender's user has too many fds in flight)."""
    try:
        side_r.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                 array.array("i", fds))], socket.MSG_DONTWAIT)
    except OSError:
        return 0
    return 1


def _park_all() -> None:
    """At exit (a ``multiprocessing`` finalizer, after the queues' feeders were joined):
    every channel of this process parks what its records not yet taken need."""
    with _channels_lock:
        channels = list(_channels)
    for channel in channels:
        channel.park()


def _park_at_exit(_: object = None) -> None:
    Finalize(None, _park_all, exitpriority=-10)


# Registered in every process: multiprocessing's children drop the finalizers they
# inherited or made before they start (a spawned one unpickles its queues first), then
# run the after-fork hooks.
_park_at_exit()
register_after_fork(_park_all, _park_at_exit)
os.register_at_fork(after_in_child=_park_at_exit)  # a plain fork's child has its own pid


class _Readers:
    """Whether a closed channel's queue may still be read somewhere: an fd of its side
    socket's writing end (-1 where it was closed already), which polls hung up once no
    process has a reading end, not even one on its way to a child that has not yet
    attached the queue."""

    __slots__ = ("fd",)

    def __init__(self, side_w: socket.socket) -> None:
        self.fd = -1
        if side_w.fileno() >= 0:
            try:
                self.fd = os.dup(side_w.fileno())
            except OSError:  # out of fds: only processes that have the ring count
                pass

    def may_come(self) -> bool:
        return self.fd >= 0 and not _hung_up(self.fd)

    def __del__(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)


def _hung_up(side_w: socket.socket | int) -> bool:
    """Whether a side socket's writing end polls hung up: no process has a reading end."""
    poller = select.poll()
    poller.register(side_w, select.POLLOUT)
    return any(ev & (select.POLLHUP | select.POLLERR) for _, ev in poller.poll(0))


def _reader_may_come(kept: collections.deque[tuple[int, object]]) -> bool:
    """Whether a closed channel's lingering entry waits for records that send this
    process's memory back (its last: see _sent_back_until) that a reader may yet take
    although no other process has the ring now (a child started with the queue attaches
    it only as it starts): reuse under them would corrupt."""
    readers = kept[-1][1] if kept else None
    return type(readers) is _Readers and readers.may_come()


def _sent_back_until(ring: Ring) -> int:
    """As a channel that named this process sole reader closes: the number of the last
    record not yet taken that sends this process's memory back to it (names_own keeps
    looking at the ring until ``head`` passes it), or -1.  The maker word stops naming
    this process first, and every write begun before is then made whole (the writers'
    lock, taken without waiting: ``_UNSYNCED`` while a writer holds it, for a later
    ``_prune`` to ask again)."""
    user = ring.user
    mine = _tag(process_tag())
    if user[_MAKER] & _TAG_MASK == mine:
        user[_MAKER] = 0
    try:
        ring.sync_writers(0)
    except TimeoutError:
        return _UNSYNCED
    scan = _Scanned(ring)
    scan.update()
    return max((n for n, (tag, _) in scan.found.items() if tag == mine), default=-1)


def _let_go(keep: dict[int, int], old: list[tuple[int, dict[int, int]]]) -> None:
    fds = [*keep.values(), *(fd for _, k in old for fd in k.values())]
    keep.clear()
    old.clear()
    scm_rights.close_fds(fds)


def _prune(pending: collections.deque[tuple[int, object]], head: int) -> None:
    """Let go of the anchors of records taken (numbered below ``head``), and of lingering
    ones (of closed channels) likewise, or whose ring nobody else has.  One thread at a
    time (another finds it busy and leaves it for later), so no anchor is let go of for a
    record not yet taken."""
    if not _prune_lock.acquire(False):
        return
    try:
        while pending and pending[0][0] < head:
            pending.popleft()
        for entry in _lingering[:]:
            ring, kept = entry
            if kept and kept[-1][0] == _UNSYNCED:
                kept[-1] = (_sent_back_until(ring), kept[-1][1])
            head = ring.head
            while kept and kept[0][0] < head:
                kept.popleft()
            if not kept or not (ring.peers_alive() or _reader_may_come(kept)):
                kept.clear()
                _lingering.remove(entry)
                ring.close()
    finally:
        _prune_lock.release()


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


def _raised_by_a_signal_handler(e: BaseException) -> bool:
    """Whether ``e`` came through a Python signal handler installed now (one that raised
    while ``put`` pickled): not a pickling error, whatever it is.  A handler is known by
    the code its call runs: a function's, a method's, the function of a
    ``functools.partial`` (nested ones too), or a callable object's ``__call__``."""
    codes = []
    for signum in signal.valid_signals():
        handler = signal.getsignal(signum)
        while isinstance(handler, functools.partial):
            handler = handler.func
        code = getattr(getattr(handler, "__func__", handler), "__code__", None)
        if code is None and callable(handler):
            call = getattr(type(handler), "__call__", None)
            code = getattr(getattr(call, "__func__", call), "__code__", None)
        if code is not None:
            codes.append(code)
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            return True
        tb = tb.tb_next
    return False
