"""A one-array message of a slab, or of a segment of its own sent again, goes without fds to a queue's sole reader that was sent
them once (docs/channel-design.md, "fds only when new"): the guarantees of a message with
fds hold (the producer may exit right after ``put``; a second reader, or one that follows
a dead one, gets them through the writer's or the first reader's fds; nothing corrupt,
nothing leaked), and a message nobody can attach any more is lost with an error that
says why, the queue going on."""

from __future__ import annotations

import collections
import gc
import os
import pickle
import queue
import signal
import socket
import struct
import time

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp
from shmtensor import _channel
from shmtensor.ipc import scm_rights

from conftest import JOIN, join_all
from handle_helpers import (OWN, echo, echo_and_own, echo_later, put_after_first, put_again,
                            put_again_then_free, put_and_free, put_fresh, put_many, put_six,
                            hold_writers_lock, put_six_and_wait, put_six_simple, take_two_then,
                            take_two_simple_and_wait,
                            stream_and_count_slabs,
                            take_all, take_and_report, take_first_then_rest,
                            take_two_and_wait, three_then_none)


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _sole_reader_of(n: int):
    """A spawned producer of ``n`` arrays after a first one, which this process took (so
    it is the queue's sole reader): (queue, producer, the first array)."""
    ctx = smp.get_context("spawn")
    q, took = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=put_after_first, args=(q, took, n))
    p.start()
    first = q.get(timeout=JOIN)
    assert first[0] == 0
    took.set()
    return q, p, first


def test_arrays_after_the_first_go_without_fds_and_cost_no_fd(lc, counted):
    n = 300
    q, p, first = _sole_reader_of(n)
    second = q.get(timeout=JOIN)  # announces its slab: its memfd is kept once
    fds = _fds()
    got = [second] + [q.get(timeout=JOIN) for _ in range(n - 1)]
    assert [int(a[0]) for a in got] == list(range(1, n + 1))
    assert all((a == a[0]).all() for a in got)
    assert counted[0] >= n - 2  # all but the slab's announce (and one a slab change makes)
    assert _fds() == fds  # no fd per message, however many are alive
    join_all(p)
    assert p.exitcode == 0
    del first, second, got
    q.close()


def test_a_producer_that_exits_right_after_its_puts_delivers_every_array(lc, counted):
    n = 200
    q, p, first = _sole_reader_of(n)
    del first
    join_all(p)  # gone before its arrays are read: the memory stays for the reader
    assert p.exitcode == 0
    got = [q.get(timeout=JOIN) for _ in range(n)]
    assert [int(a[0]) for a in got] == list(range(1, n + 1))
    assert all((a == a[0]).all() for a in got)
    assert counted[0] >= n - 2


def test_a_second_reader_gets_what_was_sent_to_the_first_after_its_writer_exited(lc):
    # the producer sends to this process (the sole reader) and exits; a second reader
    # takes the arrays: it opens their memory through this process's kept fds
    ctx = smp.get_context("spawn")
    q, took, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    n = 50
    p = ctx.Process(target=put_after_first, args=(q, took, n))
    p.start()
    assert q.get(timeout=JOIN)[0] == 0
    took.set()
    join_all(p)
    assert p.exitcode == 0
    r = ctx.Process(target=take_all, args=(q, n, out))
    r.start()
    pid, got = out.get(timeout=JOIN)
    join_all(r)
    assert r.exitcode == 0
    assert got == list(range(1, n + 1))
    out.close()


def test_a_reader_after_a_killed_sole_reader_gets_arrays_through_their_writer(lc):
    # The sole reader took this process's first arrays (keeping the slab's memfd), more
    # went without fds, and the reader was killed: the next reader opens their memory
    # through their writer (this process).
    ctx = smp.get_context("fork")
    q, took_one, took_two, stop = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event()
    r = ctx.Process(target=take_two_and_wait, args=(q, took_one, took_two, stop))
    r.start()
    q.put(shmtensor.full((64,), 0, dtype=np.int64))  # the reader joins as it takes this
    assert took_one.wait(JOIN)
    q.put(shmtensor.full((64,), 1, dtype=np.int64))  # announces the slab; kept by r
    assert took_two.wait(JOIN)
    for i in range(2, 6):
        q.put(shmtensor.full((64,), i, dtype=np.int64))
    os.kill(r.pid, signal.SIGKILL)
    join_all(r)
    assert r.exitcode == -signal.SIGKILL
    out = ctx.Queue()
    r2 = ctx.Process(target=take_all, args=(q, 4, out))
    r2.start()
    _, got = out.get(timeout=JOIN)
    join_all(r2)
    assert r2.exitcode == 0
    assert got == [2, 3, 4, 5]
    q.close()
    out.close()


def _lot_is_cleaned(q) -> None:
    """The lot is empty and its hint cleared once its reader idles on the empty queue
    (with ``_LOT_SECONDS`` 0), and stays so as records come."""
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    assert q._chan.ring.user[_channel._PARKED] == 0
    with pytest.raises(BlockingIOError):
        q._chan._side_w.recvmsg(1, 0, socket.MSG_DONTWAIT)
    q.put("after")
    assert q.get(timeout=JOIN) == "after"
    assert q._chan.ring.user[_channel._PARKED] == 0
    with pytest.raises(BlockingIOError):
        q._chan._side_w.recvmsg(1, 0, socket.MSG_DONTWAIT)


def _values(arrays) -> list:
    return [int(a[0]) if (a == a[0]).all() else ("corrupt", int(a[0])) for a in arrays]


def _six_written(ctx, q):
    """Start a sole reader that takes two arrays and waits (until ``stop``), and a writer
    of six that waits (to be killed) once all are in the ring: (reader, writer, stop)."""
    took_one, took_two, stop, written, hold = (ctx.Event(), ctx.Event(), ctx.Event(),
                                               ctx.Event(), ctx.Event())
    r = ctx.Process(target=take_two_and_wait, args=(q, took_one, took_two, stop))
    w = ctx.Process(target=put_six_and_wait, args=(q, took_one, took_two, written, hold))
    r.start()
    w.start()
    assert written.wait(JOIN)
    return r, w, stop


def _writer_gone_then_reader_killed(ctx, q, reader=take_two_and_wait, writer=put_six):
    """Start a sole reader that takes two arrays and waits, and their writer of six; once
    the writer exited, kill the reader."""
    took_one, took_two, stop = ctx.Event(), ctx.Event(), ctx.Event()
    r = ctx.Process(target=reader, args=(q, took_one, took_two, stop))
    w = ctx.Process(target=writer, args=(q, took_one, took_two))
    r.start()
    w.start()
    join_all(w)
    assert w.exitcode == 0
    os.kill(r.pid, signal.SIGKILL)
    join_all(r)
    assert r.exitcode == -signal.SIGKILL


