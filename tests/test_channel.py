"""``shmtensor._channel.Channel`` on its own: a message inline in the ring, with fds or
longer than a record on the side socket, longer than a datagram in a memfd; order,
Full/Empty and timeouts, EPIPE once nobody reads, a dead writer's orphan datagram, a
reader of another process cut short (``Lost``), exceptions around ``take``'s loader, fork,
and a Queue pickled into spawned processes.

Children are forked unless a test says otherwise; every blocking call has a deadline,
every child is joined and its exit code checked, and ``no_leaks`` checks this process's
fds."""

from __future__ import annotations

import errno
import inspect
import multiprocessing
import os
import queue
import random
import select
import signal
import socket
import struct
import sys
import threading
import time
from itertools import starmap

import numpy as np
import pytest

import shmtensor.multiprocessing as smp
from shmtensor import _channel
from shmtensor._channel import SIDE_MAX, Channel, Lost
from shmtensor.ipc import ring as ringmod

import channel_helpers
from conftest import join_all, open_fds as fds

pytestmark = pytest.mark.skipif(not ringmod.HAVE_RING, reason="needs memfd, OFD locks, futex")

ctx = multiprocessing.get_context("fork")
JOIN = 30  # seconds: only reached when something is wedged
RECORD = 64  # record size of the channels made here: 48 bytes of message inline


@pytest.fixture
def chan(no_leaks):
    """A channel of 8 records of RECORD bytes on a new socket pair (closed after)."""
    r, w = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ch = Channel.create(r, w, 8, RECORD)
    yield ch
    ch.close()
    r.close()
    w.close()


def join(procs, codes=(0,), timeout=JOIN):
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    stuck = [p for p in procs if p.is_alive()]
    for p in stuck:
        p.kill()
        p.join(5)
    assert not stuck, f"{len(stuck)} children did not finish within {timeout}s"
    assert [p.exitcode for p in procs] == [c for p, c in zip(procs, codes * len(procs))]


def keep(data, fds):
    """A loader that keeps the message: its bytes and its fds (the caller closes them)."""
    return bytes(data), list(fds)


def receive(ch: Channel, block: bool = True, timeout: float | None = JOIN, load=keep):
    """One message of ``ch``, as a queue's get takes it: the turn, receive, take."""
    acquire = ch.turn_args(block, timeout)  # first: in a forked child, it makes a new turn
    held: list[bool] = []
    try:
        held.extend(starmap(ch.turn.acquire, (acquire,)))
        assert held[0]
        ch.receive(block, timeout)
        number, frame = ch.load(load)
        held[0] = False; ch.turn.release(); ch._last[0] = number; del ch._taken[0]; ch._handing = 0; return frame.result[0]  # noqa: E702,E501
    finally:
        if held and held[0]:
            ch.turn.release()


def receive_closed(ch: Channel, **kw) -> bytes:
    """The bytes of the next message, its fds closed."""
    data, got = receive(ch, **kw)
    for fd in got:
        os.close(fd)
    return data


def kind_of_last(ch: Channel) -> bytes:
    """The kind byte of the record written last (inline, side or memfd)."""
    ring = ch.ring
    off = ringmod._RECORDS + (ring.tail - 1) % ring.capacity * ring.record_size
    return bytes(ring._mem[off + ringmod._REC_SIZE:off + ringmod._REC_SIZE + 1])


