"""Frames of bytes with file descriptors attached, over a Unix stream socket.

Facts this module is built on (Linux):

* ``sendmsg`` with an ``SCM_RIGHTS`` control message hands the receiver new fds for the
  same open files.  While the message sits in the socket, the kernel holds the files: the
  sender may close its fds, or exit, and the receiver still gets them.
* The fds ride on the first byte of the ``sendmsg`` they came with, and a ``recvmsg`` never
  reads past a byte that carries fds, so a header sent in one call with the fds always
  arrives with them.
* One message carries at most 253 fds (``SCM_MAX_FD``); more go in one-byte follow-up frames.

Frames extend the stdlib Connection's framing, so a frame without fds is exactly what
``multiprocessing.connection`` sends (``!i`` length, or ``-1`` then ``!Q`` length) and the
stdlib's handshakes work on these sockets.  A frame with fds starts with a negative ``!i``:
below ``-2`` it packs the payload length (under 8 MiB) and the fd count in those four bytes,
so a receiver reads the header and then the payload (two reads); otherwise it is ``-2``,
then ``!QI`` (payload length, fd count).  The fds ride on the header.  Writers that share a
socket must hold a lock around :func:`send_frame`, as the stdlib's queues already do.
"""

from __future__ import annotations

import array
import math
import os
import resource
import select
import socket
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from itertools import starmap
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from typing import TypeAlias

    from _typeshed import ReadableBuffer

    # what one ``recvmsg`` returns: (data, [(level, type, payload)], flags, address)
    _Msg: TypeAlias = tuple[bytes, list[tuple[int, int, bytes]], int, Any]

_T = TypeVar("_T")

__all__ = ["HAVE_SCM_RIGHTS", "MAX_FDS", "ATOMIC_MAX", "at_once", "send_frame", "try_send_frame",
           "recv_frame", "FrameReader", "Frame", "FrameTooLong", "SpinWait", "close_fds"]

HAVE_SCM_RIGHTS = hasattr(socket, "SCM_RIGHTS") and hasattr(socket.socket, "sendmsg")
MAX_FDS = 253
_SMALL = struct.Struct("!i")
_LARGE = struct.Struct("!iQ")
_WITH_FDS = struct.Struct("!iQI")
_Q = struct.Struct("!Q")
_QI = struct.Struct("!QI")
_ANC_SIZE = socket.CMSG_SPACE(MAX_FDS * 4) if HAVE_SCM_RIGHTS else 0
_INLINE = 1 << 16
# fd count -> struct unpack of that many C ints
_UNPACK_FDS: dict[int, Callable[[bytes], tuple[int, ...]]] = {}
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_DONTWAIT = int(socket.MSG_DONTWAIT)
_SOL_SOCKET, _SCM_RIGHTS = int(socket.SOL_SOCKET), int(getattr(socket, "SCM_RIGHTS", 1))
# Received fds are close-on-exec, as Python makes its own: a kept one (a lease) must not
# live on in a program this process starts.
_RECV_FLAGS = int(getattr(socket, "MSG_CMSG_CLOEXEC", 0))
# A Unix stream socket queues a write in pieces of at most ~36 KB (one page of head plus
# 32 KB of fragments); a frame no larger is taken whole or not at all by a non-blocking send.
ATOMIC_MAX = 32 << 10  # a plain int: enum '&' costs microseconds


def _anc(fds: Sequence[int]) -> list[tuple[int, int, array.array[int]]]:
    return [(_SOL_SOCKET, _SCM_RIGHTS, array.array("i", fds))] if fds else []


_COMPACT_MAX = (1 << 23) - 1  # payload bytes a compact fd header can say


def _header(n: int, fds: Sequence[int]) -> bytes:
    if fds:
        if n <= _COMPACT_MAX and len(fds) <= MAX_FDS:
            return _SMALL.pack(-3 - (n << 8 | len(fds)))
        return _WITH_FDS.pack(-2, n, len(fds))
    if n < 0x7FFFFFFF:
        return _SMALL.pack(n)
    return _LARGE.pack(-1, n)


def _finish(sock: socket.socket, header: bytes, data: bytes | memoryview, sent: int) -> None:
    if sent < len(header) + len(data):
        sock.sendall(memoryview(header + bytes(data))[sent:])


