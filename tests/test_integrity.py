"""Integrity at scale: no array corrupted or lost under threads, fd limits, any size, and
100,000 live arrays (each case reproduced first, then kept as a test)."""

import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp
from shmtensor import _segments

from conftest import JOIN, START_METHODS, join_all
from test_arrays import roundtrip
from integrity_helpers import (hold_many_under_limit, keep_under_limit, make_message,
                               mismatch, pool_map_under_limit, produce_under_limit,
                               put_full_arrays, stress_produce)


def _check_exit(*procs):
    for p in procs:
        assert p.exitcode == 0, f"child {p.pid} exited with {p.exitcode}"


# 1. Several threads on one queue -------------------------------------------------------

@pytest.mark.timeout(240)
def test_threads_putting_plain_arrays_never_see_each_others_values(strategy, lc):
    """8 threads x 500 puts of (v, np.full(20000, v)) on one fork Queue(maxsize=64): before,
    1-12 of 4000 arrived holding another thread's values (a send copy's segment was
    recycled by another thread between the copy and the message's lease)."""
    ctx = smp.get_context("fork")
    q = ctx.Queue(maxsize=64)
    threads, per = 8, 500
    p = ctx.Process(target=put_full_arrays, args=(q, threads, per, 20_000))
    p.start()
    bad, seen = [], set()
    for _ in range(threads * per):
        v, a = q.get(timeout=JOIN)
        seen.add(v)
        if not (a == v).all():
            bad.append((v, np.unique(a)[:4].tolist()))
    join_all(p)
    _check_exit(p)
    assert not bad, f"{len(bad)} arrays held other values: {bad[:5]}"
    assert seen == set(range(threads * per))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", [m for m in ("fork", "spawn") if m in START_METHODS])
def test_differential_stress_random_nested_messages(method, strategy, lc):
    """Random nested messages (tuples, lists, dicts of arrays of random dtypes, shapes and
    views, shared and plain, 0 B to 4 MB) from 8 threads arrive exactly as sent; the
    consumer keeps a window of them alive so slabs and segments are reused under it."""
    ctx = smp.get_context(method)
    q = ctx.Queue(maxsize=32)
    threads, per, seed = 8, 400, {"fork": 1_000, "spawn": 500_000}[method]
    p = ctx.Process(target=stress_produce, args=(q, threads, per, seed))
    p.start()
    done, window, bad, count = set(), [], [], 0
    while len(done) < threads:
        t, i, msg = q.get(timeout=JOIN)
        if i is None:
            done.add(t)
            continue
        count += 1
        want = make_message(seed + t * per + i)
        m = mismatch(msg, want)
        if m:
            bad.append((t, i, m))
        window = (window + [(t, i, msg)])[-64:]
    join_all(p)
    _check_exit(p)
    # the kept window is still intact after everything after it was sent and reused
    bad += [(t, i, m) for t, i, msg in window
            if (m := mismatch(msg, make_message(seed + t * per + i)))]
    del window, msg
    assert not bad, f"{len(bad)} of {count} messages differ: {bad[:5]}"
    assert count == threads * per


# 2. fd limits: nothing lost, fds scale with slabs ----------------------------------------

def _produce_and_keep(n: int, size: int, limit: int, shared: bool) -> None:
    """A spawned producer puts ``n`` arrays of ``size`` int64 that a spawned consumer keeps,
    both under ``ulimit -n limit``: all arrive intact, and each keeps fewer than 64 fds."""
    ctx = smp.get_context("spawn")
    q, out, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    prod = ctx.Process(target=produce_under_limit, args=(q, out, n, size, limit, shared))
    cons = ctx.Process(target=keep_under_limit, args=(q, out, n, limit, done))
    prod.start()
    cons.start()
    reports = {}
    for _ in range(2):
        r = out.get(timeout=240)
        reports[r[0]] = r[1:]
    done.set()
    join_all(prod, cons)
    _check_exit(prod, cons)
    ok, count, cons_fds = reports["consumer"]
    (prod_fds,) = reports["producer"]
    assert ok and count == n
    assert cons_fds < 64 and prod_fds < 64, (cons_fds, prod_fds)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared"])