def test_a_writer_that_closed_and_exited_parks_its_files_for_the_next_reader(lc, monkeypatch):
    # The writer sent to this queue's sole reader without fds and exited (its feeder
    # parked the files its records need as it closed); the reader was killed before it
    # took them: the next reader finds them in the lot.
    monkeypatch.setattr(_channel, "_LOT_SECONDS", 0.0)
    ctx = smp.get_context("fork")
    q = ctx.Queue()
    _writer_gone_then_reader_killed(ctx, q)
    assert q._chan.ring.user[_channel._PARKED] > 0
    assert _values([q.get(timeout=JOIN) for _ in range(4)]) == [2, 3, 4, 5]
    _lot_is_cleaned(q)
    q.close()


def test_a_simple_queue_writer_that_exits_without_closing_parks_at_exit(lc, monkeypatch):
    monkeypatch.setattr(_channel, "_LOT_SECONDS", 0.0)
    ctx = smp.get_context("spawn")
    q = ctx.SimpleQueue()
    _writer_gone_then_reader_killed(ctx, q, take_two_simple_and_wait, put_six_simple)
    assert _values([q.get() for _ in range(4)]) == [2, 3, 4, 5]
    q.put("after")
    assert q.get() == "after"
    assert q._chan.ring.user[_channel._PARKED] == 0
    q.close()


def test_a_reader_that_exits_with_records_unread_parks_what_it_kept(lc, monkeypatch):
    # The writer was killed after its records were written; their sole reader exits
    # normally without taking them: it parks the memfds it kept (and its lease files),
    # and the next reader gets them.
    monkeypatch.setattr(_channel, "_LOT_SECONDS", 0.0)
    ctx = smp.get_context("fork")
    q = ctx.Queue()
    r, w, stop = _six_written(ctx, q)
    os.kill(w.pid, signal.SIGKILL)
    join_all(w)
    stop.set()
    join_all(r)
    assert r.exitcode == 0
    assert _values([q.get(timeout=JOIN) for _ in range(4)]) == [2, 3, 4, 5]
    _lot_is_cleaned(q)
    q.close()


def test_a_sole_reader_that_exits_makes_writers_send_with_fds_again(lc):
    # The sole reader took two arrays (the slab announced, kept) and exited with nothing
    # unread: it left the reader word vacant, so the writer's later arrays went with
    # their fds, and survive the writer's SIGKILL.
    ctx = smp.get_context("fork")
    q, took_one, took_two, stop, written, gone = (ctx.Queue(), ctx.Event(), ctx.Event(),
                                                  ctx.Event(), ctx.Event(), ctx.Event())
    r = ctx.Process(target=take_two_then, args=(q, took_one, took_two))
    w = ctx.Process(target=put_six_and_wait,
                    args=(q, took_one, took_two, written, stop, gone))
    r.start()
    w.start()
    join_all(r)
    assert r.exitcode == 0
    word = q._chan.ring.user[_channel._READER]
    assert word & _channel._VACANT == _channel._VACANT and not word & _channel._PID
    gone.set()
    assert written.wait(JOIN)
    os.kill(w.pid, signal.SIGKILL)
    join_all(w)
    assert _values([q.get(timeout=JOIN) for _ in range(4)]) == [2, 3, 4, 5]
    q.close()


def _lot_inodes(q) -> list[int]:
    """The inodes of the files in the queue's lot (taken out of it)."""
    got = []
    while True:
        try:
            msg = q._chan._side_w.recvmsg(_channel._PARK_MAX, socket.CMSG_SPACE(253 * 4),
                                          socket.MSG_DONTWAIT)
        except BlockingIOError:
            return got
        fds = scm_rights._collect((msg,))[0]
        got += [os.fstat(fd).st_ino for fd in fds]
        scm_rights.close_fds(fds)


def test_a_sole_reader_that_lets_go_during_a_write_parks_all_it_kept(lc):
    # A writer holds the writers' lock (in the middle of a put, under the old reader
    # word) as the sole reader exits: that write may name any file the reader kept, so
    # it parks them all, with nothing unread yet.
    ctx = smp.get_context("fork")
    q, took_one, took_two, stop, held, release = (ctx.Queue(), ctx.Event(), ctx.Event(),
                                                  ctx.Event(), ctx.Event(), ctx.Event())
    r = ctx.Process(target=take_two_then, args=(q, took_one, took_two, stop, False))
    r.start()
    sent = [shmtensor.full((64,), i, dtype=np.int64) for i in range(2)]
    q.put(sent[0])
    assert took_one.wait(JOIN)
    q.put(sent[1])  # announces the slab: r keeps its memfd
    assert took_two.wait(JOIN)
    from shmtensor import _segments
    slab = os.fstat(_segments.segment_of(sent[1]).fd).st_ino
    lock = ctx.Process(target=hold_writers_lock, args=(q, held, release))
    lock.start()
    try:
        assert held.wait(JOIN)
        stop.set()
        join_all(r)
    finally:
        release.set()
        join_all(lock)
    assert r.exitcode == 0 and lock.exitcode == 0
    assert q._chan.ring.user[_channel._READER] & _channel._VACANT == _channel._VACANT
    assert slab in _lot_inodes(q)
    q.close()


def test_a_sole_reader_that_closed_its_reading_end_still_leaves_the_word_vacant(lc):
    ctx = smp.get_context("fork")
    q, took_one, took_two, stop = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event()
    r = ctx.Process(target=take_two_then, args=(q, took_one, took_two, stop, True))
    r.start()
    q.put(shmtensor.full((64,), 0, dtype=np.int64))
    assert took_one.wait(JOIN)
    q.put(shmtensor.full((64,), 1, dtype=np.int64))
    assert took_two.wait(JOIN)
    assert q._chan.ring.user[_channel._READER] & _channel._PID == r.pid
    stop.set()
    join_all(r)
    assert r.exitcode == 0
    word = q._chan.ring.user[_channel._READER]
    assert word & _channel._VACANT == _channel._VACANT and not word & _channel._PID
    q.close()


def test_the_lot_holds_no_more_fds_than_its_cap(lc, monkeypatch):
    # each fd in flight counts against its sender's user's fd limit: past the cap a
    # process parks nothing (and the records of a writer and a reader both gone are lost)
    monkeypatch.setattr(_channel, "_lot_max", lambda: 1)
    ctx = smp.get_context("fork")
    q = ctx.Queue()
    _writer_gone_then_reader_killed(ctx, q)
    assert q._chan.ring.user[_channel._PARKED] == 0
    for _ in range(4):
        with pytest.raises(OSError, match="neither its writer"):
            q.get(timeout=JOIN)
    q.close()