def at_once(n: int, fds: int) -> bool:
    """Whether a frame of ``n`` bytes with ``fds`` fds is one :func:`try_send_frame` can
    send (whole, or not at all)."""
    return fds <= MAX_FDS and n + _WITH_FDS.size <= ATOMIC_MAX


def try_send_frame(sock: socket.socket, data: ReadableBuffer, fds: Sequence[int] = ()) -> bool:
    """Send a frame that :func:`at_once` admits now if the socket has room (False, nothing
    sent, if it has not, or if the frame is larger): lets a queue skip its feeder thread
    while the reader keeps up."""
    if type(data) is not bytes:
        data = memoryview(data).cast("B")
    n = len(data)
    if len(fds) > MAX_FDS or n + _WITH_FDS.size > ATOMIC_MAX:
        return False
    header = _header(n, fds)
    try:
        sent = sock.sendmsg([header, data], _anc(fds), _DONTWAIT)
    except BlockingIOError:
        return False
    if sent != n + 4:
        _finish(sock, header, data, sent)  # not expected: a frame this small goes whole
    return True


def send_frame(sock: socket.socket, data: ReadableBuffer, fds: Sequence[int] = ()) -> None:
    """Send ``data`` (bytes-like) and ``fds`` as one frame."""
    data = memoryview(data).cast("B")
    n = len(data)
    header = _header(n, fds)
    if len(fds) <= MAX_FDS and n <= _INLINE:
        _finish(sock, header, data, sock.sendmsg([header, data], _anc(fds)))
        return
    _sendall_msg(sock, header, fds[:MAX_FDS])
    for i in range(MAX_FDS, len(fds), MAX_FDS):
        _sendall_msg(sock, b"\0", fds[i:i + MAX_FDS])
    if n:
        sock.sendall(data)


def _sendall_msg(sock: socket.socket, buf: bytes, fds: Sequence[int]) -> None:
    sent = sock.sendmsg([buf], _anc(fds))
    if sent < len(buf):
        sock.sendall(buf[sent:])


def _unpack_fds(payload: bytes) -> tuple[int, ...]:
    """The fds of one SCM_RIGHTS control message (whole C ints only)."""
    n = len(payload) // 4
    unpack = _UNPACK_FDS.get(n)
    if unpack is None:
        unpack = _UNPACK_FDS[n] = struct.Struct(f"{n}i").unpack
    return unpack(payload[:4 * n])


def _collect(parts: Iterable[_Msg]) -> tuple[list[int], bool]:
    """The fds that came with ``parts`` (``recvmsg`` results), and whether some were
    dropped (MSG_CTRUNC)."""
    fds: list[int] = []
    dropped = False
    for _, ancdata, flags, _ in parts:
        for level, kind, payload in ancdata:
            if level == _SOL_SOCKET and kind == _SCM_RIGHTS:
                fds.extend(_unpack_fds(payload))
        dropped = dropped or bool(flags & _MSG_CTRUNC)
    return fds, dropped


# How a read is recorded: ``out.extend(starmap(sock.recvmsg, (args,)))`` appends what the
# call returned with no point in between where a signal handler can run (starmap and
# extend are C), so a handler that raises finds every byte and fd read so far in the
# reader's state.  A handler that runs inside the call (a read interrupted before it got
# anything) raises with nothing read.
_FIRST = ((4, _ANC_SIZE, _RECV_FLAGS),)
_FIRST_NOW = ((4, _ANC_SIZE, _RECV_FLAGS | _DONTWAIT),)


class SpinWait:
    """How one reader waits for a frame: it polls the socket for up to ``budget`` seconds
    before it sleeps in ``recvmsg``, while its last wait was no longer than that (``hot``),
    giving the CPU to any other runnable thread between polls.

    A reader that waited longer sleeps at once next time (and learns again from how long
    that took), so a reader kept idle burns no CPU, and one that keeps up with a busy
    writer spares the writer the wake-up.  Polls are non-blocking ``recvmsg`` calls: the
    GIL is let go between them.  Adaptive state only, not a lock: a reader's waits are
    serialised by the caller (a queue's read lock), and a race costs at most one poll."""

    __slots__ = ("budget", "hot")

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.hot = True

    def read_into(self, sock: socket.socket, out: list[_Msg]) -> None:
        """The first read of a frame, appended to ``out`` (see ``_FIRST``)."""
        clock, yield_cpu = time.perf_counter, os.sched_yield
        if self.hot:
            try:
                return out.extend(starmap(sock.recvmsg, _FIRST_NOW))
            except BlockingIOError:
                pass
            deadline = clock() + self.budget
            while clock() < deadline:
                yield_cpu()  # to a writer that shares this CPU
                try:
                    return out.extend(starmap(sock.recvmsg, _FIRST_NOW))
                except BlockingIOError:
                    pass
            self.hot = False  # waited past the budget: sleep at once next time
            return out.extend(starmap(sock.recvmsg, _FIRST))
        start = clock()
        out.extend(starmap(sock.recvmsg, _FIRST))
        self.hot = clock() - start <= self.budget