def test_kept_100kb_arrays_under_ulimit_1024(strategy, shared, lc):
    """A producer under ``ulimit -n 1024`` puts 3000 arrays of 100 KB that the consumer
    keeps: before, the feeder hit EMFILE at ~1000 and dropped a message."""
    _produce_and_keep(3000, 100_000 // 8, 1024, shared)


@pytest.mark.timeout(240)
def test_pool_map_of_3000_results_under_ulimit_1024(lc):
    """``Pool(2).map`` returning 3000 x 100 KB under ``ulimit -n 1024``: before, it failed
    with MaybeEncodingError ... Too many open files."""
    ctx = smp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=pool_map_under_limit, args=(out, 3000, 1024, "fork"))
    p.start()
    ok, fds = out.get(timeout=JOIN * 3)
    join_all(p)
    _check_exit(p)
    assert ok and fds < 128


@pytest.mark.timeout(120)
def test_ten_thousand_held_shared_arrays_under_ulimit_256(strategy, lc):
    """10,000 live ``shmtensor.full((256,))`` arrays under ``ulimit -n 256``: before, one fd
    per array's segment ran the file_descriptor strategy out of fds."""
    ctx = smp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=hold_many_under_limit, args=(out, 10_000, 256, strategy))
    p.start()
    ok, fds = out.get(timeout=JOIN)
    join_all(p)
    _check_exit(p)
    assert ok and fds < 64


# 3. 100,000 live small arrays: linear, under ulimit -n 256 in both processes ---------------

@pytest.mark.timeout(300)
def test_hundred_thousand_live_small_arrays_under_ulimit_256(strategy, lc):
    """One producer sends 100,000 small shared arrays; the consumer keeps every one.  Both
    run under ``ulimit -n 256`` and keep fewer than 64 fds.  Before, each release scanned
    leases held per array (70k arrays took more than 300 s); the timeout bounds it."""
    _produce_and_keep(100_000, 128, 256, True)


# 4. Any size goes through ----------------------------------------------------------------

def test_array_larger_than_the_idle_budget_goes_through(strategy, monkeypatch):
    """The idle budget caps what is kept for reuse, never what can be sent: before, an
    array larger than IDLE_BYTES failed with 'segment ... was unmapped here'."""
    monkeypatch.setattr(_segments, "IDLE_BYTES", 1 << 20)
    a = np.arange(1_000_000, dtype=np.int64)  # 8 MB, 8x the budget
    for _ in range(3):
        b = roundtrip(a)
        assert b.shape == a.shape and (b == a).all()
        del b
    assert roundtrip((a, a[::3]))[1].sum() == a[::3].sum()


def test_zero_byte_and_slab_boundary_sizes(strategy):
    sizes = [0, 1, 63, 64, 65, _segments.SLAB_ITEM_MAX - 1, _segments.SLAB_ITEM_MAX,
             _segments.SLAB_ITEM_MAX + 1]
    made = [shmtensor.full((n,), n % 251, dtype=np.uint8) for n in sizes]
    for n, a in zip(sizes, made):
        assert a.shape == (n,) and shmtensor.is_shared(a) and (a == n % 251).all()
        b = roundtrip(a)
        assert b.shape == (n,) and (b == n % 251).all()
        c = roundtrip(np.full(n, n % 251, dtype=np.uint8))
        assert (c == n % 251).all()


# 5. clean decides by leases, across pid namespaces: see test_cli.py --------------------

# 6. Trim order per strategy ----------------------------------------------------------------

def test_named_idle_segments_go_after_their_own_age(monkeypatch):
    """Idle file_system segments are destroyed after 5 s even when older file_descriptor
    ones (kept 30 s) sit ahead of them: before, the oldest of any kind gated the trim."""
    shmtensor.empty_cache()
    monkeypatch.setitem(_segments.IDLE_SECONDS, "file_system", 0.2)
    prev = smp.get_sharing_strategy()
    try:
        smp.set_sharing_strategy("file_descriptor")
        fd_arr = shmtensor.empty(2 << 20, dtype=np.uint8)  # a segment of its own
        fd_seg = _segments.segment_of(fd_arr)
        del fd_arr
        smp.set_sharing_strategy("file_system")
        fs_arr = shmtensor.empty(2 << 20, dtype=np.uint8)
        fs_seg = _segments.segment_of(fs_arr)
        name = fs_seg.key
        del fs_arr
    finally:
        smp.set_sharing_strategy(prev)
    assert fd_seg in _segments.idle_segments() and fs_seg in _segments.idle_segments()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/dev/shm/{name}") and time.monotonic() < deadline:
        _segments.trim()
        time.sleep(0.01)
    assert not os.path.exists(f"/dev/shm/{name}")
    assert fd_seg in _segments.idle_segments()  # not due: 30 s
    shmtensor.empty_cache()


