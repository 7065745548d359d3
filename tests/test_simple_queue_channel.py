"""SimpleQueue on the channel, and the Pool on it: threads on both ends, a full ring, large
messages and fds, pickling to a spawned child, waiting on ``_reader`` as the stdlib's Pool
and executors do, and a pool terminated while its workers wait for tasks."""

import asyncio
import threading
import time
from multiprocessing.connection import wait

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp
from shmtensor import _channel, _queues
from shmtensor.ipc import ring as ringmod

from conftest import JOIN, join_all

THREADS, EACH = 4, 300


def _echo(inq, outq, n):
    for _ in range(n):
        outq.put(inq.get())


def _put_all(q, items):
    for x in items:
        q.put(x)


def _put_after(q, go, x):
    go.wait(JOIN)
    q.put(x)


def _consumer(q, got):
    """A thread body that gets from ``q`` into ``got`` until it gets None."""
    lock = threading.Lock()

    def consume():
        while (x := q.get()) is not None:
            with lock:
                got.append(x)
    return consume


def test_threads_on_both_ends_take_each_message_once():
    q = smp.get_context("fork").SimpleQueue()
    got: list = []
    consume = _consumer(q, got)
    producers = [threading.Thread(target=_put_all, args=(q, [(t, i) for i in range(EACH)]))
                 for t in range(THREADS)]
    consumers = [threading.Thread(target=consume) for _ in range(THREADS)]
    try:
        for t in producers + consumers:
            t.start()
        for t in producers:
            t.join(JOIN)
        for _ in consumers:
            q.put(None)
        for t in producers + consumers:
            t.join(JOIN)
            assert not t.is_alive()
        assert sorted(got) == [(t, i) for t in range(THREADS) for i in range(EACH)]
        for t in range(THREADS):  # each producer's messages, each once
            mine = [i for who, i in got if who == t]
            assert len(mine) == EACH
        assert q.empty()
    finally:
        q.close()


def test_processes_and_threads_on_both_ends(lc):
    ctx = smp.get_context("fork")
    q = ctx.SimpleQueue()
    procs = [ctx.Process(target=_put_all, args=(q, [(p, i) for i in range(EACH)]))
             for p in range(2)]
    got: list = []
    consume = _consumer(q, got)
    consumers = [threading.Thread(target=consume) for _ in range(2)]
    try:
        for t in consumers:
            t.start()
        for p in procs:
            p.start()
            lc.check_pid(p.pid)
        join_all(*procs)
        assert [p.exitcode for p in procs] == [0, 0]
        for _ in consumers:
            q.put(None)
        for t in consumers:
            t.join(JOIN)
            assert not t.is_alive()
        assert sorted(got) == [(p, i) for p in range(2) for i in range(EACH)]
    finally:
        q.close()


def test_a_full_simple_queue_blocks_put_until_a_get():
    q = smp.SimpleQueue()
    depth = q._chan.ring.capacity
    for i in range(depth):
        q.put(i)
    assert q._chan.ring.full()
    done = threading.Event()

    def put_one_more():
        q.put("last")
        done.set()

    t = threading.Thread(target=put_one_more)
    t.start()
    try:
        assert not done.wait(0.3), "put() returned with the ring full"
        assert q.get() == 0  # room: the waiting put goes through
        assert done.wait(JOIN)
        assert [q.get() for _ in range(depth)] == list(range(1, depth)) + ["last"]
        assert q.empty()
    finally:
        if not done.is_set():
            q.get()
        t.join(JOIN)
        q.close()


@pytest.mark.parametrize("size", [10, 1000])  # ours: in the ring's records; beside them
@pytest.mark.parametrize("lib", ["stdlib", "shmtensor"])
def test_close_under_a_waiting_get_or_put_raises_as_the_stdlibs(lib, size):
    """Another thread's close: a get waiting for a message raises EOFError, a put waiting
    for room BrokenPipeError, with the stdlib's SimpleQueue and ours (never a crash).
    (Messages of at most PIPE_BUF bytes: the stdlib's larger ones may be half written.)"""
    import multiprocessing
    mp = multiprocessing if lib == "stdlib" else smp
    for side in ("get", "put"):
        q = mp.get_context("fork").SimpleQueue()
        puts, got = [0], []

        def waiter() -> None:
            try:
                if side == "get":
                    q.get()
                while True:  # until the pipe or ring is full, then waits for room
                    q.put(b"x" * size)
                    puts[0] += 1
            except BaseException as e:  # its type: its frames would hold the queue
                got.append(type(e))

        t = threading.Thread(target=waiter)
        t.start()
        deadline, seen = time.monotonic() + JOIN, (-1, 0.0)
        while seen[1] < 0.2:  # waits (no put for 0.2 s)
            assert time.monotonic() < deadline and not got, got
            time.sleep(0.01)
            seen = (puts[0], 0.0) if puts[0] != seen[0] else (seen[0], seen[1] + 0.01)
        q.close()
        t.join(JOIN)
        assert not t.is_alive() and got == [EOFError if side == "get" else BrokenPipeError]


