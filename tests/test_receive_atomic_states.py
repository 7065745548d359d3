"""A receive interrupted where a steady stream from one producer never is (issue 26).

tests/test_receive_atomic.py raises at every point of a receive, but its receives all find
the same state: the sweeper thread running, the segment mapped already or mapped anew
into a running process.  The soak (``SHMTENSOR_SOAK_LOADS=1``) reaches states that stream
does not, and left a dead producer's segment mapped, or a peer's lease description open:

* the sweeper stopped, as a fork leaves it (``_segments._stop_sweeper_before_fork``) in
  a process that forks producers as it receives: the receive that maps a segment then
  starts it again, and an exception there left the new mapping owned by nobody;
* an anchor dying inside a receive (a reference cycle a GC pass collects there, an
  array of a discarded message): its finalizer runs Python code, where a signal
  handler's exception cut the release of its hold short;
* a receive from a new peer past ``ofd_lease.holdings_kept()`` peers (a soak's many
  short-lived producers), which forgets the idle peers' descriptions: an exception
  there closed none of them and left them open, their holding forgotten.

Here each is raised at every point in turn, and nothing may be left: no mapping, no fd, no hold on the
producer's segments.
"""

from __future__ import annotations

import gc
import os
import sys
import threading

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp
from shmtensor import _segments
from shmtensor.ipc import ofd_lease

from helpers import exit_once_segments_freed
from test_receive_atomic import Inject

JOIN = 60
SIZE = 1 << 18  # int64s: a 2 MiB array, a segment of its own


def _produce(q, n, done):
    for i in range(n):
        q.put((i, np.full(SIZE, i, np.int64)))
    q.close()
    q.join_thread()
    exit_once_segments_freed(done, JOIN)


def _mapped() -> list[str]:
    """The segments of other processes this process maps (its own lease table aside)."""
    with open("/proc/self/maps") as f:
        return sorted({line.split(None, 5)[-1].strip() for line in f
                       if "shmtensor_" in line and "_lease" not in line})


def _state() -> tuple[list[str], set[tuple[str, str]]]:
    gc.collect()
    shmtensor.empty_cache()
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own fd
            continue
        if not target.startswith(("/proc/", "/sys/fs/cgroup/")):  # a thread's read in flight
            fds.add((fd, target))
    return _mapped(), fds


@pytest.fixture(params=["file_descriptor", "file_system"])
def strategy(request):
    prev = smp.get_sharing_strategy()
    smp.set_sharing_strategy(request.param)
    yield request.param
    smp.set_sharing_strategy(prev)


def test_a_receive_that_restarts_the_sweeper_leaves_nothing_whatever_it_is_interrupted_at(
        lc, strategy):
    ctx = smp.get_context("fork")
    q = ctx.Queue(maxsize=2)  # a few 2 MiB segments in flight, reused as they come back
    n = 1200
    done = ctx.Event()
    p = ctx.Process(target=_produce, args=(q, n, done))
    p.start()
    lc.check_pid(p.pid)
    inject = Inject()
    i = 0

    def prepare():
        shmtensor.empty_cache()  # the next segment is mapped anew ...
        _segments._stop_sweeper_before_fork()  # ... with the sweeper stopped, as a fork leaves it

    def receive():
        prepare()
        return q.get(timeout=JOIN)

    def check(got, where=None):
        seq, a = got
        assert seq == i and (a == i).all(), f"message {i} expected, {seq} arrived ({where})"

    try:
        for _ in range(3):  # lease tables and the like, made once, before counting
            check(receive())
            i += 1
        base = _state()
        k, quiet = 1, 0
        while quiet < 3:  # the receive has run out of points to interrupt
            assert i < n - 2, "not enough messages for every point"
            prepare()
            got, fired = inject.receive(k, lambda: q.get(timeout=JOIN))
            if got is None:  # interrupted: the next receive delivers the message ...
                if inject.in_load:  # ... unless it was being unpickled: then discarded
                    i += 1
                got = receive()
            check(got, inject.where)
            del got
            now = _state()
            assert now == base, (f"left after an interrupt at {inject.where} (message {i}): "
                                 f"mapped {now[0]}, fds {now[1] ^ base[1]}")
            quiet = 0 if fired else quiet + 1
            i += 1
            k += 1
        assert k > 50, f"only {k} points were interrupted"
        while i < n:
            check(q.get(timeout=JOIN))
            i += 1
    finally:
        done.set()
        p.join(JOIN)
        if p.is_alive():
            p.kill()
            p.join(5)
        q.close()
        q.join_thread()
    assert p.exitcode == 0, "the producer's segments are still held (exit code 3)"