def test_a_pass_through_the_lot_takes_only_what_its_fds_allow(lc):
    # A reader short of fds takes no datagram whose fds it could not all take (the
    # kernel would drop them): what it leaves stays parked for a later pass.
    import resource
    ctx = smp.get_context("fork")
    q = ctx.Queue()
    chan = q._chan
    inos = []
    for _ in range(3):
        files = [os.memfd_create("lot") for _ in range(100)]
        try:
            part = [os.fstat(fd).st_ino for fd in files]
            inos += part
            data = _channel._PARK_HEAD.pack(1000, 100) + struct.pack("=100Q", *part)
            assert _channel._to_lot(chan._side_r, data, files) == 1
        finally:
            for fd in files:
                os.close(fd)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    opened: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (len(_fds()) + _channel._FD_MARGIN + 150, hard))
    try:
        assert not chan._through_lot(0, inos[250], opened)  # in the third: not taken
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert chan._through_lot(0, inos[250], opened)  # with fds to spare
    os.close(opened.pop())
    got = []
    while True:
        try:
            msg = chan._side_w.recvmsg(_channel._PARK_MAX, socket.CMSG_SPACE(253 * 4),
                                       socket.MSG_DONTWAIT)
        except BlockingIOError:
            break
        fds = scm_rights._collect((msg,))[0]
        got += [os.fstat(fd).st_ino for fd in fds]
        scm_rights.close_fds(fds)
    assert sorted(got) == sorted(inos)  # nothing lost on the way
    q.close()


def test_arrays_whose_writer_and_reader_were_both_killed_are_lost_with_an_error(lc):
    # Nobody parked their files: each is lost with an error that names both processes,
    # and the queue goes on.
    ctx = smp.get_context("fork")
    q = ctx.Queue()
    r, w, stop = _six_written(ctx, q)
    for p in (w, r):
        os.kill(p.pid, signal.SIGKILL)
        join_all(p)
    for _ in range(4):
        with pytest.raises(OSError, match=f"neither its writer \\(process {w.pid}\\) nor "
                                          f"the reader it was sent to \\(process {r.pid}\\)"):
            q.get(timeout=JOIN)
    q.put("after")
    assert q.get(timeout=JOIN) == "after"
    q.close()


def test_the_lot_merges_what_it_parks_again_and_keeps_one_file_per_inode(lc):
    # the socket queues few datagrams (net.unix.max_dgram_qlen, 10 by default): a reader
    # going through the lot parks its files again in as few as they fit, the latest tail
    ctx = smp.get_context("fork")
    q = ctx.Queue()
    chan = q._chan
    files = [os.memfd_create("lot") for _ in range(6)]
    try:
        inos = [os.fstat(fd).st_ino for fd in files]
        for k, (fd, ino) in enumerate(zip(files, inos)):
            for _ in range(2 if k == 0 else 1):  # the first file parked twice
                data = _channel._PARK_HEAD.pack(100 + k, 1) + struct.pack("=Q", ino)
                assert _channel._to_lot(chan._side_r, data, [fd]) == 1
    finally:
        for fd in files:
            os.close(fd)
    fds = _fds()
    opened: list[int] = []
    assert chan._through_lot(99, inos[3], opened) == 1  # found, the rest parked again
    assert len(opened) == 1 and os.fstat(opened[0]).st_ino == inos[3]
    os.close(opened[0])
    assert chan._through_lot(99, 0, []) == 1  # one datagram left in the lot
    msg = chan._side_w.recvmsg(_channel._PARK_MAX, socket.CMSG_SPACE(64 * 4),
                               socket.MSG_DONTWAIT)
    got = scm_rights._collect((msg,))[0]
    try:
        tail, n = _channel._PARK_HEAD.unpack_from(msg[0])
        assert (tail, n) == (105, 6)
        assert sorted(struct.unpack_from("=6Q", msg[0], _channel._PARK_HEAD.size)) \
            == sorted(inos)
        assert sorted(os.fstat(fd).st_ino for fd in got) == sorted(inos)
    finally:
        scm_rights.close_fds(got)
    assert _fds() <= fds
    q.close()


def test_the_lot_ignores_what_is_not_a_parking_datagram(lc):
    # A peer parks junk: too short, a count its fds do not match, a file under another
    # inode.  None of it is taken for a file, each fd is closed, and the record that
    # lacks its memory is lost with the error that says so.
    ctx = smp.get_context("fork")
    q = ctx.Queue()
    chan = q._chan
    r, w = os.pipe()
    try:
        tail = chan.ring.tail + 100
        for data, fds in ((b"x", [r]),
                          (_channel._PARK_HEAD.pack(tail, 2) + struct.pack("=2Q", 1, 2), [r]),
                          (_channel._PARK_HEAD.pack(tail, 1) + struct.pack("=Q", 1), [w])):
            assert _channel._to_lot(chan._side_r, data, fds) == 1
    finally:
        os.close(r)
        os.close(w)
    fds = _fds()
    from shmtensor._reductions import NUMPY_LANE
    from shmtensor._segments import FD
    head = _channel._HELD_HEAD.pack(os.getpid() + 1, 0, 1, 0, 1, 0)
    handle = pickle.dumps(("shmtensor_0_nobody_1", FD, 4096, "nobody", 1, 0, (4,), None,
                           "<f8", False))
    assert q._sem.acquire(False)
    chan.ring.put(_channel._HELD + head + NUMPY_LANE + handle)
    with pytest.raises(OSError, match="neither its writer"):
        q.get(timeout=JOIN)
    assert _fds() <= fds  # what came back from the lot was closed
    q.close()


def test_a_record_naming_memory_it_cannot_find_is_lost_once_with_an_error(lc):
    # a peer's record without fds that names files nobody has: an OSError that says so,
    # then the queue goes on
    ctx = smp.get_context("fork")
    q = ctx.Queue()
    from shmtensor._reductions import NUMPY_LANE
    from shmtensor._segments import FD
    head = _channel._HELD_HEAD.pack(os.getpid(), 0, 1, 0, 1, 0)
    handle = pickle.dumps(("shmtensor_0_nobody_1", FD, 4096, "nobody", 1, 0, (4,), None,
                           "<f8", False))
    for record in (_channel._HELD + head + NUMPY_LANE + handle, _channel._HELD + b"short"):
        assert q._sem.acquire(False)  # as a put takes its place in the queue
        q._chan.ring.put(record)
    q.put("after")
    with pytest.raises(OSError, match="neither its writer"):
        q.get(timeout=JOIN)
    with pytest.raises(OSError, match="malformed"):
        q.get(timeout=JOIN)
    assert q.get(timeout=JOIN) == "after"
    q.close()


@pytest.mark.parametrize("kind", ["H", "F"])
@pytest.mark.parametrize("where", ["past its end", "before it"])
def test_a_record_naming_a_view_its_memory_cannot_have_is_lost_once(lc, kind, where):
    # a peer's record naming this process's own slab (so it attaches) with a view past
    # its end or before its start (which numpy accepts): lost once with an OSError, then
    # the queue goes on; as a record without fds, or one sending the memory back
    from shmtensor import _segments
    from shmtensor._reductions import NUMPY_LANE
    q = smp.get_context("fork").Queue()
    a = shmtensor.full((256,), 5, dtype=np.int64)
    seg = _segments.segment_of(a)
    head = _channel._HELD_HEAD.pack(os.getpid(), 0, 1, 0, 1, 0)
    if kind == "F":
        head = (_channel._FWD_HEAD.pack(_channel._tag(seg.table_id), seg.slot) + head)
    handle = pickle.dumps((seg.key, seg.kind, seg.size, seg.table_id, seg.slot,
                           seg.size - 8 if where == "past its end" else -4096, (256,), None,
                           "<i8", False))
    assert q._sem.acquire(False)
    q._chan.ring.put(kind.encode() + head + NUMPY_LANE + handle)
    q.put("after")
    with pytest.raises(OSError, match="malformed"):
        q.get(timeout=JOIN)
    assert q.get(timeout=JOIN) == "after"
    assert (a == 5).all()
    del a
    q.close()


