"""Children of tests/test_channel_handles.py (importable by spawned processes)."""

from __future__ import annotations

import os
import time

import numpy as np

import shmtensor


def put_after_first(q, took, n, base=0, exit_at_once=True):
    """Put ``base``, wait until the reader took it (``took``), then put ``n`` arrays of
    ``base + 1 ..``: the reader is the queue's sole reader by then, so they go without fds
    but the first one's.  Returns once everything is in the queue (then exits)."""
    q.put(shmtensor.full((64,), base, dtype=np.int64))
    took.wait(60)
    for i in range(1, n + 1):
        q.put(shmtensor.full((64,), base + i, dtype=np.int64))
    q.close()
    q.join_thread()


def put_many(q, n, base, size=128):
    """Put ``n`` fresh arrays of ``size`` int64 of ``base + i``, each let go of at once."""
    for i in range(n):
        q.put(shmtensor.full((size,), base + i, dtype=np.int64))
    q.close()
    q.join_thread()


def take_two_and_wait(q, took_one, took_two, stop):
    """Be the queue's sole reader: take two arrays (signalling each), keep them, and wait
    (to be killed)."""
    take_two_then(q, took_one, took_two, stop)


def take_all(q, n, out):
    """Take ``n`` messages; report each array's first value, or the error's text."""
    got = []
    for _ in range(n):
        try:
            a = q.get(timeout=60)
            got.append(int(a[0]) if (a == a[0]).all() else ("corrupt", int(a[0])))
        except OSError as e:
            got.append(str(e))
    out.put((os.getpid(), got))


def put_six(q, took_one, took_two, close=True):
    """Put 0, then 1 once the reader took it (which announces the slab), then 2 to 5
    once it took that (without fds), and exit (closing the queue first)."""
    q.put(shmtensor.full((64,), 0, dtype=np.int64))
    took_one.wait(60)
    q.put(shmtensor.full((64,), 1, dtype=np.int64))
    took_two.wait(60)
    for i in range(2, 6):
        q.put(shmtensor.full((64,), i, dtype=np.int64))
    if close:
        q.close()
        q.join_thread()


def put_six_and_wait(q, took_one, took_two, written, stop, gone=None):
    """As :func:`put_six`, but keep the queue open: say when all six records are in the
    ring (``written``), then wait (to be killed).  With ``gone``: put the last four once
    it is set."""
    q.put(shmtensor.full((64,), 0, dtype=np.int64))
    took_one.wait(60)
    q.put(shmtensor.full((64,), 1, dtype=np.int64))
    took_two.wait(60)
    if gone is not None:
        gone.wait(60)
    for i in range(2, 6):
        q.put(shmtensor.full((64,), i, dtype=np.int64))
    deadline = time.monotonic() + 60
    while q._chan.ring.tail < 6 and time.monotonic() < deadline:
        time.sleep(0.01)  # the feeder writes them
    written.set()
    stop.wait(60)


def take_two_then(q, took_one, took_two, stop=None, close_reader=False):
    """Be the queue's sole reader for two arrays, wait for ``stop`` (if any), then (with
    ``close_reader``) close this process's reading end, and exit."""
    kept = [q.get(timeout=60)]
    took_one.set()
    kept.append(q.get(timeout=60))
    took_two.set()
    if stop is not None:
        stop.wait(60)
    if close_reader:
        q._reader.close()
    del kept


def hold_writers_lock(q, held, release):
    """Hold the queue's ring's writers' lock (as a writer in the middle of a put) until
    ``release``."""
    q._chan.ring.sync_writers(None, lambda: (held.set(), release.wait(60)))


def put_six_simple(q, took_one, took_two):
    """As :func:`put_six`, on a SimpleQueue, and exit without closing it."""
    put_six(q, took_one, took_two, close=False)


def take_two_simple_and_wait(q, took_one, took_two, stop):
    """:func:`take_two_and_wait` on a SimpleQueue."""
    kept = [q.get()]
    took_one.set()
    kept.append(q.get())
    took_two.set()
    stop.wait(60)
    del kept


def stream_and_count_slabs(q, n, out):
    """Put ``n`` fresh 64 KiB arrays (32 to a slab), then report the most slabs this
    process had at once: few, if its reader lets go of each slab as the next one comes."""
    from shmtensor import _segments
    most = 0
    for i in range(n):
        q.put(shmtensor.full((8192,), i, dtype=np.int64))
        if i % 32 == 0:
            most = max(most, sum(1 for s in _segments.mapped() if s.own and s.slab))
    q.close()
    q.join_thread()
    out.put(most)


def take_first_then_rest(q, n, took, go, back):
    """Take one array (``took``), then, on ``go``, the ``n`` others; then put "done" on
    ``back`` and exit."""
    q.get(timeout=60)
    took.set()
    go.wait(60)
    for _ in range(n):
        q.get(timeout=60)
    back.put("done")
    back.close()
    back.join_thread()