# 7. Small arrays come from slabs -----------------------------------------------------------

def test_small_arrays_share_slabs(strategy):
    shmtensor.empty_cache()
    _segments.ofd_lease.own_table()  # made once per process
    before = shmtensor.debug_info()
    fds = len(os.listdir("/proc/self/fd"))
    arrays = [shmtensor.zeros(128) for _ in range(5000)]
    after = shmtensor.debug_info()
    assert after["segments_created"] - before["segments_created"] <= 3
    # per slab: its fd, and the description that holds its lease (and travels with it);
    # per lease file, once: this process's description of it
    assert len(os.listdir("/proc/self/fd")) - fds <= 2 * 3 + _segments.ofd_lease.SHARDS
    bases = {id(_segments.segment_of(a)) for a in arrays}
    assert len(bases) <= 3
    for i, a in enumerate(arrays):  # no two overlap
        a[:] = i
    assert all((a == i).all() for i, a in enumerate(arrays))


def test_a_slab_is_reused_once_every_array_in_it_is_released(strategy):
    shmtensor.empty_cache()
    keep = shmtensor.zeros(16)
    seg = _segments.segment_of(keep)
    got = roundtrip(keep)
    del keep
    # fill the slab past its end: the next slab must not be this one while `got` lives
    fill = [shmtensor.empty(1 << 19, dtype=np.uint8) for _ in range(2 * seg.size >> 19)]
    assert all(_segments.segment_of(a) is not seg for a in fill[-2:])
    assert seg not in _segments.idle_segments() or _segments.ofd_lease.own_table().is_held(seg.slot)
    del fill, got
    shmtensor.empty_cache()
    assert _segments.segment_of(shmtensor.zeros(1)) is not None


def test_forked_child_carves_its_own_slabs(lc):
    a = shmtensor.full(4, 1.0)
    ctx = smp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_allocates, args=(q,))
    p.start()
    b = q.get(timeout=JOIN)
    c = shmtensor.full(4, 3.0)  # next in the parent's slab: must not be the child's memory
    join_all(p)
    _check_exit(p)
    assert (a == 1.0).all() and (b == 2.0).all() and (c == 3.0).all()
    assert _segments.segment_of(b) is not _segments.segment_of(c)


def _child_allocates(q):
    q.put(shmtensor.full(4, 2.0))
    q.close()
    q.join_thread()


def test_shape_errors_in_numpys_words():
    with pytest.raises(TypeError, match="'float' object cannot be interpreted as an integer"):
        shmtensor.zeros(1.5)
    with pytest.raises(TypeError, match="'float' object cannot be interpreted as an integer"):
        shmtensor.zeros((2, 1.5))
    with pytest.raises(ValueError, match="negative dimensions are not allowed"):
        shmtensor.empty((2, -1))
    with pytest.raises(TypeError, match="Python objects"):
        shmtensor.empty(3, dtype=object)


# 5. clean decides by locks, not pids, across pid namespaces ------------------------------

def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "-p", "-f", "--mount-proc", "true"],
                              capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _can_unshare(),
                    reason="needs 'unshare -p -f --mount-proc' (root or user namespaces)")