@pytest.mark.parametrize("limit", ["files", "bytes"])
def test_a_reader_that_keeps_too_much_starts_a_new_generation(lc, monkeypatch, counted,
                                                              limit):
    # four producers, a slab each, a reader that keeps two files (or 5 MiB of memory):
    # it starts new generations (its writers announce again), and keeps no more
    cap = 5 << 20
    if limit == "files":
        monkeypatch.setattr(_channel, "_keep_max", lambda: 2)
    else:
        monkeypatch.setattr(_channel, "_KEEP_BYTES", cap)
    ctx = smp.get_context("fork")
    q = ctx.Queue(64)
    n = 500
    ps = [ctx.Process(target=put_many, args=(q, n, k * 100_000)) for k in range(4)]
    for p in ps:
        p.start()
    seen: dict[int, list[int]] = {k: [] for k in range(4)}
    for _ in range(4 * n):
        a = q.get(timeout=JOIN)
        assert (a == a[0]).all()
        seen[int(a[0]) // 100_000].append(int(a[0]) % 100_000)
        if limit == "files":
            assert len(q._chan._keep) <= 2
        else:
            assert sum(o[2] for o in q._chan._origin.values()) <= cap
        del a
    join_all(*ps)
    assert all(p.exitcode == 0 for p in ps)
    assert all(v == list(range(n)) for v in seen.values())
    assert counted[0] > 0
    q.close()


def test_many_producers_reusing_their_slabs_never_corrupt_an_array(lc):
    # 256 KiB arrays: a few per slab, so each producer comes back to a slab while the
    # queue holds records naming it, which their sender's anchor holds until taken
    ctx = smp.get_context("fork")
    q = ctx.Queue(64)
    n = 400
    ps = [ctx.Process(target=put_many, args=(q, n, k * 100_000, 32768)) for k in range(3)]
    for p in ps:
        p.start()
    last = {k: -1 for k in range(3)}
    for _ in range(3 * n):
        a = q.get(timeout=JOIN)
        assert (a == a[0]).all(), "an array was overwritten while in flight"
        k, i = divmod(int(a[0]), 100_000)
        assert i == last[k] + 1
        last[k] = i
        del a
    join_all(*ps)
    assert all(p.exitcode == 0 for p in ps)
    q.close()


def test_a_busy_reader_lets_go_of_each_slab_as_its_writer_moves_on(lc):
    # the reader keeps a writer's last slab held while records wait (its next record then
    # costs no hold): that must not keep slabs the writer has moved on from, or a writer
    # that streams through its slabs would make new ones without end
    ctx = smp.get_context("fork")
    q, out = ctx.Queue(64), ctx.SimpleQueue()
    n = 3000
    p = ctx.Process(target=stream_and_count_slabs, args=(q, n, out))
    p.start()
    for i in range(n):
        a = q.get(timeout=JOIN)
        assert a[0] == i and a[-1] == i
        del a
        time.sleep(0.0002)  # slower than the writer: records always wait
    slabs = out.get()
    join_all(p)
    assert p.exitcode == 0
    assert slabs <= 6, f"the writer had {slabs} slabs at once for arrays that fit one"
    q.close()
    out.close()


def _two_queued_without_fds():
    """A queue this process reads alone, with two slab arrays (2 and 3) of a writer that
    has exited waiting in it as records without fds: (queue, the writer)."""
    ctx = smp.get_context("spawn")
    q, took = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=put_after_first, args=(q, took, 3))
    p.start()
    assert q.get(timeout=JOIN)[0] == 0
    took.set()
    assert q.get(timeout=JOIN)[0] == 1  # the announce
    join_all(p)
    return q, p


def test_an_exception_while_a_record_without_fds_is_loaded_leaves_it_for_the_next_get(
        lc, monkeypatch):
    # its memory is attached and held as it leaves the ring: an exception (a signal
    # handler's) while its array is made loses nothing
    from shmtensor import _numpy

    class Interrupt(Exception):
        pass
    real = _numpy._rebuild_array

    def interrupted(*args):
        monkeypatch.setattr(_numpy, "_rebuild_array", real)
        raise Interrupt
    q, p = _two_queued_without_fds()
    monkeypatch.setattr(_numpy, "_rebuild_array", interrupted)
    with pytest.raises(Interrupt):
        q.get(timeout=JOIN)
    assert [int(q.get(timeout=JOIN)[0]) for _ in range(2)] == [2, 3]
    assert p.exitcode == 0
    q.close()


def test_a_closed_channels_slabs_are_let_go_of_at_a_later_get(lc):
    # a writer closed its queue with records without fds unread: their anchors (and the
    # ring) wait until the records are taken, and a later get of the writer, on any
    # queue, lets go of them
    import gc
    ctx = smp.get_context("fork")
    q, back, took, go = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    r = ctx.Process(target=take_first_then_rest, args=(q, 5, took, go, back))
    r.start()
    q.put(shmtensor.full((64,), 0, dtype=np.int64))
    assert took.wait(JOIN)
    for i in range(1, 6):
        q.put(shmtensor.full((64,), i, dtype=np.int64))
    q.close()
    q.join_thread()
    del q
    gc.collect()
    assert _channel._lingering, "no anchors wait for their records"
    go.set()
    join_all(r)  # it took the records, put "done" and exited
    assert r.exitcode == 0
    assert _channel._lingering
    assert back.get(timeout=JOIN) == "done"  # a get, begun after the records were taken
    assert not _channel._lingering
    back.close()


def test_a_reader_keeps_no_slab_once_the_queue_is_drained_by_any_message(lc):
    # (review R) the slab a busy reader keeps held goes as the last waiting record is
    # taken, whatever it is: here a None after the arrays
    import gc
    from shmtensor import _segments
    ctx = smp.get_context("fork")
    q, took = ctx.Queue(64), ctx.Event()
    p = ctx.Process(target=three_then_none, args=(q, took))
    p.start()
    assert q.get(timeout=JOIN)[0] == 100
    took.set()
    join_all(p)  # all four records wait in the ring
    assert p.exitcode == 0
    got = [q.get(timeout=JOIN) for _ in range(4)]
    assert [None if g is None else int(g[0]) for g in got] == [0, 1, 2, None]
    del got
    gc.collect()
    shmtensor.empty_cache()
    assert not [s for s in _segments.mapped() if not s.own]
    q.close()