class Frame:
    """A whole frame read off the socket and not yet handed over: its payload, the fds it
    owns, and the hand-over's record (see :meth:`FrameReader.take`); ``counted``: free for
    the channel's own bookkeeping (a queue gives back its semaphore once per frame)."""

    __slots__ = ("data", "fds", "counted", "started", "dead", "result")

    data: bytes | bytearray  # bytes up to _INLINE, else the bytearray read into
    fds: list[int]
    counted: bool
    started: bool
    dead: bool
    result: list[Any]  # what the loader returned, once it returned

    def __init__(self, data: bytes | bytearray, fds: list[int]) -> None:
        self.data, self.fds = data, fds
        self.counted = self.started = self.dead = False
        self.result = []

    def hand_to(self, load: Callable[..., _T], extra: tuple[object, ...]) -> _T:
        # one line: from the moment load is called, the fds are its own.  At most one
        # extra argument, passed plainly: CPython runs signal handlers as a star-call
        # returns (not as a plain call of a Python function does), losing what it returned
        self.started = True; return load(self.data, self.fds, extra[0]) if extra else load(self.data, self.fds)  # noqa: E702,E501


class FrameTooLong(Exception):
    """The frame's header says more bytes than the reader's ``maxsize``; the frame's fds
    were closed."""