def side_waiting(ch: Channel) -> tuple[int, bool] | None:
    """The waiting datagram's length and whether it carries fds (peeked: nothing taken,
    no fd installed), or None."""
    try:
        data, _, flags, _ = ch._side_r.recvmsg(1 << 17, 0, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None
    return len(data), bool(flags & socket.MSG_CTRUNC)


def memfd_of(data: bytes) -> int:
    fd = os.memfd_create("test_channel")
    os.write(fd, data)
    return fd


def contents(fd: int) -> bytes:
    return os.pread(fd, 1 << 16, 0)


def same_file(a: int, b: int) -> bool:
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


# -- the three kinds of message -----------------------------------------------------------

def test_inline(chan):
    room = chan.ring.payload_max - 1  # the kind byte takes one
    for data in (b"", b"hello", bytes(range(room))):
        chan.send(data)
        assert kind_of_last(chan) == _channel._INLINE
        assert side_waiting(chan) is None
        assert receive(chan) == (data, [])
    assert chan.empty()


def test_fds_are_new_fds_of_the_same_files(chan):
    a, b = memfd_of(b"first"), os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    try:
        chan.send(b"two fds", [a, b])
        assert kind_of_last(chan) == _channel._SIDE
        assert side_waiting(chan) == (_channel._HEAD.size + len(b"two fds"), True)
        data, got = receive(chan)
        try:
            assert data == b"two fds" and len(got) == 2
            assert not {a, b} & set(got)  # new fds: the sender keeps its own
            assert same_file(got[0], a) and same_file(got[1], b)
            assert contents(got[0]) == b"first"
            os.fstat(a), os.fstat(b)  # still open: the caller keeps them
        finally:
            for fd in got:
                os.close(fd)
    finally:
        os.close(a)
        os.close(b)


@pytest.mark.parametrize("size,kind", [
    (RECORD - 16 - 1, _channel._INLINE),   # the longest inline message
    (RECORD - 16, _channel._SIDE),         # one byte too long for a record
    (20_000, _channel._SIDE),
    (SIDE_MAX, _channel._SIDE),            # the longest datagram body
    (SIDE_MAX + 1, _channel._BIG),         # in a memfd
    (5 << 20, _channel._BIG),
])
def test_long_bodies_arrive_intact(chan, size, kind):
    data = random.Random(size).randbytes(size)
    chan.send(data)
    assert kind_of_last(chan) == kind
    waiting = side_waiting(chan)
    if kind == _channel._INLINE:
        assert waiting is None
    elif kind == _channel._SIDE:
        assert waiting == (_channel._HEAD.size + size, False)  # number and tag, then the body
    else:
        assert waiting == (_channel._HEAD.size, True)  # number and tag; the body a memfd
    before = fds()
    assert receive(chan) == (data, [])
    assert fds() == before  # a memfd body is closed once taken
    assert side_waiting(chan) is None


def _mixed(i: int, rng: random.Random) -> tuple[bytes, bytes | None]:
    """Message ``i``: (its bytes, the contents of the memfd it carries or None)."""
    kind = rng.randrange(4)
    head = i.to_bytes(4, "little")
    if kind == 0:
        return head + rng.randbytes(rng.randrange(40)), None
    if kind == 1:
        return head + rng.randbytes(rng.randrange(100)), b"fd %d" % i
    if kind == 2:
        return head + rng.randbytes(rng.randrange(100, SIDE_MAX - 4)), None
    return head + rng.randbytes(SIDE_MAX + rng.randrange(1, 50_000)), None


def _send_mixed(ch: Channel, n: int, seed: int) -> None:
    rng = random.Random(seed)
    for i in range(n):
        data, fd_contents = _mixed(i, rng)
        fd = [] if fd_contents is None else [memfd_of(fd_contents)]
        try:
            ch.send(data, fd, timeout=JOIN)
        finally:
            for f in fd:
                os.close(f)


def _check_mixed(ch: Channel, n: int, seed: int) -> None:
    rng = random.Random(seed)
    for i in range(n):
        data, fd_contents = _mixed(i, rng)
        got, got_fds = receive(ch)
        try:
            assert got[:4] == data[:4], (i, int.from_bytes(got[:4], "little"))
            assert got == data
            assert [contents(f) for f in got_fds] == ([] if fd_contents is None
                                                       else [fd_contents])
        finally:
            for f in got_fds:
                os.close(f)


def _send_mixed_child(ch: Channel, n: int, seed: int) -> None:
    _send_mixed(ch, n, seed)
    os._exit(0)


def test_order_kept_across_kinds(chan):
    """Inline, fd-carrying, side and memfd messages interleaved, through a ring of 8
    records that a writer of another process keeps full: they arrive in order."""
    n = 300
    p = ctx.Process(target=_send_mixed_child, args=(chan, n, 5))
    p.start()
    try:
        _check_mixed(chan, n, 5)
    finally:
        join([p])
    assert chan.empty() and side_waiting(chan) is None


# -- full and empty -----------------------------------------------------------------------

def test_full_and_empty(chan):
    for i in range(8):
        chan.send(b"%d" % i)
    fd = memfd_of(b"x")
    try:
        for data, fds_ in ((b"inline", []), (b"s" * 100, []), (b"f", [fd]),
                           (b"b" * (SIDE_MAX + 1), [])):
            with pytest.raises(queue.Full):
                chan.send(data, fds_, block=False)
            began = time.monotonic()
            with pytest.raises(queue.Full):
                chan.send(data, fds_, timeout=0.1)
            assert time.monotonic() - began >= 0.1
            assert side_waiting(chan) is None  # nothing sent of a message not written
    finally:
        os.close(fd)
    # room made by a reader of another thread while a send waits
    t = threading.Timer(0.05, lambda: receive(chan))
    t.start()
    chan.send(b"s" * 100, timeout=JOIN)
    t.join(JOIN)
    assert [receive_closed(chan) for _ in range(8)] == [b"%d" % i for i in range(1, 8)] + \
        [b"s" * 100]
    with pytest.raises(queue.Empty):
        chan.receive(block=False)
    began = time.monotonic()
    with pytest.raises(queue.Empty):
        chan.receive(timeout=0.1)
    assert time.monotonic() - began >= 0.1



def _full_queue(size):
    q = smp.Queue(size)
    for i in range(size):
        q.put(i)
    deadline = time.monotonic() + JOIN
    while q.qsize() < size and time.monotonic() < deadline:  # sent (by this thread)
        time.sleep(0.001)
    return q


def _close(q):
    q.close()
    q.join_thread()  # its feeder gone before the next test looks at this process's fds


def test_a_put_on_a_full_queue_takes_the_room_there_is_at_its_deadline(monkeypatch):
    """A put waiting for half its queue to be free still takes a place that came free
    meanwhile when its deadline comes, as a wait on the semaphore would have."""
    from shmtensor import _queues
    monkeypatch.setattr(_queues, "ROOM_LOOKS", 60.0)  # only the looks for half the queue
    q = _full_queue(32)
    reader = threading.Timer(0.05, lambda: q.get(timeout=JOIN))  # one place of 32
    try:
        reader.start()
        q.put("last", timeout=0.5)
        reader.join(JOIN)
        with pytest.raises(queue.Full):
            q.put("more", timeout=0.05)
        assert [q.get(timeout=JOIN) for _ in range(32)] == [*range(1, 32), "last"]
    finally:
        reader.join(JOIN)
        _close(q)


@pytest.mark.parametrize("size, looks, took", [(32, 60.0, 16), (32, 0.01, 1), (8, 60.0, 1)],
                         ids=["half free", "stopped reader", "small queue"])
def test_a_blocked_put_goes_on_once_half_its_queue_is_free_or_it_stops_looking(
        monkeypatch, size, looks, took):
    """Producers that outrun their reader refill the queue once half of it is free; a put
    whose reader took less than that and stopped waits on the semaphore after
    ``ROOM_LOOKS`` seconds, and a place then is enough; so does a put on a queue of fewer
    than ``ROOM_MIN`` places, at once."""
    from shmtensor import _queues
    monkeypatch.setattr(_queues, "ROOM_LOOKS", looks)
    q = _full_queue(size)
    reader = threading.Timer(0.05, lambda: [q.get(timeout=JOIN) for _ in range(took)])
    done = threading.Event()
    putter = threading.Thread(target=lambda: (q.put("next"), done.set()), daemon=True)
    try:
        reader.start()
        putter.start()
        assert done.wait(JOIN), "the put never went on"
        got = [q.get(timeout=JOIN) for _ in range(size - took + 1)]
        assert got == [*range(took, size), "next"]
    finally:
        reader.join(JOIN)
        putter.join(JOIN)
        _close(q)


def test_full_side_socket(no_leaks):
    """Datagrams that fill the side socket's buffer before the ring fills: Full without
    block, Full at the deadline with it; nothing half sent, everything sent arrives."""
    r, w = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    w.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
    ch = Channel.create(r, w, 1024, RECORD)
    try:
        body = b"d" * (SIDE_MAX - 100)
        sent = 0
        with pytest.raises(queue.Full):
            while sent < 1024:
                ch.send(body + sent.to_bytes(4, "little"), block=False)
                sent += 1
        assert 0 < sent < 1024  # the socket, not the ring, was full
        with pytest.raises(queue.Full):
            ch.send(body, timeout=0.05)
        for i in range(sent):
            assert receive_closed(ch) == body + i.to_bytes(4, "little")
        ch.send(b"after" * 100, timeout=JOIN)
        assert receive_closed(ch) == b"after" * 100
        assert ch.empty()
    finally:
        ch.close()
        r.close()
        w.close()


# -- nobody reads ---------------------------------------------------------------------------

def _hold_reader_then_read(ch: Channel, go, out) -> None:
    ch._side_w.close()  # only the reading end is this child's
    if not go.wait(JOIN):
        os._exit(2)
    out.send([receive_closed(ch) for _ in range(2)])
    os._exit(0)


def _broken(ch: Channel) -> None:
    fd = memfd_of(b"x")
    try:
        for data, fds_ in ((b"inline", []), (b"side" * 100, []), (b"fd", [fd]),
                           (b"b" * (SIDE_MAX + 1), [])):
            with pytest.raises(BrokenPipeError) as e:
                ch.send(data, fds_)
            assert e.value.errno == errno.EPIPE
    finally:
        os.close(fd)


def test_broken_pipe_once_every_reader_closed(no_leaks):
    r, w = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ch = Channel.create(r, w, 8, RECORD)
    try:
        ch.send(b"while read")  # this process reads
        r.close()
        _broken(ch)
    finally:
        ch.close()
        w.close()


def test_broken_pipe_once_a_child_reader_exits(no_leaks):
    """While a forked child holds the reading end, sends go through (and arrive); once it
    exits, every send raises BrokenPipeError."""
    r, w = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ch = Channel.create(r, w, 8, RECORD)
    go = ctx.Event()
    out_r, out_w = ctx.Pipe(False)
    p = ctx.Process(target=_hold_reader_then_read, args=(ch, go, out_w))
    try:
        p.start()
        out_w.close()
        r.close()
        assert not ch.readers_gone()
        ch.send(b"one")
        ch.send(b"two" * 100)
        go.set()
        assert out_r.poll(JOIN)
        assert out_r.recv() == [b"one", b"two" * 100]
        join([p])
        assert ch.readers_gone()
        _broken(ch)
    finally:
        if p.is_alive():
            p.kill()
            p.join(5)
        out_r.close()
        ch.close()
        w.close()


# -- a writer dead between its datagram and its record ---------------------------------------

def _die_after_the_datagram(ch: Channel, data: bytes, fd: int) -> None:
    """Send a message whose side datagram goes out, then die (SIGKILL) holding the
    writers' lock, before the record is written."""
    real = Channel._send_side

    def send_side_and_die(self, *args):
        real(self, *args)
        os.kill(os.getpid(), signal.SIGKILL)

    Channel._send_side = send_side_and_die  # this child's class only
    ch.send(data, [fd])
    os._exit(3)  # not reached


@pytest.mark.parametrize("first", ["inline", "side"])
@pytest.mark.parametrize("size", [10, SIDE_MAX + 10])
def test_orphan_datagram_is_closed(chan, size, first):
    """The writer of a side message died between its datagram and its record (holding
    the writers' lock): the next writer takes the lock over, and the reader closes the
    orphan's fds (the writing end of a pipe here) and reads on; every later message,
    ``first`` inline or on the side, arrives intact, and nothing leaks."""
    rp, wp = os.pipe()
    try:
        p = ctx.Process(target=_die_after_the_datagram, args=(chan, b"o" * size, wp))
        p.start()
        join([p], codes=(-signal.SIGKILL,))
        os.close(wp)
        wp = -1
        assert side_waiting(chan) is not None and chan.ring.empty()
        fd = memfd_of(b"later")
        later = [(b"side after", [fd], [b"later"]), (b"inline after", [], []),
                 (b"big after" * 10_000, [], [])]
        if first == "inline":
            later[:2] = later[1::-1]
        for data, fds_, _ in later:
            chan.send(data, fds_, timeout=JOIN)  # the first takes the writers' lock over
        os.close(fd)
        assert chan.ring.recovered == 1
        for data, _, fd_contents in later:
            got, got_fds = receive(chan)
            try:
                assert (got, [contents(f) for f in got_fds]) == (data, fd_contents)
            finally:
                for f in got_fds:
                    os.close(f)
        # the orphan's copy of wp was closed: the pipe has no writer left
        assert select.select([rp], [], [], 0)[0] == [rp] and os.read(rp, 1) == b""
        assert chan.empty() and side_waiting(chan) is None
    finally:
        os.close(rp)
        if wp >= 0:
            os.close(wp)


# -- a receive cut short ------------------------------------------------------------------

class Interrupted(Exception):
    pass


def _line_of(func, text: str) -> int:
    lines, first = inspect.getsourcelines(func)
    found = [first + i for i, line in enumerate(lines) if text in line]
    assert len(found) == 1, f"{text!r} is not one line of {func.__qualname__}"
    return found[0]


class interrupt_at:
    """Run ``action()`` (once) as ``func`` is about to run its line containing ``text``:
    an exception it raises comes out of that line, as a signal handler's would."""

    def __init__(self, func, text: str, action) -> None:
        self.code, self.line = func.__code__, _line_of(func, text)
        self.action, self.fired = action, False

    def _local(self, frame, event, arg):
        if event == "line" and frame.f_lineno == self.line and not self.fired:
            self.fired = True
            self.action()
        return self._local

    def _global(self, frame, event, arg):
        return self._local if frame.f_code is self.code else None

    def __enter__(self):
        self._before = sys.gettrace()
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(self._before)


def _raise():
    raise Interrupted


AFTER_RECVMSG = "data, flags = raw[0][0], raw[0][2]"  # _side_frame: the datagram is in hand


def _die_with_the_datagram(ch: Channel) -> None:
    with interrupt_at(Channel._side_frame, AFTER_RECVMSG,
                      lambda: os.kill(os.getpid(), signal.SIGKILL)):
        ch.receive(timeout=JOIN)
    os._exit(3)  # not reached


@pytest.mark.parametrize("then", [
    "nothing", "a side message", "a short side message",
    "an inline message"])
def test_lost_to_the_next_reader(chan, then):
    """A reader of another process took a side record's datagram and died before the
    ring's head moved: the next reader gets the record, reports it ``Lost`` (no hang),
    and what follows arrives intact."""
    fd = memfd_of(b"lost")
    chan.send(b"will be lost", [fd])
    os.close(fd)
    p = ctx.Process(target=_die_with_the_datagram, args=(chan,))
    p.start()
    join([p], codes=(-signal.SIGKILL,))
    assert chan.ring.qsize() == 1 and side_waiting(chan) is None  # record here, body gone
    nxt = {"nothing": None, "a side message": b"next" * 100,
           "a short side message": b"next",  # with an fd: a datagram shorter than the lost one's
           "an inline message": b"next"}[then]
    if nxt is not None:
        fd = memfd_of(b"next's")
        chan.send(nxt, [fd] if then == "a short side message" else [])
        os.close(fd)
    with pytest.raises(Lost):
        receive(chan, timeout=JOIN)
    if nxt is None:
        with pytest.raises(queue.Empty):
            chan.receive(timeout=0.05)
    else:
        data, got = receive(chan)
        assert data == nxt
        assert [contents(f) for f in got] == ([b"next's"] if then == "a short side message"
                                              else [])
        for f in got:
            os.close(f)
    assert chan.empty() and side_waiting(chan) is None


def test_interrupted_in_this_process_is_resumed(chan):
    """The same cut in this process: its next receive delivers the message, once."""
    fd = memfd_of(b"kept")
    chan.send(b"resumed", [fd])
    chan.send(b"second" * 100)
    os.close(fd)
    with interrupt_at(Channel._side_frame, AFTER_RECVMSG, _raise), \
            pytest.raises(Interrupted):
        receive(chan)
    assert chan.ring.qsize() == 2  # the hook raised: the record stays in the ring
    data, got = receive(chan)
    assert data == b"resumed" and [contents(f) for f in got] == [b"kept"]
    for f in got:
        os.close(f)
    assert receive_closed(chan) == b"second" * 100
    assert chan.empty()


# -- exceptions around take's loader --------------------------------------------------------

def test_exception_before_the_loader_leaves_the_message(chan):
    """An exception in ``take`` before the loader begins: the next receive of this
    process hands the same message over, once."""
    fd = memfd_of(b"a")
    chan.send(b"first", [fd])
    chan.send(b"second")
    os.close(fd)
    with interrupt_at(Channel.load, "if not frame.result:", _raise), \
            pytest.raises(Interrupted):
        receive(chan)
    data, got = receive(chan)
    assert data == b"first" and [contents(f) for f in got] == [b"a"]
    for f in got:
        os.close(f)
    assert receive_closed(chan) == b"second"
    assert chan.empty()


def test_exception_after_the_loader_returned_keeps_its_result(chan):
    """An exception once the loader returned, before the hand-over: the next receive
    hands over what that loader returned, without loading the message again."""
    chan.send(b"first")
    chan.send(b"second")
    calls = []

    def load(data, fds_):
        calls.append(bytes(data))
        return bytes(data)

    with interrupt_at(Channel.load, "return number, frame", _raise), \
            pytest.raises(Interrupted):
        receive(chan, load=load)
    assert receive(chan, load=load) == b"first"
    assert receive(chan, load=load) == b"second"
    assert calls == [b"first", b"second"]


def test_exception_inside_the_loader_discards_the_message(chan):
    """The loader owns the message from its first line: if it raises, the message is
    gone, with its fds closed (not delivered later, not twice); the next receive gets
    the next message."""
    rp, wp = os.pipe()
    chan.send(b"first", [wp])
    os.close(wp)
    chan.send(b"second")
    seen = []

    def failing(data, fds_):
        seen.append(list(fds_))
        raise ValueError("cannot load")

    with pytest.raises(ValueError):
        receive(chan, load=failing)
    assert len(seen) == 1 and len(seen[0]) == 1
    # the message's copy of wp was closed: the pipe has no writer left
    assert select.select([rp], [], [], 0)[0] == [rp] and os.read(rp, 1) == b""
    os.close(rp)
    assert receive_closed(chan) == b"second"
    assert chan.empty()


# -- fork ---------------------------------------------------------------------------------

def _receive_in_child(ch: Channel, out) -> None:
    data, got = receive(ch)
    out.send((data, [contents(f) for f in got], len(ch._taken)))
    os._exit(0)


def test_fork_child_does_not_deliver_what_the_parent_took(chan):
    """The parent took a message (a receive, no take yet) and forks: the child's receive
    gets the ring's next message, and the parent's take still hands over its own."""
    a, b = memfd_of(b"parent's"), memfd_of(b"child's")
    chan.send(b"taken by the parent", [a])
    chan.send(b"for the child", [b])
    os.close(a)
    os.close(b)
    frame = chan.receive(timeout=JOIN)
    assert frame.data == b"taken by the parent"
    out_r, out_w = ctx.Pipe(False)
    p = ctx.Process(target=_receive_in_child, args=(chan, out_w))
    p.start()
    out_w.close()
    try:
        assert out_r.poll(JOIN)
        assert out_r.recv() == (b"for the child", [b"child's"], 0)
        join([p])
    finally:
        out_r.close()
    data, got = receive(chan)  # the frame taken before the fork
    assert data == b"taken by the parent" and [contents(f) for f in got] == [b"parent's"]
    for f in got:
        os.close(f)
    assert chan.empty()


# -- a Queue pickled into spawned processes ----------------------------------------------------

def test_queue_across_spawn(lc):
    """A Queue's ring travels with it into spawned producers and consumers (its
    __getstate__/__setstate__): 2 producers, 2 consumers, every kind of message, each
    delivered once and intact."""
    sctx = smp.get_context("spawn")
    q, out = sctx.Queue(), sctx.Queue()
    n = 60
    producers = [sctx.Process(target=channel_helpers.produce_mixed, args=(q, wid, n))
                 for wid in range(2)]
    consumers = [sctx.Process(target=channel_helpers.consume_mixed, args=(q, out))
                 for _ in range(2)]
    for p in producers + consumers:
        p.start()
        lc.check_pid(p.pid)
    try:
        join_all(*producers)
        assert [p.exitcode for p in producers] == [0, 0]
        for _ in consumers:
            q.put(None)
        got = [out.get(timeout=JOIN) for _ in consumers]
        join_all(*consumers)
        assert [p.exitcode for p in consumers] == [0, 0]
    finally:
        for p in producers + consumers:
            if p.is_alive():
                p.kill()
                p.join(5)
    seen = sorted(m for ok, ms in got for m in ms)
    assert all(ok for ok, _ in got), got
    assert seen == sorted((wid, i) for wid in range(2) for i in range(n))
    q.close()
    q.join_thread()
    out.close()
    out.join_thread()
    del q, out


# -- threads on both ends -----------------------------------------------------------------

def _put_mixed(q, who: int, n: int) -> None:
    import shmtensor
    for i in range(n):
        k = i % 3
        if k == 0:
            q.put((who, i, None))
        elif k == 1:
            q.put((who, i, np.full(128, i)))  # a record of its own
        else:
            a = shmtensor.empty(16)  # fds: a side datagram
            a[:] = i
            q.put((who, i, a))


def test_threads_on_both_ends_get_each_message_once():
    """Producer threads here and in a child, consumer threads here, switching threads as
    often as CPython allows: a thread that gets the turn while another is handing its
    message over waits for it, so no message is delivered twice or lost."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    q = smp.get_context("fork").Queue()
    n, producers, consumers = 600, 3, 3
    got: list = []
    errors: list = []

    def consume():
        try:
            while True:
                m = q.get(timeout=JOIN)
                if m is None:
                    return
                who, i, v = m
                got.append((who, i, v is None or int(v[0]) == i))
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    child = smp.get_context("fork").Process(target=_put_mixed, args=(q, producers, n))
    ts = [threading.Thread(target=consume) for _ in range(consumers)]
    ps = [threading.Thread(target=_put_mixed, args=(q, w, n)) for w in range(producers)]
    try:
        child.start()
        for t in ts + ps:
            t.start()
        join_all(*ps)
        child.join(JOIN)
        assert child.exitcode == 0
        for _ in ts:
            q.put(None)
        join_all(*ts)
    finally:
        sys.setswitchinterval(old)
        q.close()
        q.join_thread()
    assert not errors, errors[:3]
    keys = [(w, i) for w, i, _ in got]
    assert len(keys) == len(set(keys)), "a message was delivered twice"
    assert set(keys) == {(w, i) for w in range(producers + 1) for i in range(n)}
    assert all(ok for *_, ok in got)


# -- a full channel, malformed records and datagrams ----------------------------------------

def test_a_full_channel_refuses_a_long_body_before_copying_it(chan, monkeypatch):
    """The feeder tries a full channel again and again: each try must not copy the body."""
    for i in range(chan.ring.capacity):
        chan.send(b"x%d" % i)
    copies = []
    monkeypatch.setattr(_channel, "_memfd_of", lambda data, into: copies.append(1))
    for _ in range(3):
        with pytest.raises(queue.Full):
            chan.send(bytes(SIDE_MAX + 1), block=False)
    assert not copies, "a body was copied into a memfd for a send that could not happen"
    for i in range(chan.ring.capacity):
        assert receive_closed(chan) == b"x%d" % i


@pytest.mark.parametrize("record", [b"", b"S", b"B1234"], ids=["empty", "kind", "short tag"])
def test_a_record_too_short_for_its_kind_is_lost_once(chan, record):
    chan.ring.put(record)  # not a writer of this channel: as a buggy or hostile peer would
    chan.send(b"after")
    with pytest.raises(Lost):
        receive(chan)
    assert receive(chan) == (b"after", [])


def test_a_datagram_numbered_past_its_record_is_dropped_and_the_record_read(chan):
    """Junk on the side socket (numbered far ahead, with an fd) is closed, and the side
    messages after it arrive."""
    r, w = os.pipe()
    try:
        chan._side_w.sendmsg([_channel._HEAD.pack(1 << 40, 7)],
                             [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", w))])
        os.close(w)
        w = -1
        body = bytes(range(256)) * 20  # longer than a record: a side datagram
        chan.send(body)
        chan.send(body[::-1])
        assert receive(chan) == (body, [])
        assert receive(chan) == (body[::-1], [])
        assert os.read(r, 1) == b""  # the junk's fd was closed: EOF on the pipe
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


@pytest.mark.parametrize("body", ["directory", "unsealed memfd", "regular file"])
def test_a_long_body_in_a_file_that_is_not_a_sealed_memfd_is_lost_once(chan, body, tmp_path):
    """A peer that writes a long message's record and datagram itself, with a body fd that
    is a directory, a memfd it could still shrink under the reader, or a (sparse, 1 GiB)
    file: ``Lost`` once, its fd closed, and the messages after it arrive."""
    before = fds()
    if body == "directory":
        fd = os.open(tmp_path, os.O_RDONLY)
    elif body == "unsealed memfd":
        fd = memfd_of(b"x" * (SIDE_MAX + 1))
    else:
        fd = os.open(tmp_path / "sparse", os.O_RDWR | os.O_CREAT)
    tag = 99
    try:
        if body == "regular file":
            os.ftruncate(fd, 1 << 30)
        def side(number):
            chan._side_w.sendmsg([_channel._HEAD.pack(number, tag)],
                                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))])
        chan.ring.put(_channel._BIG + _channel._TAG.pack(tag), hook=side)
    finally:
        os.close(fd)
    chan.send(b"after" * 1000)
    with pytest.raises(Lost):
        receive(chan)
    assert receive(chan) == (b"after" * 1000, [])
    assert fds() <= before, "the bad body's fd was kept"