def _echoing(n: int, die: bool = False):
    """A spawned child that sends back the ``n`` arrays it is sent, after a first one it
    sent back already (so this process is the sole reader of the way back): (out, back,
    child)."""
    ctx = smp.get_context("spawn")
    out, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=echo, args=(out, back, n + 1, die))
    p.start()
    out.put(shmtensor.zeros(4))
    assert back.get(timeout=JOIN)[0] == 0
    return out, back, p


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_an_array_sent_back_to_its_maker_is_its_own_memory(lc, counted):
    # A received array comes back to its maker, the queue's sole reader, as the memory
    # it sent, in a record without fds (nothing of the sender holds it in flight: see the
    # next test).
    n = 200
    out, back, p = _echoing(n)
    fds = None
    took = counted[0]
    for i in range(n):
        a = shmtensor.full((256,), i, dtype=np.int64)
        out.put(a)
        b = back.get(timeout=JOIN)
        assert _address(b) == _address(a) and (b == i).all()
        fds = fds or _fds()
        del a, b
    assert _fds() == fds
    assert counted[0] - took == n
    join_all(p)
    assert p.exitcode == 0
    out.close()
    back.close()


def test_an_array_sent_back_by_a_process_killed_at_once_arrives_whole(lc):
    # The child sends the array back and is killed; its maker lets go of it and carves
    # and drops arrays enough to cycle through slabs before it takes the message: nothing
    # holds the memory but the record naming it, and its maker reuses no slab that a
    # record not yet taken names.
    out, back, p = _echoing(1, die=True)
    a = shmtensor.full((256,), 7, dtype=np.int64)
    out.put(a)
    join_all(p)
    assert p.exitcode == -signal.SIGKILL
    del a
    recycled = shmtensor.debug_info()["segments"]["recycled"]
    for _ in range(500):
        shmtensor.full(60_000, 1, dtype=np.uint8)
    assert shmtensor.debug_info()["segments"]["recycled"] > recycled  # slabs did cycle
    b = back.get(timeout=JOIN)
    assert (b == 7).all()
    del b
    back.put("after")
    assert back.get(timeout=JOIN) == "after"
    out.close()
    back.close()


def test_arrays_sent_back_to_their_maker_reach_a_second_reader_whole(lc):
    # The child sends three arrays back to their maker, the sole reader, and exits; the
    # maker lets go of them, cycles its slabs, and a second reader takes the records: it
    # holds the memory through the maker's fds (the writer is gone), which reused none.
    out, back, p = _echoing(3)
    for i in (1, 2, 3):
        out.put(shmtensor.full((256,), i, dtype=np.int64))
    join_all(p)
    assert p.exitcode == 0
    out.put(None)  # lets go of what this process kept of its records on ``out``
    recycled = shmtensor.debug_info()["segments"]["recycled"]
    kept = collections.deque(maxlen=40)  # more than a slab's worth: the full one stays held
    for _ in range(500):
        kept.append(shmtensor.full(60_000, 1, dtype=np.uint8))
    kept.clear()
    assert shmtensor.debug_info()["segments"]["recycled"] > recycled  # slabs did cycle
    ctx = smp.get_context("spawn")
    results = ctx.Queue()
    r = ctx.Process(target=take_and_report, args=(back, results, 3))
    r.start()
    assert [results.get(timeout=JOIN) for _ in range(3)] == [(1, True), (2, True), (3, True)]
    join_all(r)
    assert r.exitcode == 0
    out.close()
    back.close()
    results.close()


@pytest.mark.parametrize("kind", ["Queue", "SimpleQueue"])
def test_arrays_sent_back_after_their_maker_closed_its_queue_reach_another_reader(lc, kind):
    # The maker, sole reader of ``back``, closes and drops it; only then are its arrays
    # sent back.  It recycles its slabs, and a second reader takes them whole: the maker
    # no longer named itself reader, or looked at the records sent after it closed.
    ctx = smp.get_context("spawn")
    out, results, go, read = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    back = getattr(ctx, kind)()
    p = ctx.Process(target=echo_later, args=(out, back, go, 3))
    r = ctx.Process(target=take_and_report, args=(back, results, 3, read))
    p.start()
    r.start()
    assert results.get(timeout=JOIN) == "ready"  # r has its ends of ``back`` before it goes
    out.put(shmtensor.zeros(4))
    assert back.get()[0] == 0  # the sole reader of ``back``
    for i in (1, 2, 3):
        out.put(shmtensor.full((256,), i, dtype=np.int64))
    back.close()
    del back
    gc.collect()
    go.set()
    join_all(p)
    assert p.exitcode == 0
    out.put(None)  # lets go of what this process kept of its records on ``out``
    kept = collections.deque(maxlen=40)
    for _ in range(500):
        kept.append(shmtensor.full(60_000, 1, dtype=np.uint8))
    kept.clear()
    read.set()
    assert sorted(results.get(timeout=JOIN) for _ in range(3)) == [(1, True), (2, True),
                                                                   (3, True)]
    join_all(r)
    assert r.exitcode == 0
    out.close()
    results.close()


@pytest.mark.parametrize("reader", ["may come", "none"])
def test_a_closed_queue_keeps_what_waits_to_come_back_to_its_maker(lc, reader):
    # Arrays sent back wait in a queue their maker closes while no other process has it.
    # While a reading end is open anywhere (here an fd of it, as a child started with the
    # queue has one before it attaches the ring), the ring lingers and the memory is not
    # reused until the records are taken; with none, both go at once.
    from shmtensor import _segments
    from shmtensor.ipc import ofd_lease
    ctx = smp.get_context("spawn")
    out, back, go = ctx.Queue(), ctx.SimpleQueue(), ctx.Event()
    p = ctx.Process(target=echo_later, args=(out, back, go, 3))
    p.start()
    out.put(shmtensor.zeros(4))
    assert back.get()[0] == 0  # the sole reader of ``back``
    slots = set()
    for i in (1, 2, 3):
        a = shmtensor.full((256,), i, dtype=np.int64)
        slots.add(_segments.segment_of(a).slot)
        out.put(a)
        del a
    go.set()
    join_all(p)
    assert p.exitcode == 0
    out.put(None)  # lets go of what this process kept of its records on ``out``
    ring = back._chan.ring
    assert not ring.peers_alive()
    end = os.dup(back._side.fileno()) if reader == "may come" else -1
    back.close()
    _channel.sweep_all()
    table = ofd_lease.own_table()
    lingers = reader == "may come"
    assert any(r is ring for r, _ in _channel._lingering) == lingers
    shmtensor.empty_cache()
    assert all(_segments.held_anywhere(table, slot) == lingers for slot in slots)
    if lingers:
        while not ring.empty():  # as a reader would: then the ring and the memory go
            ring.get(False)
        os.close(end)
        _channel.sweep_all()
        assert not any(r is ring for r, _ in _channel._lingering)
        assert not any(_segments.held_anywhere(table, slot) for slot in slots)
    out.close()
    out.join_thread()