def _hold(q, go):
    go.wait(JOIN)


def test_close_ends_a_waiting_put_while_the_ring_lingers_for_a_peer(lc):
    """A ring full of arrays not yet taken, with a child on it: close() leaves the ring
    mapped for those records (their memory must reach whoever takes them), and still
    ends a put waiting for room in it (BrokenPipeError)."""
    ctx = smp.get_context("fork")
    q = ctx.SimpleQueue()
    go = ctx.Event()
    p = ctx.Process(target=_hold, args=(q, go))
    p.start()
    try:
        a = shmtensor.zeros(1000)
        q.put(a)
        q.get()
        ring = q._chan.ring
        while not ring.full():
            q.put(a)
        got: list = []

        def put_one_more() -> None:
            try:
                q.put(a)
            except BaseException as e:  # its type: its frames would hold the queue
                got.append(type(e))

        t = threading.Thread(target=put_one_more)
        t.start()
        deadline = time.monotonic() + JOIN
        while not ring._i[ringmod._W_SLEEPS_I]:
            assert time.monotonic() < deadline, "the put did not wait for room"
            time.sleep(0.01)
        q.close()
        assert any(r is ring for r, _ in _channel._lingering)  # the case under test
        t.join(JOIN)
        assert not t.is_alive() and got == [BrokenPipeError]
    finally:
        go.set()
        p.join(JOIN)
    assert p.exitcode == 0


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_large_messages_and_shared_arrays_go_through_to_a_spawned_child(method, lc):
    ctx = smp.get_context(method)
    inq, outq = ctx.SimpleQueue(), ctx.SimpleQueue()
    big = bytes(range(256)) * 400               # 100 KiB: past a record and a datagram
    medium = b"m" * 5000                        # past a record, in a datagram
    shared = shmtensor.full(1000, 3.0)          # fds with it
    items = [big, medium, shared, "small", np.arange(50_000.0)]
    p = ctx.Process(target=_echo, args=(inq, outq, len(items)))
    p.start()
    lc.check_pid(p.pid)
    try:
        for x in items:
            inq.put(x)
        back = [outq.get() for _ in items]
        join_all(p)
        assert p.exitcode == 0
        assert back[0] == big and back[1] == medium and back[3] == "small"
        assert back[2].base is shared.base  # the very memory, there and back
        np.testing.assert_array_equal(back[4], np.arange(50_000.0))
        del back
    finally:
        if p.is_alive():
            p.kill()
            p.join(5)
        inq.close()
        outq.close()


def test_waiting_on_the_reader_sees_messages_put_before_and_after_the_first_wait(lc):
    ctx = smp.get_context("fork")
    q = ctx.SimpleQueue()
    go = ctx.Event()
    p = ctx.Process(target=_put_after, args=(q, go, "from a child"))
    p.start()
    lc.check_pid(p.pid)
    try:
        q.put("before")  # a record with no tick: nobody waited yet
        assert wait([q._reader], JOIN) == [q._reader]
        assert q._reader.poll() and q._reader.recv() == "before"
        assert wait([q._reader], 0.2) == []  # nothing waits: not readable
        # the child puts while this wait sleeps (most likely): its record's tick wakes it
        # (without ticks this wait would sleep on)
        setter = threading.Timer(0.3, go.set)
        setter.start()
        assert wait([q._reader], JOIN) == [q._reader]
        setter.join(JOIN)
        assert q.get() == "from a child"
        assert wait([q._reader], 0.2) == []
        join_all(p)
        assert p.exitcode == 0
    finally:
        go.set()
        if p.is_alive():
            p.kill()
            p.join(5)
        q.close()


def test_a_waiter_wakes_for_a_put_of_another_thread_many_times():
    # as a pool's worker handler on its change notifier: wait, then drain with get.  (A
    # tick goes before its record: a waiter may wake a moment before the record shows.)
    q = smp.SimpleQueue()
    n = 200
    woke = 0

    def waiter():
        nonlocal woke
        seen = 0
        while seen < n:
            assert wait([q._reader], JOIN), "a put did not wake the waiter"
            woke += 1
            while not q.empty():
                q.get()
                seen += 1

    t = threading.Thread(target=waiter)
    t.start()
    try:
        for i in range(n):
            q.put(i)
        t.join(JOIN)
        assert not t.is_alive() and woke >= 1
        assert wait([q._reader], 0.1) == []
    finally:
        q.close()