def three_then_none(q, took):
    """Put one array; once the reader took it, three more and a ``None``."""
    q.put(shmtensor.full((1 << 14,), 100, dtype=np.int64))
    took.wait(60)
    for i in range(3):
        q.put(shmtensor.full((1 << 14,), i, dtype=np.int64))
    q.put(None)
    q.close()
    q.join_thread()


def echo(inbox, outbox, n, die=False):
    """Put each of ``n`` arrays taken from ``inbox`` on ``outbox`` (the same memory: a
    received shared array goes on as itself); with ``die``, SIGKILL this process right
    after the last put, holding nothing any more."""
    for _ in range(n):
        outbox.put(inbox.get(timeout=60))
    if die:
        os.kill(os.getpid(), 9)
    outbox.close()
    outbox.join_thread()


def put_and_free(q, n, nbytes, took, freed):
    """Put ``n`` arrays of ``nbytes`` (one slab); once the reader took them (``took``),
    put ``"x"`` (which lets go of what the records held), let go of the slab and destroy
    it (``shmtensor.empty_cache``), and signal ``freed``."""
    kept = [shmtensor.full((nbytes // 8,), 5, dtype=np.int64) for _ in range(n)]
    for a in kept:
        q.put(a)
    took.wait(60)
    q.put("x")
    del kept, a
    shmtensor.empty_cache()
    freed.set()
    q.close()
    q.join_thread()


OWN = 4 << 20  # bytes: past a slab's largest array, so each array is a segment of its own


def put_again(q, n, ack=None, room=None):
    """Put one array (a segment of its own, of 7s) ``n`` times, then exit at once; with
    ``ack``, each put but the last waits for the reader to say it took the message
    (``ack.get``); with ``room``, this process reads its memory room as ``room`` bytes
    free under a memory cgroup limit of twice as many."""
    if room is not None:
        from shmtensor.ipc import shm_space
        shm_space.memory_room = lambda max_age=0.0: shm_space.Room(room, "a test's", 2 * room)
    a = shmtensor.full((OWN // 8,), 7, dtype=np.int64)
    for i in range(n):
        q.put(a)
        if ack is not None and i < n - 1:
            ack.get(timeout=60)
    q.close()
    q.join_thread()


def put_fresh(q, n, ack=None):
    """Put ``n`` fresh arrays (a segment of its own each, of ``i``), then this process's
    segment counters.  Without ``ack``, every array stays alive here (none is reused);
    with it, each is let go of after its put, and the next made once the reader says it
    let go of it too (``ack.get``)."""
    kept = []
    for i in range(n):
        a = shmtensor.full((OWN // 8,), i, dtype=np.int64)
        q.put(a)
        if ack is None:
            kept.append(a)
        else:
            del a
            ack.get(timeout=60)
    q.put(shmtensor.debug_info()["segments"])
    q.close()
    q.join_thread()


def put_again_then_free(q, n, took, done, out):
    """Put one array (a segment of its own) ``n`` times; once the reader took them all
    (``took``), let go of it, give back what is idle, put the bytes that freed on
    ``out``, and stay (the writer alive) until ``done``."""
    a = shmtensor.full((OWN // 8,), 7, dtype=np.int64)
    for _ in range(n):
        q.put(a)
    took.wait(60)
    del a
    out.put(shmtensor.empty_cache())
    done.wait(60)
    q.close()
    q.join_thread()



def take_and_report(q, results, n, go=None):
    """Take ``n`` arrays from ``q`` (a second reader of it; with ``go``, once it is set,
    after putting ``"ready"``) and put each one's first item and whether all its items
    are that on ``results``."""
    if go is not None:
        results.put("ready")
        go.wait(60)
    for _ in range(n):
        a = q.get(timeout=60)
        results.put((int(a[0]), bool((a == a[0]).all())))
    results.close()
    results.join_thread()


def echo_later(inbox, outbox, go, n):
    """Send back the first array taken from ``inbox`` at once, then take ``n`` more and
    send them back only once ``go`` is set."""
    outbox.put(inbox.get(timeout=60))
    held = [inbox.get(timeout=60) for _ in range(n)]
    go.wait(60)
    for a in held:
        outbox.put(a)
    del held, a
    outbox.close()
    getattr(outbox, "join_thread", lambda: None)()


def echo_and_own(inbox, outbox, n):
    """Send back the first array taken from ``inbox``; then take ``n`` more and, for each,
    send it back and then an array of this process's own (``-1``, ``-2``, ...)."""
    outbox.put(inbox.get(timeout=60))
    held = [inbox.get(timeout=60) for _ in range(n)]
    for i, a in enumerate(held):
        outbox.put(a)
        outbox.put(shmtensor.full((256,), -(i + 1), dtype=np.int64))
    del held, a
    outbox.close()
    outbox.join_thread()