def test_arrays_sent_back_between_their_writers_own_all_arrive_after_it_exits(lc):
    # Taking an array sent back keeps its writer's last slab held as before (the memory
    # sent back is this process's own): the writer's next arrays, sent without fds before
    # it exited, still find its lease file here, even with idle memory given back
    # between gets.
    ctx = smp.get_context("spawn")
    out, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=echo_and_own, args=(out, back, 20))
    p.start()
    out.put(shmtensor.zeros(4))
    assert back.get(timeout=JOIN)[0] == 0  # the sole reader of ``back``
    for i in range(20):
        out.put(shmtensor.full((256,), i + 1, dtype=np.int64))
    join_all(p)
    assert p.exitcode == 0
    out.put(None)
    got = []
    for _ in range(40):
        a = back.get(timeout=JOIN)
        assert (a == a[0]).all()
        got.append(int(a[0]))
        del a
        shmtensor.empty_cache()
    assert sorted(got) == sorted([*range(1, 21), *range(-20, 0)])
    out.close()
    back.close()


def test_arrays_over_a_slab_item_go_back_to_their_maker_with_fds(lc, counted):
    out, back, p = _echoing(3)
    took = counted[0]
    for i in range(3):
        out.put(shmtensor.full((1 << 18,), i, dtype=np.int64))  # 2 MiB
        assert (back.get(timeout=JOIN) == i).all()
    assert counted[0] == took
    join_all(p)
    assert p.exitcode == 0
    out.close()
    back.close()


def test_a_one_slot_batch_pool_goes_to_an_echo_and_back_again_and_again(lc):
    # Nothing of the echo keeps the slot once it sent it back: the maker acquires it again.
    out, back, p = _echoing(50)
    with shmtensor.BatchPool((64,), np.int64, slots=1) as pool:
        for i in range(50):
            a = pool.acquire(timeout=JOIN)
            a[...] = i
            out.put(a)
            del a
            b = back.get(timeout=JOIN)
            assert (b == i).all()
            del b
    join_all(p)
    assert p.exitcode == 0
    out.close()
    back.close()


def _fds_of(ino: int) -> int:
    """How many fds of the file of inode ``ino`` this process has."""
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            n += os.stat(f"/proc/self/fd/{name}").st_ino == ino
        except OSError:
            pass
    return n


def test_a_kept_slab_fd_goes_once_its_writer_destroyed_the_slab(lc, counted, monkeypatch):
    # The reader keeps a slab's memfd while the writer has it; once the writer destroyed
    # the slab, a reader that drains the queue lets go of it (the next sweep), so that
    # only its receive cache's mapping (and the fd that keeps) remain, until evicted.
    from shmtensor import _segments
    monkeypatch.setattr(_channel, "_SWEEP_SECONDS", 0.0)
    n, nbytes = 50, 1024
    ctx = smp.get_context("spawn")
    q, took, freed = ctx.Queue(), ctx.Event(), ctx.Event()
    q.put("join")  # this process becomes the sole reader first
    assert q.get(timeout=JOIN) == "join"
    p = ctx.Process(target=put_and_free, args=(q, n, nbytes, took, freed))
    p.start()
    got = [q.get(timeout=JOIN) for _ in range(n)]
    assert all(a.nbytes == nbytes and (a == 5).all() for a in got)
    assert counted[0] == n - 1  # all but the announce
    seg = _segments.segment_of(got[0])
    ino = os.fstat(seg.fd).st_ino
    assert _fds_of(ino) == 2  # the queue's, and the receive cache's
    del got, seg
    # a writer whose fds this process may not look at (it made itself undumpable, this
    # process not root) may have it still: kept
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        if str(path).startswith(f"/proc/{p.pid}/"):
            raise PermissionError(13, "denied", path)
        return real_stat(path, *args, **kwargs)
    monkeypatch.setattr(os, "stat", stat)
    took.set()
    assert q.get(timeout=JOIN) == "x"
    assert freed.wait(JOIN)
    for word in ("sweep", "a", "b"):
        q.put(word)
        assert q.get(timeout=JOIN) == word
    assert _fds_of(ino) == 2
    monkeypatch.setattr(os, "stat", real_stat)
    # a get that drains the queue sweeps: the writer's fd is gone; the kept one closes
    # once head passes every record that may name it
    for word in ("sweep", "a", "b"):
        q.put(word)
        assert q.get(timeout=JOIN) == word
    assert _fds_of(ino) == 1
    shmtensor.empty_cache()
    assert _fds_of(ino) == 0
    join_all(p)
    assert p.exitcode == 0
    q.close()


def test_a_kept_slab_fd_whose_writer_exited_before_its_announce_was_taken_goes(
        lc, monkeypatch):
    # its writer's fds cannot be looked at any more as the announce is taken: it is let
    # go of at the next sweep, not kept until the queue closes
    from shmtensor import _segments
    monkeypatch.setattr(_channel, "_SWEEP_SECONDS", 0.0)
    n = 20
    q, p, first = _sole_reader_of(n)
    join_all(p)  # gone before its announce is taken
    assert p.exitcode == 0
    got = [q.get(timeout=JOIN) for _ in range(n)]
    assert [int(a[0]) for a in got] == list(range(1, n + 1))
    ino = os.fstat(_segments.segment_of(got[0]).fd).st_ino
    assert _fds_of(ino) == 2  # the queue's, and the receive cache's
    del got, first
    # the drained queue's sweep let go of it; a get that finds the queue empty closes
    # it (no record can name it any more)
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    assert _fds_of(ino) == 1
    shmtensor.empty_cache()
    assert _fds_of(ino) == 0
    q.close()


_spawn = smp.get_context("spawn")


def _own_stream(target, *args):
    """A spawned ``target(q, *args)`` whose queue this process reads alone from the start."""
    q = _spawn.Queue()
    q.put("join")  # this process becomes the sole reader first
    assert q.get(timeout=JOIN) == "join"
    p = _spawn.Process(target=target, args=(q, *args))
    p.start()
    return q, p


def _take_and_ack(q, ack, n):
    got = []
    for _ in range(n):
        got.append(q.get(timeout=JOIN))
        ack.put(len(got))
    return got


@pytest.mark.parametrize("short", [None, "memory", "fds"])
def test_a_segment_of_its_own_sent_again_goes_without_fds(lc, counted, monkeypatch, short):
    # the first message of it goes with fds (most arrays are sent once), the second
    # announces it, the rest (once the reader took that) name it, the producer exiting
    # right after its last put.  Not with a writer under a cgroup with less than half
    # its limit free, or a reader with half its fd limit open (a new generation each
    # time it is announced): every message comes with fds, and arrives whole.
    if short == "fds":
        monkeypatch.setattr(_channel, "_fds_short", lambda: True)
    n = 12
    ack = _spawn.SimpleQueue()
    q, p = _own_stream(put_again, n, ack, 64 << 20 if short == "memory" else None)
    got = _take_and_ack(q, ack, n)
    assert all(a.nbytes == OWN and (a == 7).all() for a in got)
    assert counted[0] == (0 if short else n - 2)
    assert not short or not q._chan._keep
    join_all(p)
    assert p.exitcode == 0
    del got
    q.close()
    ack.close()


