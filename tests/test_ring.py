"""The ring of ``ipc/ring.py``: order and integrity, Full/Empty and timeouts, wake-ups,
sizes, process indices, and what SIGKILL at any point leaves (nothing acknowledged lost,
nothing duplicated or corrupt, nothing wedged).

Children are forked (``os.fork`` through ``multiprocessing``'s fork context): they
inherit the ring.  Every blocking call has a deadline; every child is joined and its exit
code checked; ``no_leaks`` checks this process's fds."""

from __future__ import annotations

import array
import errno
import importlib.util
import json
import mmap
import multiprocessing
import os
import queue
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib

import pytest

from shmtensor.ipc import ring as ringmod
from shmtensor.ipc.ring import Ring

pytestmark = pytest.mark.skipif(not ringmod.HAVE_RING, reason="needs memfd, OFD locks, futex")

ctx = multiprocessing.get_context("fork")
JOIN = 30  # seconds: only reached when something is wedged
_MSG = struct.Struct("III")  # writer id, sequence number, crc32 of the rest


def message(wid: int, seq: int, room: int) -> bytes:
    """A checkable message of a length (0 to ``room`` bytes of body) that varies."""
    n = (wid * 7919 + seq * 31) % (room - _MSG.size + 1)
    body = bytes((seq + i) & 0xFF for i in range(n)) if n < 64 else \
        (seq.to_bytes(4, "little") * (n // 4 + 1))[:n]
    return _MSG.pack(wid, seq, zlib.crc32(body)) + body


def check(data: bytes) -> tuple[int, int]:
    """(writer id, sequence number) of a message; AssertionError if it is corrupt."""
    wid, seq, crc = _MSG.unpack_from(data)
    assert zlib.crc32(data[_MSG.size:]) == crc, f"corrupt message {wid}/{seq}"
    return wid, seq


def join(procs, timeout=JOIN, codes=(0,)):
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    stuck = [p for p in procs if p.is_alive()]
    for p in stuck:
        p.kill()
        p.join(5)
    assert not stuck, f"{len(stuck)} children did not finish within {timeout}s"
    assert [p.exitcode for p in procs] == [c for p, c in zip(procs, codes * len(procs))]


def wait_for(cond, what, timeout=JOIN):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout}s"
        time.sleep(0.001)


def flag(ring: Ring, off: int) -> int:
    return ring._i[off // 4]


@pytest.fixture
def python_path(monkeypatch):
    """Every call through ring.py's Python code, with the C extension built or not: for
    tests that put exceptions into its steps (the C fast path has no steps to patch)."""
    monkeypatch.setattr(ringmod, "_cput", None)
    monkeypatch.setattr(ringmod, "_cget", None)


# -- order and integrity ----------------------------------------------------------------

def test_threads_on_both_ends(no_leaks):
    with Ring.create(8) as ring:
        writers, readers, each = 3, 3, 1500
        got: list[list[tuple[int, int]]] = [[] for _ in range(readers)]
        errors: list[BaseException] = []

        def write(wid):
            try:
                for seq in range(each):
                    ring.put(message(wid, seq, ring.payload_max), timeout=JOIN)
            except BaseException as e:
                errors.append(e)

        def read(r):
            try:
                while True:
                    data = ring.get(timeout=JOIN)
                    if not data:
                        return
                    got[r].append(check(data))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
        threads += [threading.Thread(target=read, args=(r,)) for r in range(readers)]
        for t in threads:
            t.start()
        for t in threads[:writers]:
            t.join(JOIN)
        for _ in range(readers):
            ring.put(b"", timeout=JOIN)
        for t in threads:
            t.join(JOIN)
        assert not any(t.is_alive() for t in threads) and not errors, errors
        for mine in got:  # each reader sees each writer's messages in order
            for wid in range(writers):
                seqs = [s for w, s in mine if w == wid]
                assert seqs == sorted(seqs)
        everything = sorted(m for mine in got for m in mine)
        assert everything == [(w, s) for w in range(writers) for s in range(each)]


def _writer(ring: Ring, wid: int, count: int) -> None:
    for seq in range(count):
        ring.put(message(wid, seq, ring.payload_max), timeout=JOIN)


def _reader(ring: Ring, out) -> None:
    got = []
    while True:
        data = ring.get(timeout=JOIN)
        if not data:
            break
        got.append(check(data))
    out.send(got)


def test_processes_on_both_ends(no_leaks):
    with Ring.create(16, 512) as ring:
        writers, readers, each = 3, 2, 2000
        pipes = [ctx.Pipe(duplex=False) for _ in range(readers)]
        ws = [ctx.Process(target=_writer, args=(ring, w, each)) for w in range(writers)]
        rs = [ctx.Process(target=_reader, args=(ring, p[1])) for p in pipes]
        for p in ws + rs:
            p.start()
        join(ws)
        for _ in rs:
            ring.put(b"", timeout=JOIN)
        got = []
        for recv, send in pipes:
            assert recv.poll(JOIN)
            got.append(recv.recv())
            recv.close()
            send.close()
        join(rs)
        for mine in got:
            for wid in range(writers):
                seqs = [s for w, s in mine if w == wid]
                assert seqs == sorted(seqs)
        assert sorted(m for mine in got for m in mine) == \
            [(w, s) for w in range(writers) for s in range(each)]


def test_fenced_path(no_leaks, python_path, monkeypatch):
    """The path for hardware that does not keep stores (loads) in order runs (here it
    orders nothing the hardware does not)."""
    monkeypatch.setattr(ringmod, "_TSO", False)
    with Ring.create(4) as ring:
        t = threading.Thread(target=lambda: [ring.put(bytes([i]), timeout=JOIN)
                                             for i in range(100)])
        t.start()
        assert [ring.get(timeout=JOIN) for _ in range(100)] == [bytes([i]) for i in range(100)]
        t.join(JOIN)
        assert not t.is_alive()


# -- Full, Empty, timeouts, wake-ups ----------------------------------------------------

def test_full_and_empty(no_leaks):
    with Ring.create(3) as ring:
        assert ring.empty() and len(ring) == 0
        with pytest.raises(queue.Empty):
            ring.get(block=False)
        began = time.monotonic()
        with pytest.raises(queue.Empty):
            ring.get(timeout=0.05)
        assert time.monotonic() - began >= 0.05
        for i in range(3):
            ring.put(bytes([i]), block=False)
        assert ring.full() and ring.qsize() == 3
        with pytest.raises(queue.Full):
            ring.put(b"x", block=False)
        began = time.monotonic()
        with pytest.raises(queue.Full):
            ring.put(b"x", timeout=0.05)
        assert time.monotonic() - began >= 0.05
        with pytest.raises(queue.Full):
            ring.put(b"x", timeout=-1)  # a negative timeout is no wait, as in multiprocessing
        assert [ring.get(block=False) for _ in range(3)] == [b"\0", b"\1", b"\2"]
        assert flag(ring, ringmod._R_SLEEPS) == flag(ring, ringmod._W_SLEEPS) == 0


def test_no_process_can_resize_a_ring(no_leaks):
    """A ring's memfd is sealed at its size: a process holding its fd (a buggy or hostile
    peer) cannot shrink it under the processes that map it, which would kill them with
    SIGBUS, nor grow it."""
    with Ring.create(3) as ring:
        size = os.fstat(ring.fd).st_size
        for new in (0, size // 2, size * 2):
            with pytest.raises(PermissionError):
                os.ftruncate(ring.fd, new)
        ring.put(b"still")
        assert ring.get(timeout=JOIN) == b"still"


def _put_one(ring: Ring, data: bytes) -> None:
    ring.put(data, timeout=JOIN)


def _get_one(ring: Ring, out) -> None:
    out.send(ring.get(timeout=JOIN))


@pytest.mark.parametrize("spin", [0.0, ringmod.SPIN])
def test_sleepers_are_woken(no_leaks, spin):
    """A writer asleep on a full ring wakes when a reader frees a record, and a reader
    asleep on an empty ring wakes when a writer puts one; sleeping flags clear after."""
    with Ring.create(2) as ring:
        ring.spin = spin
        ring.put(b"a")
        ring.put(b"b")
        p = ctx.Process(target=_put_one, args=(ring, b"c"))
        p.start()
        wait_for(lambda: flag(ring, ringmod._W_SLEEPS) == 1, "the writer's sleep")
        assert ring.get(timeout=JOIN) == b"a"
        join([p])
        assert [ring.get(timeout=JOIN) for _ in range(2)] == [b"b", b"c"]
        assert flag(ring, ringmod._W_SLEEPS) == 0

        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_get_one, args=(ring, send))
        p.start()
        wait_for(lambda: flag(ring, ringmod._R_SLEEPS) == 1, "the reader's sleep")
        ring.put(b"d")
        assert recv.poll(JOIN) and recv.recv() == b"d"
        join([p])
        recv.close()
        send.close()
        assert flag(ring, ringmod._R_SLEEPS) == 0


def _put_later(ring: Ring, go) -> None:
    go.wait(JOIN)
    time.sleep(0.01)
    ring.put(b"later", timeout=JOIN)


def test_poll(no_leaks):
    """poll says whether a message waits, waits for one up to its timeout, and takes
    nothing."""
    with Ring.create(2) as ring:
        assert not ring.poll() and not ring.poll(0) and not ring.poll(-1)
        began = time.monotonic()
        assert not ring.poll(0.05)
        assert time.monotonic() - began >= 0.05
        go = ctx.Event()
        p = ctx.Process(target=_put_later, args=(ring, go))
        p.start()
        go.set()
        assert ring.poll(JOIN) and ring.poll() and ring.poll(None)
        assert len(ring) == 1 and ring.get(block=False) == b"later"
        join([p])
        assert flag(ring, ringmod._R_SLEEPS) == 0


def test_many_sleepers_threads(no_leaks):
    """Several threads asleep in get (one on the ring, the others on the readers' lock)
    each get one message; a timed get among them times out on the lock."""
    with Ring.create(4) as ring:
        got: list[bytes] = []
        ts = [threading.Thread(target=lambda: got.append(ring.get(timeout=JOIN)))
              for _ in range(3)]
        for t in ts:
            t.start()
        wait_for(lambda: flag(ring, ringmod._R_SLEEPS) == 1, "a reader's sleep")
        with pytest.raises(queue.Empty):
            ring.get(timeout=0.05)
        with pytest.raises(queue.Empty):
            ring.get(block=False)  # the lock's holder sleeps on the ring: it is empty
        for i in range(3):
            ring.put(bytes([i]))
        for t in ts:
            t.join(JOIN)
        assert not any(t.is_alive() for t in ts)
        assert sorted(got) == [b"\0", b"\1", b"\2"]


# -- hooks for the channel above --------------------------------------------------------

def test_hooks(no_leaks):
    """put's hook gets the record's number under the writers' lock, get's gets the
    number, the writer's index and the message before it is taken; a hook that raises
    writes (takes) nothing."""
    with Ring.create(2) as ring:
        seen: list[tuple] = []
        ring.put(b"a", hook=lambda n: seen.append(("put", n, ring.tail)))
        with pytest.raises(Interrupted):
            ring.put(b"never", hook=_raise)
        ring.put(b"b", hook=lambda n: seen.append(("put", n, ring.tail)))
        assert seen == [("put", 0, 0), ("put", 1, 1)] and (ring.head, ring.tail) == (0, 2)
        with pytest.raises(Interrupted):
            ring.get(hook=_raise)
        assert ring.get(hook=lambda *a: seen.append(("get",) + a)) == b"a"
        assert ring.get(hook=lambda *a: seen.append(("get",) + a)) == b"b"
        assert seen[2:] == [("get", 0, ring.index, b"a"), ("get", 1, ring.index, b"b")]
        assert (ring.head, ring.tail) == (2, 2)
        for lock in (ringmod._W_LOCK, ringmod._R_LOCK):  # both let go of
            assert ringmod._trylock(ring._base + lock) == 0
            assert ringmod._unlock(ring._base + lock) == 0


def _raise(*args):
    raise Interrupted


def test_sync_writers(no_leaks):
    """sync_writers waits for the writers' lock: behind a writer asleep on a full ring
    it times out, and returns once that writer has written."""
    with Ring.create(1) as ring:
        ring.sync_writers(timeout=0)
        ring.put(b"full")
        t = threading.Thread(target=ring.put, args=(b"next",), kwargs={"timeout": JOIN})
        t.start()
        wait_for(lambda: flag(ring, ringmod._W_SLEEPS) == 1, "the writer's sleep")
        with pytest.raises(TimeoutError):
            ring.sync_writers(timeout=0.02)
        assert ring.get(timeout=JOIN) == b"full"
        ring.sync_writers(timeout=JOIN)
        assert ring.tail == 2
        t.join(JOIN)
        assert not t.is_alive() and ring.get(timeout=JOIN) == b"next"


# -- sizes, attaching, process indices --------------------------------------------------

@pytest.mark.parametrize("record_size", [16, 64, 256, 1040])
def test_payload_sizes(no_leaks, record_size):
    with Ring.create(4, record_size) as ring:
        assert ring.payload_max == record_size - 16
        for n in range(ring.payload_max + 1):
            data = os.urandom(n)
            ring.put(data)
            assert ring.get() == data
        if ring.payload_max >= 8:  # other bytes-like objects
            ring.put(bytearray(b"xy"))
            ring.put(memoryview(struct.pack("2i", 1, 2)).cast("B").cast("i"))
            assert ring.get() == b"xy" and ring.get() == struct.pack("2i", 1, 2)
        with pytest.raises(ValueError, match=f"{ring.payload_max + 1} bytes does not fit"):
            ring.put(bytes(ring.payload_max + 1))
        assert ring.empty()


def test_bad_arguments_and_files(no_leaks):
    for capacity, size in [(0, 256), (4, 100), (4, 8)]:
        with pytest.raises(ValueError):
            Ring.create(capacity, size)
    fd = os.memfd_create("not-a-ring")
    try:
        with pytest.raises(ValueError, match="is not a ring"):
            Ring.attach(fd)
        os.ftruncate(fd, 4096)
        with pytest.raises(ValueError, match="is not a ring of this version"):
            Ring.attach(fd)
    finally:
        os.close(fd)
    ring = Ring.create(2)
    ring.close()
    ring.close()
    with pytest.raises(ValueError, match="closed"):
        ring.put(b"x")
    with pytest.raises(ValueError, match="closed"):
        ring.get()


def _ring_maps(fd: int) -> int:
    """How many mappings of ``fd``'s file this process has."""
    ino = os.fstat(fd).st_ino
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.split()[4:5] == [str(ino)])


def test_close_wakes_every_thread_waiting_in_the_ring_and_unmaps_after_them(no_leaks):
    """Threads waiting in ``get`` on an empty ring (asleep on it, and behind the sleeper
    for the lock), in ``put`` on a full one and in ``poll``: another thread's ``close``
    makes each raise ``RingClosed``, never touching unmapped memory; the mapping goes once
    the last of them has left."""
    with Ring.create(1) as full:
        full.put(b"x")
        for get_wait in (0.0, 5.0):  # one asleep at once; one that spins first
            ring = Ring.create(1)
            ring.spin = get_wait
            probe = os.dup(ring.fd)
            try:
                ring_full = Ring.attach(full.fd)
                got: dict[str, type[BaseException] | None] = {}

                def wait(name: str, call) -> None:
                    try:
                        call()
                        got[name] = None
                    except BaseException as e:  # its type: its frames would hold the ring
                        got[name] = type(e)

                calls = {"get 1": ring.get, "get 2": lambda: ring.get(timeout=JOIN),
                         "poll": lambda: ring.poll(None)}
                threads = [threading.Thread(target=wait, args=item) for item in calls.items()]
                for t in threads:
                    t.start()
                deadline = time.monotonic() + JOIN
                while not ring._i[ringmod._R_SLEEPS_I] and not get_wait:
                    assert time.monotonic() < deadline, "no reader went to sleep"
                    time.sleep(0.001)
                time.sleep(0.05)  # the others wait for the lock meanwhile
                assert not got, got
                ring.close()
                for t in threads:
                    t.join(JOIN)
                    assert not t.is_alive(), "a waiter did not wake at close"
                assert got == dict.fromkeys(calls, ringmod.RingClosed)
                assert _ring_maps(probe) == 0, "the ring is still mapped"
                # a put waiting for room in a ring closed by another thread
                t = threading.Thread(target=wait, args=("put", lambda: ring_full.put(b"y")))
                t.start()
                while not ring_full._i[ringmod._W_SLEEPS_I]:
                    assert time.monotonic() < deadline, "no writer went to sleep"
                    time.sleep(0.001)
                ring_full.close()
                t.join(JOIN)
                assert not t.is_alive() and got["put"] is ringmod.RingClosed
                with pytest.raises(ringmod.RingClosed, match="closed"):
                    ring_full.poll()
            finally:
                os.close(probe)
                ring.close()
        assert full.get() == b"x"  # the other mapping of the full ring is untouched


def test_out_of_process_indices(no_leaks, monkeypatch):
    """A process that finds every index taken gets an error that says so, and nothing of
    the attach stays open."""
    monkeypatch.setattr(ringmod, "MAX_PROCS", 2)
    with Ring.create(2) as ring, Ring.attach(ring.fd) as other:
        assert {ring.index, other.index} == {0, 1}
        with pytest.raises(OSError, match="all 2 process indices") as info:
            Ring.attach(ring.fd)
        assert info.value.errno == errno.EUSERS
    with Ring.create(2) as ring:  # indices come back when their rings close
        Ring.attach(ring.fd).close()
        Ring.attach(ring.fd).close()


def _attach_and_echo(sock: socket.socket) -> None:
    _, (fd,), _, _ = socket.recv_fds(sock, 1, 1)
    with Ring.attach(fd) as ring:
        os.close(fd)
        ring.put(ring.get(timeout=JOIN) + b"!", timeout=JOIN)
        sock.send(struct.pack("i", ring.index))


def test_attach_by_send_fds(no_leaks):
    a, b = socket.socketpair()
    with a, b, Ring.create(4) as ring:
        p = ctx.Process(target=_attach_and_echo, args=(b,))
        p.start()
        socket.send_fds(a, [b"r"], [ring.fd])
        ring.put(b"hi")
        a.settimeout(JOIN)
        (k,) = struct.unpack("i", a.recv(4))  # the echo has put its answer
        assert k != ring.index
        assert ring.get(timeout=JOIN) == b"hi!"
        join([p])


def _report_index(ring: Ring, out, go) -> None:
    out.send(ring.index)
    go.wait(JOIN)


def test_fork_child_takes_a_new_index(no_leaks):
    with Ring.create(2) as ring:
        assert not ring.peers_alive()
        recv, send = ctx.Pipe(duplex=False)
        go = ctx.Event()
        p = ctx.Process(target=_report_index, args=(ring, send, go))
        p.start()
        assert recv.poll(JOIN)
        k = recv.recv()
        assert k != ring.index and ring.alive(k) and ring.peers_alive()
        go.set()
        join([p])
        assert not ring.alive(k) and not ring.peers_alive()
        recv.close()
        send.close()


# -- deaths at chosen points ------------------------------------------------------------

def _die_mid_write(ring: Ring) -> None:
    """Take the writers' lock, write half a record at the tail, and die."""
    assert ringmod._trylock(ring._base + ringmod._W_LOCK) == 0
    t = ring._q[ringmod._TAIL_Q]
    off = ringmod._RECORDS + t % ring.capacity * ring.record_size
    ringmod._REC.pack_into(ring._mem, off, t + 1, ring.index, 7)
    ring._mem[off + 16:off + 20] = b"torn"
    os.kill(os.getpid(), signal.SIGKILL)


def _die_mid_read(ring: Ring) -> None:
    """Take the readers' lock, copy the record at the head, and die before taking it."""
    assert ringmod._trylock(ring._base + ringmod._R_LOCK) == 0
    h = ring._q[ringmod._HEAD_Q]
    off = ringmod._RECORDS + h % ring.capacity * ring.record_size
    _ = ring._mem[off:off + ring.record_size]
    os.kill(os.getpid(), signal.SIGKILL)


def _sleep_in(ring: Ring, method: str) -> None:
    """Sleep in ``put`` (``get``) on a full (empty) ring: in this thread, or in a second
    thread while this one waits (``method`` ends in " in a thread")."""
    name = method.split()[0]
    call = getattr(ring, name)
    args = (b"z",) if name == "put" else ()
    if method.endswith("in a thread"):
        t = threading.Thread(target=call, args=args, kwargs={"timeout": JOIN})
        t.start()
        t.join(JOIN)
    else:
        call(*args, timeout=JOIN)
    os._exit(3)  # not reached: killed asleep


def test_writer_killed_holding_the_lock_mid_write(no_leaks):
    with Ring.create(4) as ring:
        ring.put(b"before")
        p = ctx.Process(target=_die_mid_write, args=(ring,))
        p.start()
        join([p], codes=(-signal.SIGKILL,))
        ring.put(b"after", timeout=JOIN)  # takes the lock over; overwrites the torn record
        assert ring.recovered == 1
        assert [ring.get(timeout=JOIN) for _ in range(2)] == [b"before", b"after"]
        assert ring.empty()


def test_reader_killed_holding_the_lock_mid_read(no_leaks):
    """The dead reader's get never returned: the record is the next reader's."""
    with Ring.create(4) as ring:
        ring.put(b"one")
        ring.put(b"two")
        p = ctx.Process(target=_die_mid_read, args=(ring,))
        p.start()
        join([p], codes=(-signal.SIGKILL,))
        assert ring.get(timeout=JOIN) == b"one"
        assert ring.recovered == 1
        assert ring.get(timeout=JOIN) == b"two"


@pytest.mark.parametrize("method", ["put", "get", "put in a thread", "get in a thread"])
def test_killed_asleep(no_leaks, method):
    """A writer killed asleep on a full ring, or a reader on an empty one, holding the
    lock (from its main thread or another): the next caller takes the lock over and
    clears the flag."""
    with Ring.create(1) as ring:
        if method.startswith("put"):
            ring.put(b"full")
        sleeps = ringmod._W_SLEEPS if method.startswith("put") else ringmod._R_SLEEPS
        p = ctx.Process(target=_sleep_in, args=(ring, method))
        p.start()
        wait_for(lambda: flag(ring, sleeps) == 1, "the child's sleep")
        p.kill()
        join([p], codes=(-signal.SIGKILL,))
        if method.startswith("put"):
            assert ring.get(timeout=JOIN) == b"full"
            ring.put(b"next", timeout=JOIN)
            assert ring.recovered == 1 and flag(ring, sleeps) == 0
            assert ring.get(timeout=JOIN) == b"next"
        else:
            with pytest.raises(queue.Empty):
                ring.get(timeout=0.01)
            assert ring.recovered == 1 and flag(ring, sleeps) == 0
            ring.put(b"next")
            assert ring.get(timeout=JOIN) == b"next"


class Interrupted(Exception):
    pass


def _interrupt(signum, frame):
    raise Interrupted


@pytest.mark.parametrize("where", ["on the ring", "on the lock"])
def test_signal_handler_exception_while_waiting(no_leaks, where):
    """An exception a signal handler raises in a waiting get (asleep on an empty ring, or
    waiting for the readers' lock behind a thread asleep there) comes out of it within a
    slice, and leaves the lock and the flags as they were."""
    with Ring.create(2) as ring:
        other = None
        if where == "on the lock":
            other = threading.Thread(target=lambda: ring.get(timeout=JOIN))
            other.start()
            wait_for(lambda: flag(ring, ringmod._R_SLEEPS) == 1, "the thread's sleep")
        previous = signal.signal(signal.SIGALRM, _interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.02)
            with pytest.raises(Interrupted):
                ring.get(timeout=JOIN)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        if other is not None:
            ring.put(b"for the thread")
            other.join(JOIN)
            assert not other.is_alive()
        assert flag(ring, ringmod._R_SLEEPS) == 0
        assert ringmod._trylock(ring._base + ringmod._R_LOCK) == 0  # nobody holds it
        assert ringmod._unlock(ring._base + ringmod._R_LOCK) == 0
        ring.put(b"x")
        assert ring.get(timeout=JOIN) == b"x"


def _raise_after(real, times: list[int]):
    """``real``, then an exception as a signal handler might raise it once the call has
    returned (the first ``times[0]`` calls)."""
    def call(*args):
        rc = real(*args)
        if times[0] > 0:
            times[0] -= 1
            raise Interrupted
        return rc
    return call


@pytest.mark.parametrize("method", ["put", "get", "poll"])
def test_exception_right_after_the_lock_is_taken(no_leaks, python_path, monkeypatch,
                                                 method):
    """An exception between taking a lock and the call's own bookkeeping lets go of it."""
    with Ring.create(2) as ring:
        if method != "poll":  # poll takes no lock while a message waits
            ring.put(b"x")
        monkeypatch.setattr(ringmod, "_trylock", _raise_after(ringmod._trylock, [1]))
        with pytest.raises(Interrupted):
            if method == "put":
                ring.put(b"y")
            else:
                getattr(ring, method)(timeout=0.01)
        monkeypatch.undo()
        for lock in (ringmod._W_LOCK, ringmod._R_LOCK):  # both free
            assert ringmod._trylock(ring._base + lock) == 0
            assert ringmod._unlock(ring._base + lock) == 0
        ring.put(b"z", timeout=JOIN)
        assert ring.get(timeout=JOIN) == (b"z" if method == "poll" else b"x")


def test_exception_in_a_takeover(no_leaks, python_path, monkeypatch):
    """An exception after a lock was taken over from a dead owner and before it was made
    consistent: the lock stays usable (an unlock of an inconsistent robust mutex would
    have made it unrecoverable)."""
    with Ring.create(4) as ring:
        p = ctx.Process(target=_die_mid_write, args=(ring,))
        p.start()
        join([p], codes=(-signal.SIGKILL,))
        monkeypatch.setattr(ringmod, "_consistent", _raise_before(ringmod._consistent, [1]))
        with pytest.raises(Interrupted):
            ring.put(b"lost", timeout=JOIN)
        monkeypatch.undo()
        ring.put(b"after", timeout=JOIN)
        assert ring.get(timeout=JOIN) == b"after" and ring.empty()


def _raise_before(real, times: list[int]):
    """An exception instead of the first ``times[0]`` calls of ``real``, then ``real``."""
    def call(*args):
        if times[0] > 0:
            times[0] -= 1
            raise Interrupted
        return real(*args)
    return call


def test_a_call_inside_a_call_is_refused(no_leaks, python_path, monkeypatch):
    """A put inside a put of the same thread (a signal handler's) gets an error that says
    so instead of waiting for itself."""
    with Ring.create(2) as ring:
        real = ringmod._REC.pack_into

        class Rec:
            size = ringmod._REC_SIZE
            unpack_from = ringmod._REC.unpack_from

            @staticmethod
            def pack_into(*args):
                monkeypatch.setattr(ringmod, "_REC", ringmod.struct.Struct("QII"))
                with pytest.raises(OSError, match="already holds the ring's lock"):
                    ring.put(b"inner", timeout=JOIN)
                for name in ("get", "poll"):  # the readers' lock, held the same way
                    assert ringmod._trylock(ring._base + ringmod._R_LOCK) == 0
                    with pytest.raises(OSError, match="already holds the ring's lock"):
                        getattr(ring, name)(timeout=JOIN)
                    assert ringmod._unlock(ring._base + ringmod._R_LOCK) == 0
                # the outer put still holds the writers' lock
                assert ringmod._trylock(ring._base + ringmod._W_LOCK) == errno.EDEADLK
                real(*args)

        monkeypatch.setattr(ringmod, "_REC", Rec)
        ring.put(b"outer", timeout=JOIN)
        assert ring.get(timeout=JOIN) == b"outer" and ring.empty()


def test_malformed_record_is_stepped_over(no_leaks):
    with Ring.create(4) as ring:
        for data in (b"a", b"b", b"c"):
            ring.put(data)
        off = ringmod._RECORDS + 1 * ring.record_size  # record of b"b"
        struct.pack_into("I", ring._mem, off + 12, 10_000)  # its length, out of range
        assert ring.get() == b"a"
        with pytest.raises(OSError, match="record 1 .* malformed") as info:
            ring.get()
        assert info.value.errno == errno.EBADMSG
        assert ring.get() == b"c" and ring.empty()
        ring.put(b"d")
        struct.pack_into("Q", ring._mem, ringmod._RECORDS + 3 * ring.record_size, 99)
        with pytest.raises(OSError, match="sequence number 99"):
            ring.get()
        ring.put(b"e")
        assert ring.get() == b"e"


# -- random SIGKILLs --------------------------------------------------------------------

KILLS = 200
WRITERS, READERS = 3, 2
LOG = 1 << 14  # entries per reader's log
_STOP, _DONE = 0, 1  # stop flag (writers stop), done flag (all writers are gone)
_TAKEOVERS = 8  # a u32: locks taken over from a dead owner, all workers together
_ACKS = 64  # offset of the ack counters: one u32 per writer id
_LOGS = 1 << 16  # offset of the readers' logs: per reader id, a u32 count then u64 entries
_MAX_IDS = 1024


# The workers write the board through memoryview items (one store each): a process
# killed inside ``struct.pack_into``, which zeroes its bytes before it writes them, would
# leave a count of 0.

def _count_takeover(ring: Ring, counts: memoryview) -> None:
    if ring.recovered:
        ring.recovered = 0
        counts[_TAKEOVERS // 4] += 1  # approximate: workers race for it


def _stress_writer(ring: Ring, board: mmap.mmap, wid: int) -> None:
    ring.spin = 0.0 if wid % 2 else ringmod.SPIN
    counts = memoryview(board).cast("I")
    ack = _ACKS // 4 + wid
    seq = 0
    while not board[_STOP]:
        try:
            ring.put(message(wid, seq, ring.payload_max), timeout=0.2)
        except queue.Full:
            continue
        finally:
            _count_takeover(ring, counts)
        seq += 1
        counts[ack] = seq  # acknowledged: put() returned


def _stress_reader(ring: Ring, board: mmap.mmap, rid: int) -> None:
    ring.spin = 0.0 if rid % 2 else ringmod.SPIN
    counts, entries = memoryview(board).cast("I"), memoryview(board).cast("Q")
    base = _LOGS + rid * (8 * LOG + 8)
    n = 0
    while n < LOG:
        try:
            data = ring.get(timeout=0.05)
        except queue.Empty:
            if board[_DONE] and ring.empty():
                return
            continue
        finally:
            _count_takeover(ring, counts)
        wid, seq, crc = _MSG.unpack_from(data)
        ok = zlib.crc32(data[_MSG.size:]) == crc
        entries[(base + 8) // 8 + n] = (wid << 32 | seq) if ok else 1 << 63
        n += 1
        counts[base // 4] = n
    os._exit(5)  # log full: the test respawns the reader


@pytest.mark.parametrize("victims", ["writers", "both"])
def test_random_sigkills(no_leaks, victims):
    """Kill writers (and readers) at random points (seeded: which one, how long after the
    last kill), with survivors running on; then drain and count.  Every acknowledged
    message arrives exactly once, except at most one per killed reader (taken, not yet
    logged); nothing arrives corrupt or twice; the survivors never wedge; some of the
    deaths were of a lock's holder."""
    rng = random.Random(27)
    board = mmap.mmap(-1, _LOGS + _MAX_IDS * (8 * LOG + 8) // 4)
    ring = Ring.create(4, 96)
    live: dict[str, list] = {"w": [], "r": []}
    ids = {"w": 0, "r": 0}
    killed = {"w": 0, "r": 0}
    finished = []

    def spawn(role):
        k = ids[role]
        ids[role] += 1
        target = _stress_writer if role == "w" else _stress_reader
        p = ctx.Process(target=target, args=(ring, board, k))
        p.start()
        live[role].append(p)

    try:
        for _ in range(WRITERS):
            spawn("w")
        for _ in range(READERS):
            spawn("r")
        for _ in range(KILLS):
            time.sleep(rng.random() * 0.004)
            role = "w" if victims == "writers" or rng.random() < 0.5 else "r"
            for p in [p for p in live["r"] if not p.is_alive()]:  # a full log: respawn
                p.join()
                assert p.exitcode == 5
                live["r"].remove(p)
                finished.append(p)
                spawn("r")
            victim = live[role].pop(rng.randrange(len(live[role])))
            victim.kill()
            victim.join(JOIN)
            if role == "r" and victim.exitcode == 5:  # its log filled just before the kill
                finished.append(victim)
                spawn("r")
                continue
            assert victim.exitcode == -signal.SIGKILL
            killed[role] += 1
            spawn(role)
            assert ids["r"] < _MAX_IDS // 4 and ids["w"] < _MAX_IDS
        board[_STOP] = 1
        join(live["w"])
        board[_DONE] = 1
        while live["r"]:  # the readers drain the ring; one whose log fills is replaced
            p = live["r"].pop()
            p.join(JOIN)
            assert p.exitcode in (0, 5), f"a reader ended with {p.exitcode}"
            finished.append(p)
            if p.exitcode == 5:
                spawn("r")
    finally:
        for p in live["w"] + live["r"]:
            if p.is_alive():
                p.kill()
                p.join(5)
        ring.close()

    counts: dict[tuple[int, int], int] = {}
    corrupt = 0
    for rid in range(ids["r"]):
        base = _LOGS + rid * (8 * LOG + 8)
        (n,) = struct.unpack_from("I", board, base)
        for e in struct.unpack_from(f"{n}Q", board, base + 8):
            if e == 1 << 63:
                corrupt += 1
            else:
                counts[(e >> 32, e & 0xFFFFFFFF)] = counts.get((e >> 32, e & 0xFFFFFFFF), 0) + 1
    acks = struct.unpack_from(f"{ids['w']}I", board, _ACKS)
    (takeovers,) = struct.unpack_from("I", board, _TAKEOVERS)
    board.close()
    duplicated = [m for m, c in counts.items() if c > 1]
    beyond = [(w, s) for (w, s) in counts if s > acks[w]]  # s == acks[w]: put() may have
    missing = [(w, s) for w in range(ids["w"]) for s in range(acks[w])  # returned unacked
               if (w, s) not in counts]
    print(f"\n{KILLS} kills ({killed}), {takeovers} locks taken over, {sum(acks)} "
          f"acknowledged, {len(counts)} received, {len(missing)} missing")
    assert corrupt == 0 and not duplicated and not beyond
    assert len(missing) <= killed["r"], missing[:10]
    assert sum(acks) > KILLS  # the survivors kept working
    assert takeovers > 0


# -- the C extension and the Python path ------------------------------------------------

BUILT = importlib.util.find_spec("shmtensor.ipc._cring") is not None
needs_c = pytest.mark.skipif(not BUILT, reason="the C extension is not built here")


def test_the_pure_python_switch():
    """SHMTENSOR_PURE_PYTHON=1 makes ring.py ignore the extension; without it, ring.py
    uses the extension wherever it was built."""
    code = "from shmtensor.ipc import ring; print(ring._c is None, ring._cput is None)"
    for value, pure in (("1", True), ("", not BUILT), ("0", not BUILT)):
        env = dict(os.environ, SHMTENSOR_PURE_PYTHON=value)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=JOIN)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == [str(pure)] * 2, (value, r.stdout)


def _kind_child(role: str, fd: int, wid: int, count: int) -> None:
    """A writer or reader of test_c_and_python_processes_share_a_ring, in a process of its
    own: prints its path ("python" or "c") and, for a reader, what it got."""
    ring = Ring.attach(fd)
    kind = "python" if ringmod._cput is None else "c"
    got = []
    if role == "writer":
        for seq in range(count):
            ring.put(message(wid, seq, ring.payload_max), timeout=JOIN)
    else:
        while data := ring.get(timeout=JOIN):
            got.append(check(data))
    ring.close()
    print(json.dumps([role, kind, got]))


@needs_c
@pytest.mark.parametrize("writers, readers", [
    (["python"], ["c"]), (["c"], ["python"]), (["python", "c"], ["python", "c"])])
def test_c_and_python_processes_share_a_ring(no_leaks, writers, readers):
    """Processes on the C path and on the Python path write and read one ring: one
    protocol, one layout (a small ring, so that both wait, wrap and wake each other)."""
    each = 1500
    here = os.path.dirname(os.path.abspath(__file__))
    with Ring.create(4) as ring:
        procs = []
        try:
            for role, kinds in (("writer", writers), ("reader", readers)):
                for i, kind in enumerate(kinds):
                    code = (f"import sys; sys.path.insert(0, {here!r}); import test_ring; "
                            f"test_ring._kind_child({role!r}, {ring.fd}, {i}, {each})")
                    env = dict(os.environ,
                               SHMTENSOR_PURE_PYTHON="1" if kind == "python" else "")
                    procs.append(subprocess.Popen(
                        [sys.executable, "-c", code], env=env, pass_fds=(ring.fd,),
                        stdout=subprocess.PIPE, text=True))
            outputs = [procs[i].communicate(timeout=JOIN)[0] for i in range(len(writers))]
            for _ in readers:
                ring.put(b"", timeout=JOIN)
            outputs += [p.communicate(timeout=JOIN)[0] for p in procs[len(writers):]]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
    assert [p.returncode for p in procs] == [0] * len(procs)
    reports = [json.loads(out) for out in outputs]
    assert sorted(r[1] for r in reports if r[0] == "writer") == sorted(writers)
    assert sorted(r[1] for r in reports if r[0] == "reader") == sorted(readers)
    got = [[tuple(m) for m in r[2]] for r in reports if r[0] == "reader"]
    for mine in got:  # each reader sees each writer's messages in order
        for wid in range(len(writers)):
            seqs = [s for w, s in mine if w == wid]
            assert seqs == sorted(seqs)
    assert sorted(m for mine in got for m in mine) == \
        [(w, s) for w in range(len(writers)) for s in range(each)]


def test_get_into(no_leaks):
    """get(into=...) appends the message as it takes it; a hook's exception leaves both
    the list and the ring as they were."""
    with Ring.create(4) as ring:
        ring.put(b"a")
        ring.put(b"b")
        got: list[bytes] = []
        assert ring.get(into=got) == b"a" and got == [b"a"]
        with pytest.raises(Interrupted):
            ring.get(hook=_interrupting, into=got)
        assert got == [b"a"] and len(ring) == 1
        assert ring.get(into=got, timeout=JOIN) == b"b" and got == [b"a", b"b"]
        with pytest.raises(queue.Empty):
            ring.get(block=False, into=got)
        assert got == [b"a", b"b"]


def _interrupting(*args):
    raise Interrupted


def test_put_sent(no_leaks):
    """put(sent=...) appends the record's number as it writes it; a hook's exception, or
    a full ring, leaves the list and the ring as they were."""
    with Ring.create(2) as ring:
        sent: list[int] = []
        ring.put(b"a", sent=sent)
        assert sent == [0]
        with pytest.raises(Interrupted):
            ring.put(b"never", hook=_interrupting, sent=sent)
        assert sent == [0] and len(ring) == 1
        ring.put(b"b", sent=sent)
        with pytest.raises(queue.Full):
            ring.put(b"full", block=False, sent=sent)
        assert sent == [0, 1] and ring.get() == b"a" and ring.get() == b"b"
        ring.put(b"c", timeout=JOIN, sent=sent)  # past a wrap, on either path
        assert sent == [0, 1, 2] and ring.get() == b"c"
        with pytest.raises(TypeError):
            ring.put(b"d", sent=(), block=False)  # type: ignore[arg-type]


def test_exception_right_after_into_got_the_message(no_leaks, python_path):
    """Python path: an exception (a signal handler's) between the append to ``into`` and
    the advance of ``head`` finds the message taken: in the list, not in the ring too."""
    class Interrupting(list):
        def append(self, item):
            super().append(item)
            raise Interrupted

    with Ring.create(4) as ring:
        ring.put(b"a")
        ring.put(b"b")
        got = Interrupting()
        with pytest.raises(Interrupted):
            ring.get(into=got)
        assert list(got) == [b"a"]
        assert ring.get(block=False) == b"b" and ring.empty()


def test_a_call_inside_a_hook_is_refused(no_leaks):
    """A put inside a put's hook (which runs under the writers' lock, on either path)
    gets an error that says so; the outer put goes through."""
    with Ring.create(2) as ring:
        def hook(number):
            with pytest.raises(OSError, match="already holds the ring's lock"):
                ring.put(b"inner", timeout=JOIN)

        ring.put(b"outer", hook=hook)
        assert ring.get(timeout=JOIN) == b"outer" and ring.empty()


def test_buffers_other_than_bytes(no_leaks):
    """put takes any C-contiguous buffer; what it cannot take, it refuses as before."""
    with Ring.create(4) as ring:
        ring.put(bytearray(b"ab"))
        ring.put(memoryview(b"xcdx")[1:3])
        ring.put(array.array("I", [1, 2]))
        assert [ring.get() for _ in range(3)] == [b"ab", b"cd",
                                                  bytes(array.array("I", [1, 2]))]
        with pytest.raises(TypeError):
            ring.put(memoryview(b"abcd")[::2])
        with pytest.raises(ValueError, match="does not fit"):
            ring.put(bytearray(ring.payload_max + 1))
        assert ring.empty()