def test_a_thread_waiting_to_get_takes_a_message_only_once_it_is_whole():
    q = smp.SimpleQueue()
    go, started = threading.Event(), threading.Event()
    record = _channel._INLINE + __import__("pickle").dumps(("late", bytes(100)))

    def hook(number):
        started.set()
        go.wait(JOIN)

    writer = threading.Thread(target=q._chan.ring.put, args=(record,), kwargs={"hook": hook})
    writer.start()
    got: list = []
    reader = threading.Thread(target=lambda: got.append(q.get()))
    try:
        assert started.wait(JOIN)
        reader.start()
        assert q.empty() and not got
        go.set()
        writer.join(JOIN)
        reader.join(JOIN)
        assert not reader.is_alive() and got[0][0] == "late"
        q.put("after")
        assert q.get() == "after"
    finally:
        go.set()
        writer.join(JOIN)
        q.close()


def test_put_with_every_reader_closed_raises_broken_pipe():
    q = smp.SimpleQueue()
    q._reader.close()
    with pytest.raises(BrokenPipeError, match="EPIPE"):
        q.put("nobody reads")
    with pytest.raises(OSError, match="closed"):
        q.get()
    q.close()
    with pytest.raises(OSError, match="closed"):
        q.put("closed")


def test_put_async_waits_for_room_and_get_async_for_a_message():
    q = smp.SimpleQueue()
    depth = q._chan.ring.capacity

    async def main():
        for i in range(depth):
            await q.put_async(i)
        waiting = asyncio.create_task(q.put_async("last"))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # the ring is full: it waits in the loop
        got = [await q.get_async() for _ in range(depth + 1)]
        await waiting
        return got

    try:
        assert asyncio.run(main()) == list(range(depth)) + ["last"]
    finally:
        q.close()


def _wait_forever(_):
    threading.Event().wait()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_pool_terminate_while_workers_wait_for_tasks(method, lc):
    pool = smp.get_context(method).Pool(2)
    workers = list(pool._pool)
    for w in workers:
        lc.check_pid(w.pid)
    assert pool.apply_async(abs, (-3,)).get(JOIN) == 3  # then both wait in get()
    pool.terminate()
    pool.join()
    assert all(not w.is_alive() and w.exitcode is not None for w in workers)


def test_pool_terminate_with_tasks_queued_and_running(lc):
    pool = smp.get_context("fork").Pool(2)
    for w in pool._pool:
        lc.check_pid(w.pid)
    pending = [pool.apply_async(_wait_forever, (i,)) for i in range(600)]  # past the ring
    pool.terminate()
    pool.join()
    assert not any(w.is_alive() for w in pool._pool)
    assert not any(r.ready() and r.successful() for r in pending)


def test_pool_map_of_arrays_over_many_tasks(lc):
    with smp.get_context("fork").Pool(2) as pool:
        for w in pool._pool:
            lc.check_pid(w.pid)
        arrays = [shmtensor.full(256, float(i)) for i in range(400)]
        sums = pool.map(np.sum, arrays, chunksize=1)
        assert sums == [256.0 * i for i in range(400)]
    pool.join()


def test_a_simple_queue_pickles_only_while_spawning():
    q = smp.SimpleQueue()
    try:
        with pytest.raises(RuntimeError, match="inheritance"):
            __import__("pickle").dumps(q)
        assert isinstance(q, __import__("multiprocessing").queues.SimpleQueue)
        assert isinstance(q._reader, _queues._Reader)
    finally:
        q.close()


def _die_holding_the_writers_lock(q, ready):
    def hold(number):
        ready.set()
        threading.Event().wait()  # killed here, the lock held
    q._chan.ring.put(_channel._INLINE + b"never", hook=hold)


def test_terminate_returns_when_a_killed_process_held_the_result_queues_lock(lc):
    # as a worker killed mid-send: the ring's writers' lock is robust, so the pool's last
    # sentinel (and every later put) takes it over from the dead holder
    ctx = smp.get_context("spawn")
    pool = ctx.Pool(1)
    worker = pool._pool[0]
    lc.check_pid(worker.pid)
    call = pool.apply_async(_wait_forever, (0,))
    ready = ctx.Event()
    holder = ctx.Process(target=_die_holding_the_writers_lock, args=(pool._outqueue, ready))
    holder.start()
    lc.check_pid(holder.pid)
    assert ready.wait(JOIN)
    holder.kill()
    join_all(holder)
    assert holder.exitcode == -9
    worker.kill()
    with pytest.raises(smp.WorkerLostError):
        call.get(timeout=JOIN)
    pool.terminate()
    pool.join()
    assert not worker.is_alive()