def test_a_writer_ahead_of_its_reader_sends_its_segment_with_fds(lc, counted):
    # until its reader took the announce: a reader may refuse to keep a segment (a
    # limit reached), and a record that named it meanwhile would be lost with its
    # writer gone, as this one is before the reader starts
    n = 40
    q, p = _own_stream(put_again, n)
    join_all(p)
    assert p.exitcode == 0
    got = [q.get(timeout=JOIN) for _ in range(n)]
    assert all(a.nbytes == OWN and (a == 7).all() for a in got)
    assert counted[0] == 0
    assert not q._chan._keep  # its writer is gone: the drained queue's sweep let go
    del got
    q.close()


def test_segments_of_their_own_sent_once_are_never_kept(lc, counted):
    n = 12
    q, p = _own_stream(put_fresh, n)
    got = [q.get(timeout=JOIN) for _ in range(n)]
    assert [int(a[0]) for a in got] == list(range(n))
    assert counted[0] == 0 and not q._chan._keep
    assert q.get(timeout=JOIN)["created"] == n
    join_all(p)
    assert p.exitcode == 0
    del got
    q.close()


def test_a_writer_reuses_the_segment_its_reader_let_go_of_since_its_last_put(lc, counted):
    # the anchor a record without fds keeps until its reader took it is let go of before
    # the next array is made, not only at the next put: one segment serves them all
    n = 12
    ack = _spawn.SimpleQueue()
    q, p = _own_stream(put_fresh, n, ack)
    for i in range(n):
        a = q.get(timeout=JOIN)
        assert int(a[0]) == i and (a == i).all()
        del a
        ack.put(i)
    assert counted[0] == n - 2
    assert q.get(timeout=JOIN)["created"] == 1
    join_all(p)
    assert p.exitcode == 0
    q.close()
    ack.close()


def _kept_own_stream(n: int = 5):
    """A writer's segment of its own sent ``n`` times to this process, which keeps its
    memfd and let go of the arrays: (queue, writer, the memfd's inode, and the writer's
    ``took``, ``done`` and ``out`` of ``put_again_then_free``)."""
    from shmtensor import _segments
    took, done, out = _spawn.Event(), _spawn.Event(), _spawn.Queue()
    q, p = _own_stream(put_again_then_free, n, took, done, out)
    got = [q.get(timeout=JOIN) for _ in range(n)]
    assert all((a == 7).all() for a in got)
    ino = os.fstat(_segments.segment_of(got[0]).fd).st_ino
    assert list(q._chan._keep) == [ino]
    return q, p, ino, took, done, out


def test_a_reader_waiting_on_an_empty_queue_lets_go_of_what_its_writer_gave_back(
        lc, monkeypatch):
    # the writer lets go of the last record's anchor as it gives back idle memory (not
    # at its next put only), and a get that waits on the drained queue sweeps, closing
    # the kept memfd at once: nothing pins the memory while the queue stays empty
    monkeypatch.setattr(_channel, "_SWEEP_SECONDS", 0.0)
    q, p, ino, took, done, out = _kept_own_stream()
    took.set()
    assert out.get(timeout=JOIN) >= OWN
    with pytest.raises(queue.Empty):
        q.get(timeout=0.2)
    assert not q._chan._keep and not q._chan._old
    shmtensor.empty_cache()
    assert _fds_of(ino) == 0
    done.set()
    join_all(p)
    assert p.exitcode == 0
    q.close()
    out.close()


@pytest.mark.parametrize("fork", [False, True], ids=["plain", "forked"])
def test_a_reader_that_stops_calling_get_lets_go_of_what_its_writer_gave_back(
        lc, monkeypatch, fork):
    # no get after the last array: the sweeper thread's pass closes the kept memfd (its
    # writer closed its own), so the memory is not pinned until a next receive that may
    # never come; a get that does not block still gets what waits meanwhile
    from shmtensor import _segments
    monkeypatch.setattr(_channel, "_SWEEP_SECONDS", 0.0)
    monkeypatch.setattr(_segments, "SWEEP_SECONDS", 0.05)
    q, p, ino, took, done, out = _kept_own_stream()
    shmtensor.empty_cache()  # the receive cache's mapping (and its fd) goes
    time.sleep(0.3)
    assert list(q._chan._keep) == [ino]  # kept while the writer has it
    if fork:
        # a forked child lets go of what the parent keeps at once, and the parent's
        # sweeper, stopped for the fork, starts again though nothing is mapped here
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(w, f"{len(q._chan._keep)} {_fds_of(ino)}".encode())
            os._exit(0)
        os.close(w)
        assert os.read(r, 100).decode() == "0 0"
        os.close(r)
        assert os.waitpid(pid, 0)[1] == 0
        assert list(q._chan._keep) == [ino]
    took.set()
    assert out.get(timeout=JOIN) >= OWN
    deadline = time.monotonic() + JOIN
    while _fds_of(ino) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _fds_of(ino) == 0
    assert not q._chan._keep and not q._chan._old
    q.put("next")
    deadline = time.monotonic() + JOIN
    while q.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert q.get(False) == "next"
    done.set()
    join_all(p)
    assert p.exitcode == 0
    q.close()
    out.close()


@pytest.mark.parametrize("args", [(False,), (True, 0)], ids=["nowait", "timeout0"])
def test_a_get_that_does_not_wait_waits_out_a_sweep_of_the_queue_only(lc, args):
    # the sweeper thread takes the queue's turn for a pass (Channel.sweep_idle): a get
    # that does not wait still gets what waits meanwhile, instead of raising Empty; while
    # another thread of the program has the turn, it raises Empty at once, as the
    # stdlib's does
    import threading
    q = _spawn.Queue()
    q.put("x")
    deadline = time.monotonic() + JOIN
    while q.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    chan, taken, go = q._chan, threading.Event(), threading.Event()

    def hold(sweeper):
        if sweeper:
            chan.sweeps += 1
            chan.sweeping = True
        with chan.turn:
            taken.set()
            go.wait(JOIN) if not sweeper else time.sleep(0.005)
        chan.sweeping = False
    t = threading.Thread(target=hold, args=(False,))
    t.start()
    assert taken.wait(JOIN)
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get(*args)
    assert time.monotonic() - t0 < 0.05
    go.set()
    t.join(JOIN)
    taken.clear()
    t = threading.Thread(target=hold, args=(True,))
    t.start()
    assert taken.wait(JOIN)
    assert q.get(*args) == "x"
    t.join(JOIN)
    q.close()