class FrameReader:
    """One reader's frames off one socket, atomic with respect to exceptions.

    Everything read of a frame is kept here (see ``_FIRST``) until the frame is whole, so
    an exception raised in the middle of a receive (a signal handler's, a deadline) never
    leaves the socket mid-frame for the next read: an interrupted read finishes the frame
    before the exception goes on (a second interrupt leaves it here), and a read that
    finds the deadline passed keeps what it has for the next call.  A whole frame waits
    in ``ready`` until :meth:`take` hands it to its loader, so a message is delivered by
    the call that read it, or by the next call, or (an exception inside its loader)
    discarded with its fds closed.  Errors the reader finds itself (end of file in a
    frame, a malformed frame) close the frame's fds and say what happened.  Kept per
    process: a forked child lets go of its parent's pending frame (its copies of the fds).
    """

    __slots__ = ("wait", "ready", "_parts", "_chunks", "_buf", "_counts", "_broken", "_pid")

    def __init__(self, wait: SpinWait | None = None) -> None:
        self.wait = wait
        self.ready: Frame | None = None
        self._parts: list[_Msg] = []  # recvmsg results: the header, then any follow-up fd bytes
        self._chunks: list[bytes] = []  # a small payload's reads
        self._buf: bytearray | None = None  # a large payload's buffer ...
        self._counts: list[int] = []  # ... and how much each read put in it
        self._broken: str | None = None
        self._pid = os.getpid()

    @property
    def partial(self) -> bool:
        """Whether this process read part of a frame and not yet the rest: the socket is
        mid-frame for any other reader of it (a queue keeps its read lock meanwhile)."""
        return bool(self._parts) and self._pid == os.getpid()

    def read(self, sock: socket.socket, deadline: float | None = None,
             maxsize: int | None = None) -> bool:
        """Make ``ready`` a whole frame: True, or False when ``deadline`` (a
        ``time.monotonic()`` value) passed first.  A frame longer than ``maxsize`` raises
        :class:`FrameTooLong` from its header, with its fds closed."""
        if (self.ready is not None or self._parts) and self._pid != os.getpid():
            self.discard()  # a forked child: the parent's frame, the parent delivers it
        ready = self.ready
        if ready is not None:
            if ready.dead:
                self._drop(ready)
            elif maxsize is not None and len(ready.data) > maxsize:
                self._drop(ready)
                raise FrameTooLong
            else:
                return True
        if self._broken is not None:
            raise OSError(self._broken)
        try:
            return self._advance(sock, deadline, maxsize)
        except BaseException:
            if self._parts:  # interrupted mid-frame: finish it before going on
                self._advance(sock, deadline, maxsize)
            raise

    def take(self, load: Callable[..., _T], *extra: object) -> _T:
        """``load(data, fds, *extra)`` (``extra``: at most one argument; see
        :meth:`Frame.hand_to`) of the ready frame: its result (see :meth:`load`)."""
        frame = self.load(load, *extra)
        self.ready = None; return frame.result[0]  # type: ignore[no-any-return]  # noqa: E702

    def load(self, load: Callable[..., Any], *extra: object) -> Frame:
        """The ready frame, its ``result`` made by ``load(data, fds, *extra)`` (``extra``:
        at most one argument; see :meth:`Frame.hand_to`), still ready.  ``load`` owns the
        fds from its first line (it closes what it does not keep, however it ends).  An
        exception before ``load`` began leaves the frame for the next call; one after it
        returned leaves its result there; one inside it discards the frame.

        The caller hands the result over in its own frame, one line with no call::

            frames.ready = None; return frame.result[0]

        (:meth:`take` does that for callers that may lose it: CPython 3.10 runs a signal
        handler as any call returns, a Python function's included.)"""
        frame: Frame = self.ready  # type: ignore[assignment]  # read() returned True first
        if not frame.result:
            try:
                frame.result.extend(map(frame.hand_to, (load,), (extra,)))
            except BaseException:
                # raised in load: the frame is discarded; raised as extend returned
                # (where a handler runs after a call): the result stays for the next call
                if frame.started and not frame.result:
                    frame.dead = True
                    self._drop(frame)
                raise
        return frame

    def discard(self) -> None:
        """Close the fds of a pending frame, whole or not, and forget it (the channel is
        closing, or this is a forked child's copy)."""
        frame = self.ready
        if frame is not None:
            frame.dead = True
            self._drop(frame)
        fds, _ = _collect(self._parts)
        self._parts, self._chunks, self._buf, self._counts = [], [], None, []
        close_fds(fds)
        self._pid = os.getpid()

    def _drop(self, frame: Frame) -> None:
        close_fds(frame.fds)  # each entry -1 once closed: a second call closes nothing
        self.ready = None

    def _fail(self, message: str, broken: bool = False) -> OSError:
        """The error for a frame the reader refuses: its fds closed; ``broken``: the rest
        of it is still in the socket, so nothing after it can be read."""
        fds, _ = _collect(self._parts)
        self._parts, self._chunks, self._buf, self._counts = [], [], None, []
        close_fds(fds)
        if broken:
            self._broken = (f"this channel is out of step after a malformed frame "
                            f"({message}); nothing more can be read from it")
        return OSError(message)

    def _recv(self, sock: socket.socket, out: list[Any], fn: Callable[..., Any],
              args: tuple[Any, ...], deadline: float | None) -> bool:
        """``out.extend(starmap(fn, (args,)))``; with a deadline, without blocking past it
        (False).  End of file in a frame raises."""
        if deadline is None:
            out.extend(starmap(fn, (args,)))
        else:
            args = args[:-1] + (args[-1] | _DONTWAIT,)
            while True:
                try:
                    out.extend(starmap(fn, (args,)))
                    break
                except BlockingIOError:
                    if not _wait_readable(sock, deadline):
                        return False
        last = out[-1]
        if not (last if type(last) is not tuple else last[0]):  # a count, bytes, a recvmsg
            if out is self._parts and len(out) == 1:
                self._parts = []
                raise EOFError
            raise self._fail(_TRUNCATED)
        return True

    def _advance(self, sock: socket.socket, deadline: float | None,
                 maxsize: int | None) -> bool:
        parts = self._parts
        if not parts:
            if deadline is None and self.wait is not None:
                self.wait.read_into(sock, parts)
                if not parts[0][0]:
                    self._parts = []
                    raise EOFError
            elif not self._recv(sock, parts, sock.recvmsg, (4, _ANC_SIZE, _RECV_FLAGS),
                                deadline):
                return False
        while True:
            need, n, nfds = self._header(parts)
            if not need:
                break
            if not self._recv(sock, parts, sock.recvmsg, (need, _ANC_SIZE, _RECV_FLAGS),
                              deadline):
                return False
        if maxsize is not None and n > maxsize:
            self._fail("")
            raise FrameTooLong
        if n <= _INLINE:
            chunks = self._chunks
            have = sum(map(len, chunks))
            while have < n:
                if not self._recv(sock, chunks, sock.recv, (n - have, _RECV_FLAGS), deadline):
                    return False
                have += len(chunks[-1])
            data: bytes | bytearray = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        else:
            if self._buf is None:
                self._buf = bytearray(n)
            view = memoryview(self._buf)
            pos = sum(self._counts)
            while pos < n:
                if not self._recv(sock, self._counts, sock.recv_into, (view[pos:], 0, 0),
                                  deadline):
                    return False
                pos += self._counts[-1]
            data = self._buf
        fds, dropped = _collect(parts)
        if dropped:
            raise self._fail("file descriptors were dropped in transit (MSG_CTRUNC): this "
                             "process hit its open-file limit; raise it (ulimit -n) or hold "
                             "fewer arrays from different producers; the message was "
                             "discarded")
        if len(fds) != nfds:
            raise self._fail(f"a malformed frame: its header says {nfds} fds and {len(fds)} "
                             f"came; the message was discarded (the channel is in step)")
        # one statement: the frame goes from partial to whole with no point in between
        self.ready, self._parts, self._chunks, self._buf, self._counts = (
            Frame(data, fds), [], [], None, [])
        return True

    def _header(self, parts: list[_Msg]) -> tuple[int, int, int]:
        """(bytes of the header, and of any follow-up fd bytes, still to read; payload
        length; fd count) from the reads so far."""
        head = parts[0][0] if len(parts) == 1 else b"".join(p[0] for p in parts)
        got = len(head)
        if got < 4:
            return 4 - got, 0, 0
        (code,) = _SMALL.unpack_from(head)
        if code >= 0:
            return 4 - got, code, 0  # stdlib framing: never read past the header
        if code == -1:
            if got < 12:
                return 12 - got, 0, 0
            return 0, _Q.unpack_from(head, 4)[0], 0
        if code == -2:
            if got < 16:
                return 16 - got, 0, 0
            n, nfds = _QI.unpack_from(head, 4)
            size = 16
        elif (-3 - code) & 0xFF:
            n, nfds = divmod(-3 - code, 256)
            size = 4
        else:
            raise self._fail(f"bad frame header {code}: the peer does not speak this "
                             f"protocol", broken=True)
        if nfds > MAX_FDS:
            limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            if nfds > limit:
                raise self._fail(f"a malformed frame: its header says {nfds} fds, more than "
                                 f"a process may open here (ulimit -n {limit})", broken=True)
            size += -(-(nfds - MAX_FDS) // MAX_FDS)  # one follow-up byte per 253 more fds
        return size - got, n, nfds


def _wait_readable(sock: socket.socket, deadline: float) -> bool:
    """Wait until ``sock`` has something to read, or ``deadline`` passes (False)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if poller.poll(max(1, math.ceil(left * 1000))):
            return True


def recv_frame(sock: socket.socket,
               wait: SpinWait | None = None) -> tuple[bytes | bytearray, list[int]]:
    """Receive one frame: ``(payload, fds)``; the caller owns (and must close) the fds.
    ``wait``: the reader's :class:`SpinWait`, if it spins before sleeping.  A reader that
    may be interrupted keeps a :class:`FrameReader` instead."""
    reader = FrameReader(wait)
    reader.read(sock)
    return reader.take(_as_received)


def _as_received(data: bytes | bytearray, fds: list[int]) -> tuple[bytes | bytearray, list[int]]:
    return data, fds


_TRUNCATED = "got end of file during message"  # as the stdlib's Connection says: the peer
# closed in the middle of a frame (it died mid-send); EOFError is only for an end between


def close_fds(fds: Iterable[int]) -> None:
    """Close every fd of ``fds`` that is not -1 (a slot given away), ignoring ones already
    closed: for received fds nobody keeps, and fds a process lets go of at exit.  In a
    list, each entry becomes -1 as it is closed, so closing the same list again (after an
    exception cut the first call short) closes nothing twice."""
    if type(fds) is not list:
        fds = list(fds)
    for i, fd in enumerate(fds):
        if fd >= 0:
            try:
                # one line: no signal handler runs between giving the entry up and closing it
                fds[i] = -1; os.close(fd)  # noqa: E702
            except OSError:
                pass