def test_an_anchor_dying_whatever_its_finalizer_is_interrupted_at_is_let_go_of(lc, strategy):
    ctx = smp.get_context("fork")
    q = ctx.Queue(maxsize=2)
    n = 120
    done = ctx.Event()
    p = ctx.Process(target=_produce, args=(q, n, done))
    p.start()
    lc.check_pid(p.pid)
    inject = Inject()
    ignored: list = []
    hook = sys.unraisablehook
    i = 0
    try:
        for _ in range(3):  # lease tables and the like, made once, before counting
            assert q.get(timeout=JOIN)[0] == i
            i += 1
        base = _state()
        kept = ofd_lease._kept  # descriptions kept as holds: counted as they are let go of
        k, quiet = 1, 0
        # what the finalizer raised, which CPython drops (its name only: the exception
        # itself would keep the finalizer's frame, and this one, alive)
        sys.unraisablehook = lambda u: ignored.append(type(u.exc_value).__name__)
        while quiet < 3:  # the finalizer has run out of points to interrupt
            assert i < n, "not enough messages for every point"
            seq, a = q.get(timeout=JOIN)
            assert seq == i
            inject.arm(k)
            try:
                del a  # the anchor dies: its finalizers run here
            finally:
                fired = inject.disarm()
            now = _state()  # settles what died, finishing a release cut short
            assert now == base, (f"left after an interrupt at {inject.where} (message {i}): "
                                 f"mapped {now[0]}, fds {now[1] ^ base[1]}")
            assert ofd_lease._kept == kept, f"kept descriptions miscounted at {inject.where}"
            assert not fired or ignored, f"nothing raised at {inject.where}"
            quiet = 0 if fired else quiet + 1
            i += 1
            k += 1
        assert k > 5, f"only {k} points were interrupted"
        assert set(ignored) == {"Injected"}
        while i < n:
            assert q.get(timeout=JOIN)[0] == i
            i += 1
        shmtensor.empty_cache()
    finally:
        sys.unraisablehook = hook
        done.set()
        p.join(JOIN)
        if p.is_alive():
            p.kill()
            p.join(5)
        q.close()
        q.join_thread()
    assert p.exitcode == 0, "the producer's segments are still held (exit code 3)"


def _produce_small(q, n, done):
    for i in range(n):
        q.put((i, np.full(100_000, i % 256, np.uint8)))  # a slab's: one slot for many
    q.close()
    q.join_thread()
    exit_once_segments_freed(done, JOIN)


def _locks_free() -> bool:
    """Whether another thread can take every holding's lock (none left taken here)."""
    free: list[bool] = []

    def probe():
        for h in list(ofd_lease._holdings.values()):
            if not h.lock.acquire(blocking=False):
                free.append(False)
                return
            h.lock.release()
        free.append(True)

    t = threading.Thread(target=probe)
    t.start()
    t.join(JOIN)
    return free == [True]


def test_a_receive_that_forgets_an_idle_peer_leaves_nothing_whatever_it_is_interrupted_at(
        lc, monkeypatch):
    """The first receive from a new peer forgets the idle ones' descriptions (past
    ``ofd_lease.holdings_kept()`` peers: a soak with many short-lived producers): an
    exception there (a signal handler's) may not leave one open, its holding forgotten,
    nor a holding's lock taken."""
    monkeypatch.setattr(ofd_lease, "holdings_kept", lambda: 0)  # every new peer forgets
    ctx = smp.get_context("fork")
    n = 1500
    done = ctx.Event()
    qs, ps = [], []
    for _ in range(2):
        q = ctx.Queue()
        p = ctx.Process(target=_produce_small, args=(q, n, done))
        p.start()
        lc.check_pid(p.pid)
        qs.append(q)
        ps.append(p)
    idle, new = qs
    seqs = [0, 0]
    drained = False
    inject = Inject()

    def check(got, j, where=None):
        seq, a = got
        assert seq == seqs[j] and (a == seq % 256).all(), (
            f"message {seqs[j]} expected, {seq} arrived ({where})")
        seqs[j] += 1

    def prepare():
        gc.collect()
        shmtensor.empty_cache()  # every peer forgotten: the next receive adopts anew ...
        check(idle.get(timeout=JOIN), 0)  # ... and one idle peer is known before it
        gc.collect()

    try:
        prepare()
        check(new.get(timeout=JOIN), 1)
        base = _state()
        k, quiet = 1, 0
        while quiet < 3:  # the receive has run out of points to interrupt
            assert max(seqs) < n - 2, "not enough messages for every point"
            prepare()
            got, fired = inject.receive(k, lambda: new.get(timeout=JOIN))
            # before the next receive, which would forget (and unlock) an idle one again
            assert _locks_free(), f"a holding's lock left taken at {inject.where}"
            if got is None:  # interrupted: the next receive delivers the message ...
                if inject.in_load:  # ... unless it was being unpickled: then discarded
                    seqs[1] += 1
                got = new.get(timeout=JOIN)
            check(got, 1, inject.where)
            del got
            now = _state()
            assert now == base, (f"left after an interrupt at {inject.where}: "
                                 f"mapped {now[0]}, fds {now[1] ^ base[1]}")
            quiet = 0 if fired else quiet + 1
            k += 1
        assert k > 50, f"only {k} points were interrupted"
        for j, q in enumerate(qs):
            while seqs[j] < n:
                check(q.get(timeout=JOIN), j)
        drained = True
    finally:
        done.set()
        for p in ps:
            p.join(JOIN if drained else 1)  # one that failed left them blocked in a put
            if p.is_alive():
                p.kill()
                p.join(5)
        for q in qs:
            q.close()
            q.join_thread()
    assert [p.exitcode for p in ps] == [0, 0], "a producer's segments are still held (3)"