_FORK_KEEPS_HOLDS = """
import os, sys, time, types
sys.modules["cupy"] = types.ModuleType("cupy")  # as CuPy imported first: the CUDA adapter,
import numpy as np                              # and so the channel, load during our init
import shmtensor, shmtensor.multiprocessing as smp
from shmtensor import _segments
from shmtensor.ipc import ofd_lease
sys.path.insert(0, sys.argv[1])
from handle_helpers import put_many

if __name__ == "__main__":
    ctx = smp.get_context("spawn")
    q = ctx.Queue()
    q.put("join"); assert q.get(timeout=60) == "join"
    p = ctx.Process(target=put_many, args=(q, 40, 0))
    p.start()
    deadline = time.monotonic() + 60
    while q.qsize() < 40 and time.monotonic() < deadline:
        time.sleep(0.01)
    a = q.get(timeout=60)
    seg = _segments.segment_of(a)
    table, slot = seg.table_id, seg.slot
    del a, seg
    p.join(60)  # the writer exits: its anchors of the records still queued go with it
    assert q._chan._hot  # the slab is held only by the channel's hot anchor now
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    h = ofd_lease._holdings[table]
    probe = os.open(f"/proc/self/fd/{h.fds[slot % ofd_lease.SHARDS]}", os.O_RDWR)
    print("held" if ofd_lease.probe_held(probe, slot) else "LOST")
    os.close(probe)
    rest = [q.get(timeout=60) for _ in range(39)]
    print(sorted(int(a[0]) for a in rest) == list(range(1, 40)))
    del rest
    q.close(); q.join_thread()
"""


def test_a_fork_keeps_the_parents_holds_of_slabs_its_queues_keep_hot(tmp_path):
    # a forked child lets go of the memfds its parent's queues kept, but not of their
    # anchors, whose release would go through the lease description it shares with the
    # parent before it has its own, dropping the parent's hold on a slab
    import subprocess
    import sys
    (tmp_path / "prog.py").write_text(_FORK_KEEPS_HOLDS)
    r = subprocess.run([sys.executable, str(tmp_path / "prog.py"), os.path.dirname(__file__)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["held", "True"], (r.stdout, r.stderr)


def test_a_timed_get_waits_no_longer_for_passes_that_found_the_turn_taken(lc):
    # a sweeper pass that cannot take the turn (another thread receives) leaves no mark:
    # a timed get that waited out its timeout for that thread raises Empty on time
    import threading
    q = _spawn.Queue()
    chan, taken, go, stop = q._chan, threading.Event(), threading.Event(), threading.Event()

    def hold():
        with chan.turn:
            taken.set()
            go.wait(JOIN)

    def passes():
        while not stop.is_set():
            chan.sweep_idle()
            time.sleep(0.001)
    threads = [threading.Thread(target=hold), threading.Thread(target=passes)]
    threads[0].start()
    assert taken.wait(JOIN)
    threads[1].start()
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.2)
    assert time.monotonic() - t0 < 0.28
    stop.set()
    go.set()
    for t in threads:
        t.join(JOIN)
    q.close()


def test_an_adapter_error_attaching_a_record_without_fds_loses_it_once(lc, monkeypatch):
    # any error an adapter raises as the get hook attaches (CuPy that no longer imports,
    # say) loses that message with an OSError; the record leaves the ring, and the queue
    # goes on
    from shmtensor import _reductions
    real = _reductions._held_pair

    def broken(data):
        monkeypatch.setattr(_reductions, "_held_pair", real)

        def attach(*args):
            raise ImportError("no module named 'cupy'")
        return attach, real(data)[1]
    q, p = _two_queued_without_fds()
    monkeypatch.setattr(_reductions, "_held_pair", broken)
    with pytest.raises(OSError, match="was lost.*cupy"):
        q.get(timeout=JOIN)
    assert int(q.get(timeout=JOIN)[0]) == 3
    assert p.exitcode == 0
    q.close()


def test_what_a_process_keeps_over_all_its_queues_is_bounded(lc, monkeypatch):
    # three queues, a slab writer each, a process that may keep two files in all: each
    # queue goes on (a new generation where keeping would pass the bound), and never is
    # more kept than that, generations still open included
    monkeypatch.setattr(_channel, "_keep_max", lambda: 2)
    ctx = smp.get_context("fork")
    qs = [ctx.Queue(16) for _ in range(3)]
    for q in qs:
        q.put("join")
        assert q.get(timeout=JOIN) == "join"
    n = 200
    ps = [ctx.Process(target=put_many, args=(q, n, k * 100_000)) for k, q in enumerate(qs)]
    for p in ps:
        p.start()
    for i in range(n):
        for k, q in enumerate(qs):
            a = q.get(timeout=JOIN)
            assert int(a[0]) == k * 100_000 + i and (a == a[0]).all()
            del a
            assert _channel._kept_files() <= 2
    join_all(*ps)
    assert all(p.exitcode == 0 for p in ps)
    for q in qs:
        q.close()


def test_a_segment_of_its_own_is_named_only_once_its_announce_was_taken(lc):
    # checked under the writers' lock too: another thread of the writer may have just
    # written the announce that the check before the lock did not see
    q = _spawn.Queue()
    ch = q._chan
    w, seg, shard = cast_word(ch), 101, 102
    ch._announced.update({seg: w, shard: w})
    ch._announced_at[seg] = ch.ring.head  # written, not taken yet
    with pytest.raises(_channel._Unknown):
        ch._named(w, seg, shard, OWN, object(), True, None)(ch.ring.head)
    ch._named(w, seg, shard, 0, object(), True, None)(ch.ring.head)  # a slab's: no wait
    ch._announced_at[seg] = ch.ring.head - 1  # taken
    ch._named(w, seg, shard, OWN, object(), True, None)(ch.ring.head)
    assert len(ch._pending) == 2
    ch._pending.clear()
    q.close()


def cast_word(ch) -> int:
    return int(ch.ring.user[_channel._READER])


def test_a_kept_memfd_whose_writer_could_not_be_looked_at_goes_with_the_writer(
        lc, counted, monkeypatch):
    # a writer whose fd the announce's reader could not see (another pid namespace, or
    # closed already) is not looked at; its memfd is let go of once that writer has let
    # go of the ring
    from shmtensor import _segments
    monkeypatch.setattr(_channel, "_SWEEP_SECONDS", 0.0)
    n = 3
    ack = _spawn.SimpleQueue()
    q, p = _own_stream(put_again, n, ack)
    got = _take_and_ack(q, ack, n)
    assert counted[0] == 1
    ino = os.fstat(_segments.segment_of(got[0]).fd).st_ino
    origin = q._chan._origin
    origin[ino] = (0,) + origin[ino][1:]  # as if its writer's fd could not be seen
    del got
    join_all(p)
    assert p.exitcode == 0
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    assert not q._chan._keep
    shmtensor.empty_cache()
    assert _fds_of(ino) == 0
    q.close()
    ack.close()


def test_a_view_is_checked_against_its_memory():
    from shmtensor._wire import check_view
    check_view(0, (4, 8), None, 8, 256)
    check_view(248, (4, 8), (-64, -8), 8, 256)  # reversed both ways, ending at 0
    check_view(256, (0,), None, 8, 256)
    for bad in [(-8, (4,), None), (8, (4, 8), None), (0, (4, 8), (-64, 8)), (0, (-1,), None),
                (0, (4,), (8, 8))]:
        with pytest.raises(ValueError, match="outside its memory"):
            check_view(*bad, 8, 256)