def test_clean_in_another_pid_namespace_keeps_a_live_named_segment(lc):
    """``shmtensor clean`` run in another pid namespace (a sidecar) sees neither the
    creator's pid nor its mappings: before, it removed a live file_system segment with a
    message in flight, and the consumer got FileNotFoundError."""
    from shmtensor.ipc import janitor
    prev = smp.get_sharing_strategy()
    smp.set_sharing_strategy("file_system")
    try:
        a = shmtensor.full(3 << 20, 7, dtype=np.uint8)  # a segment of its own
        q = smp.get_context("fork").Queue()
        q.put(a)  # in flight: nobody has received it yet
        name = _segments.segment_of(a).key
        del a
    finally:
        smp.set_sharing_strategy(prev)
    path = f"/dev/shm/{name}"
    old = time.time() - 60
    os.utime(path, (old, old))  # past clean's minimum age
    deadline = time.monotonic() + 10
    while not janitor.in_use(name) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert janitor.in_use(name)
    r = subprocess.run(["unshare", "-p", "-f", "--mount-proc", sys.executable, "-m",
                        "shmtensor", "clean"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert os.path.exists(path), r.stdout
    b = q.get(timeout=JOIN)
    assert (b == 7).all()
    del b
    q.close()
    q.join_thread()


# BatchPool slots: one file, a lease each ----------------------------------------------------

def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_batch_pool_slots_share_one_file_and_free_one_by_one(strategy, lc):
    shmtensor.empty_cache()
    _segments.ofd_lease.own_table()  # made once per process: not the pool's
    ofd = _fds()
    pool = shmtensor.BatchPool((1000,), np.float32, slots=16)
    segs = pool._segments
    assert len({_segments.file_of(s.key)[0] for s in segs}) == 1
    assert _fds() - ofd <= (1 if strategy == "file_descriptor" else 0) + 1  # + a janitor socket
    ctx = smp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_keep_some, args=(q, back, 16))
    p.start()
    for i in range(16):
        a = pool.acquire(timeout=JOIN)
        a[:] = i
        q.put(a)
        del a
    assert back.get(timeout=JOIN) == "kept odd ones"
    # the consumer let go of the even slots only: exactly those are free again
    got = []
    while (a := pool.try_acquire()) is not None:
        got.append(a)
    assert len(got) == 8
    assert sorted(int(a[0]) for a in got) == list(range(0, 16, 2))
    q.put(None)
    join_all(p)
    _check_exit(p)
    del got, a
    assert pool.acquire(timeout=JOIN) is not None  # the consumer's exit frees the rest
    pool.close()
    q.close()
    back.close()


def _keep_some(q, back, n):
    kept = []
    for i in range(n):
        a = q.get(timeout=60)
        assert (a == i).all()
        if i % 2:
            kept.append(a)
        del a
    back.put("kept odd ones")
    assert q.get(timeout=60) is None
    assert all((a == 2 * k + 1).all() for k, a in enumerate(kept))


def test_batch_pool_file_is_reclaimed_after_its_creator_is_killed(strategy, lc):
    """A consumer keeps one slot of a killed producer's pool: the file stays while it is
    held, and nothing is left once the consumer lets go."""
    from test_crash import _left_by, _wait_clean
    ctx = smp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_pool_producer, args=(q, go))
    p.start()
    a = q.get(timeout=JOIN)
    os.kill(p.pid, 9)
    p.join(JOIN)
    assert p.exitcode == -9
    assert (a == 5).all()
    if strategy == "file_system":
        assert _left_by(p.pid)[0]  # still named: a slot of it is held here
    del a
    q.close()
    q.join_thread()
    shmtensor.empty_cache()  # this process's cached mapping of the file
    named, mapped = _wait_clean(p.pid)
    assert not named and not mapped, (named, mapped)


def _pool_producer(q, go):
    pool = shmtensor.BatchPool((256,), np.int64, slots=4)
    a = pool.acquire()
    a[:] = 5
    q.put(a)
    go.wait(60)


def test_running_out_of_fds_says_which_limit_and_the_fix():
    code = ("import resource, numpy as np, shmtensor\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, "
            "(24, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
            "keep = [shmtensor.empty(2_000_000, dtype=np.uint8) for _ in range(100)]\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert "Too many open files" not in last and "ulimit -n 24" in last, last
    assert "raise the limit" in last


def test_a_dying_anchor_waits_for_no_segment_lock(lc):
    """A finalizer that took ``_segments._lock`` could deadlock (a GC pass inside the lease
    table's lock on one thread, ``_lock`` held by another that waits for the lease table):
    an array dies, and its lease goes, while another thread holds ``_lock``."""
    import threading

    from shmtensor.ipc import ofd_lease
    a = shmtensor.empty(2 << 20, dtype=np.uint8)  # a segment of its own (not a slab)
    seg = _segments.segment_of(a)
    holding, let_go, dropped = threading.Event(), threading.Event(), threading.Event()

    def hold_lock():
        with _segments._lock:
            holding.set()
            let_go.wait(JOIN)

    def drop(arrays):
        arrays.clear()  # the anchor's finalizer runs here, in this thread
        dropped.set()

    holder = threading.Thread(target=hold_lock)
    holder.start()
    try:
        assert holding.wait(JOIN)
        arrays = [a]
        del a
        dropper = threading.Thread(target=drop, args=(arrays,))
        dropper.start()
        assert dropped.wait(10), "a dying anchor waited for _segments._lock"
        assert not ofd_lease.own_table().is_held(seg.slot)  # the lease went at once
    finally:
        let_go.set()
        holder.join(JOIN)
    dropper.join(JOIN)
    assert seg in _segments.idle_segments()  # settled by the next call that takes the lock
