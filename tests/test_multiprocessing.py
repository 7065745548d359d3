"""Behaviour across processes: the seed's CPU tests ported, plus lifetimes and limits."""

import contextlib
import concurrent.futures
import os
import sys
import threading
import time
from queue import Empty

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp
from shmtensor.ipc import procfs

import helpers
from conftest import JOIN, START_METHODS, join_all

REPEATS = 5


def _sharing(ctx, lc):
    # fill: the child writes into a shared array the parent sees
    x = shmtensor.zeros((5, 5))
    q, e = ctx.Queue(), ctx.Event()
    data = [x, x[:, 1]]
    q.put(data)
    p = ctx.Process(target=helpers.simple_fill, args=(q, e), daemon=True)
    p.start()
    lc.check_pid(p.pid)
    assert e.wait(JOIN)
    assert (data[0] == 4).all() and (data[1] == 4).all()
    join_all(p)
    # receive: the same array twice arrives as views of one buffer
    q, e = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=helpers.send_array, args=(q, e), daemon=True)
    p.start()
    lc.check_pid(p.pid)
    t1, t2 = q.get(timeout=JOIN), q.get(timeout=JOIN)
    assert (t1 == 1).all() and t1.base is t2.base
    del t1, t2
    e.set()
    join_all(p)


@pytest.mark.parametrize("method", START_METHODS)
def test_sharing_repeated(method, strategy, lc):
    ctx = smp.get_context(method)
    for _ in range(REPEATS):
        _sharing(ctx, lc)


def test_preserve_sharing_repeated(strategy, lc):
    ctx = smp.get_context("spawn")
    for _ in range(REPEATS):
        x = shmtensor.share_memory(np.random.randn(5, 5))
        data = [x, x[2], x[:, 1]]
        q = ctx.Queue()
        q.put(data)
        new = q.get(timeout=JOIN)
        for a, b in zip(data, new):
            np.testing.assert_array_equal(a, b)
        assert all(n.base is new[0].base for n in new)
        assert new[0].base is x.base  # back in the producer: a view of its own memory


@pytest.mark.parametrize("method", START_METHODS)
def test_pool_repeated(method, strategy, lc):
    ctx = smp.get_context(method)
    for _ in range(2):
        with ctx.Pool(2) as pool:
            for proc in pool._pool:
                lc.check_pid(proc.pid)
            buffers = [shmtensor.zeros((2, 2)) for _ in range(4)]
            results = pool.map(helpers.pool_fill, buffers, 1)
            assert len(results) == 4
            for r in results:
                np.testing.assert_array_equal(r, np.full((2, 2), 5.0))
            for b in buffers:
                np.testing.assert_array_equal(b, np.full((2, 2), 4.0))
        pool.join()


def test_fs_segment_visible_in_flight_and_gone_after(lc):
    prev = smp.get_sharing_strategy()
    smp.set_sharing_strategy("file_system")
    try:
        ctx = smp.get_context("spawn")
        mine = f"shmtensor_{os.getpid()}_"
        for _ in range(REPEATS):
            q = ctx.Queue()
            assert not [n for n in procfs.named_segments() if n.startswith(mine)]
            q.put(np.zeros(100_000))          # large: copied into a named segment
            assert [n for n in procfs.named_segments() if n.startswith(mine)]
            q.get(timeout=JOIN)
            deadline = time.monotonic() + 5  # the feeder thread lets go right after sending
            while True:
                shmtensor.empty_cache()
                left = [n for n in procfs.named_segments() if n.startswith(mine)]
                if not left or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            assert not left
            q.close()
            q.join_thread()
    finally:
        smp.set_sharing_strategy(prev)


def test_inherit_under_fork(lc):
    ctx = smp.get_context("fork")
    t = shmtensor.zeros((5, 5))
    p = ctx.Process(target=helpers.inherit_add, args=(t,))
    p.start()
    join_all(p)
    np.testing.assert_array_equal(t, np.full((5, 5), 3.0))


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_process_args_share_under_spawn(method, lc):
    ctx = smp.get_context(method)
    t = shmtensor.zeros((5, 5))
    p = ctx.Process(target=helpers.inherit_add, args=(t,))
    p.start()
    join_all(p)
    np.testing.assert_array_equal(t, np.full((5, 5), 3.0))


def test_empty_and_zero_d_across_processes(strategy, lc):
    ctx = smp.get_context("spawn")
    q = ctx.Queue()
    q.put([np.empty(0), shmtensor.empty((0, 4)), shmtensor.full((), 2.5)])
    a, b, c = q.get(timeout=JOIN)
    assert a.shape == (0,) and b.shape == (0, 4) and c.shape == () and c == 2.5


def test_is_shared():
    assert shmtensor.is_shared(shmtensor.zeros(3))
    assert not shmtensor.is_shared(np.zeros(3))
    assert not shmtensor.is_shared([1, 2])


@pytest.mark.parametrize("method", START_METHODS)
def test_producer_exits_right_after_put(method, strategy, lc):
    ctx = smp.get_context(method)
    q = ctx.Queue()
    p = ctx.Process(target=helpers.put_and_exit, args=(q, 4, 50_000))
    p.start()
    join_all(p)  # gone before anything is read
    got = [q.get(timeout=JOIN) for _ in range(5)]
    assert [int(g[0]) for g in got] == [0, 1, 2, 3, 42]
    assert all(shmtensor.is_shared(g) for g in got)


def test_send_back_to_producer_is_its_own_memory(strategy, lc):
    ctx = smp.get_context("spawn")
    inq, outq = ctx.Queue(), ctx.Queue()
    a = shmtensor.zeros(10)
    p = ctx.Process(target=helpers.send_back, args=(inq, outq))
    p.start()
    inq.put(a)
    back, part = outq.get(timeout=JOIN), outq.get(timeout=JOIN)
    join_all(p)
    assert back.base is a.base and part.base is a.base
    back[2] = 7
    assert a[2] == 7 and part[1] == 7


def test_ten_thousand_arrays_alive_under_ulimit_256(lc):
    ctx = smp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    n = 10_000
    p = ctx.Process(target=helpers.limit_fds_and_receive, args=(q, out, n, 256))
    p.start()
    prev = shmtensor.get_inline_threshold()
    shmtensor.set_inline_threshold(0)  # every array through a segment, none inline
    try:
        for i in range(n):
            q.put(np.full(4, i, dtype=np.int64))
    finally:
        shmtensor.set_inline_threshold(prev)
    ok, nfds, count = out.get(timeout=JOIN * 2)
    join_all(p)
    assert ok and count == n
    assert nfds < 128


def test_process_pool_executor_with_context(lc):
    ctx = smp.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as ex:
        outs = list(ex.map(helpers.executor_task, [np.arange(5.0), np.ones(3)]))
    np.testing.assert_array_equal(outs[0], np.arange(5.0) * 2)
    assert shmtensor.is_shared(outs[0])


def test_pipe_and_simple_queue_and_joinable_queue(lc):
    ctx = smp.get_context("spawn")
    a, b = ctx.Pipe()
    x = shmtensor.ones(4)
    a.send(x)
    assert b.recv().base is x.base
    a.send_bytes(b"raw")
    assert b.recv_bytes() == b"raw"
    a.close(), b.close()
    sq = ctx.SimpleQueue()
    sq.put(x)
    assert sq.get().base is x.base
    sq.close()
    jq = ctx.JoinableQueue()
    jq.put(x)
    assert jq.get().base is x.base
    jq.task_done()
    jq.join()


def test_manager_carries_arrays(lc):
    ctx = smp.get_context("spawn")
    with ctx.Manager() as m:
        lc.check_pid(m._process.pid)
        shared = m.list()
        x = shmtensor.zeros(3)
        shared.append(x)
        y = shared[0]
        assert y.base is x.base  # through the manager process and back: our own memory
        shared.append(np.full(200_000, 2.0))  # large, not shared: crosses by a segment
        np.testing.assert_array_equal(shared[1], np.full(200_000, 2.0))
        del y, shared


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_manager_hands_out_copies_of_plain_arrays_as_the_stdlib_does(method, lc):
    # A plain array stored in a manager is a value: each read is a copy of its own, which
    # its reader may write without changing what the manager holds or what others read.
    # Shared arrays stay shared (the manager hands out the same memory).
    with smp.get_context(method).Manager() as m:
        lc.check_pid(m._process.pid)
        lst, d = m.list(), m.dict()
        big = np.arange(1 << 20, dtype=np.float64)  # 8 MiB: above the inline threshold
        lst.append(big)
        d["k"] = big
        x = lst[0]
        x[:5] = -1
        y = lst[0]
        assert y[:3].tolist() == [0.0, 1.0, 2.0] and not np.shares_memory(x, y)
        z = d["k"]
        z += 100
        assert float(d["k"][1]) == 1.0
        s = shmtensor.zeros(1 << 20)
        lst.append(s)
        s[0] = 7.0
        assert float(lst[1][0]) == 7.0  # shared: the very memory
        del x, y, z, s, lst, d


def test_drop_in_exports_every_multiprocessing_name():
    import multiprocessing
    missing = [n for n in multiprocessing.__all__ if not hasattr(smp, n)]
    assert not missing
    ctx = smp.get_context("spawn")
    assert isinstance(ctx, multiprocessing.context.BaseContext)
    assert smp.get_all_sharing_strategies() >= {"file_descriptor", "file_system"}


def test_importing_changes_nothing_for_stdlib_users():
    import multiprocessing
    from multiprocessing.reduction import ForkingPickler
    assert np.ndarray not in ForkingPickler._extra_reducers
    q = multiprocessing.get_context("spawn").Queue()
    x = shmtensor.zeros(3)
    q.put(x)
    y = q.get(timeout=JOIN)
    assert not shmtensor.is_shared(y)
    q.close()
    q.join_thread()


def test_joinable_queue_with_a_slow_consumer_and_large_inline_frames(lc):
    # put may send frames itself; it must never hold the queue's task lock while the
    # socket is full, or the consumer's task_done() waits on it forever
    ctx = smp.get_context("spawn")
    q = ctx.JoinableQueue()
    sizes = [6_000 if i % 2 else 3_000 for i in range(600)]  # 48 KB via the feeder, 24 KB direct
    p = ctx.Process(target=helpers.slow_joinable_consumer, args=(q, len(sizes)))
    p.start()
    for i, size in enumerate(sizes):
        q.put(np.full(size, i, dtype=np.float64))
    q.join()  # every task_done arrived
    join_all(p)
    assert p.exitcode == 0


def test_queue_close_without_a_feeder_thread_closes_its_socket():
    import gc
    smp.get_context("spawn").Queue()  # once per process: the resource tracker's pipe
    gc.collect()
    q = smp.get_context("spawn").Queue()  # never put to: close is a no-op, as the stdlib's
    own = {os.fstat(fd).st_ino for fd in (q._reader.fileno(), q._writer.fileno(), q._chan.ring.fd)}
    q.close()
    q.join_thread()
    assert q._thread is None and q.empty()  # CPython 3.13's test_closed_queue_empty_exceptions
    del q
    gc.collect()
    # its sockets and its ring went with it (by inode: other threads of the suite, CUDA's
    # among them, may open fds meanwhile)
    open_now = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            open_now.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:  # the listing's own fd, or one closed meanwhile
            pass
    assert not own & open_now
    q = smp.get_context("spawn").Queue()
    q.put(np.arange(4))  # small: sent by put itself (the first put starts the feeder anyway)
    assert (q.get(timeout=JOIN) == np.arange(4)).all()
    q.close()
    q.join_thread()
    assert q._reader.closed and q._writer.closed


@contextlib.contextmanager
def receive_spin(us: int):
    """This process's receive spin at ``us`` inside, its own value again after."""
    prev = shmtensor.get_receive_spin()
    shmtensor.set_receive_spin(us)
    try:
        yield
    finally:
        shmtensor.set_receive_spin(prev)


@pytest.mark.parametrize("holder", ["SpawnQueueHolder", "ForkserverQueueHolder"])
def test_queues_held_by_a_process_subclass_take_the_parents_settings(holder, lc):
    # Queues kept as attributes of a Process subclass are made in the child as the process
    # is unpickled: the parent's settings must apply before, as for its arguments.
    with receive_spin(2500):
        ctx = smp.get_context("spawn" if holder.startswith("Spawn") else "forkserver")
        inq, outq = ctx.Queue(), ctx.Queue()
        p = getattr(helpers, holder)(inq, outq)
        p.start()
        lc.check_pid(p.pid)
        assert outq.get(timeout=JOIN) == (2500, pytest.approx(2.5e-3))
        inq.put(shmtensor.full((10,), 3, dtype=np.int64))
        assert outq.get(timeout=JOIN) == 30
        join_all(p)
        assert p.exitcode == 0
        inq.close()
        outq.close()


@pytest.mark.parametrize("start_method", START_METHODS)
def test_a_child_reads_with_its_parents_receive_spin_and_misses_nothing(start_method, lc):
    # The reader polls before it sleeps (with its parent's setting): messages sent while it
    # polls, or while it sleeps between chunks, arrive whole and in order, with their arrays.
    with receive_spin(3000):
        ctx = smp.get_context(start_method)
        inq, outq = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=helpers.relay_sums_with_spin, args=(inq, outq, 300))
        p.start()
        lc.check_pid(p.pid)
        assert outq.get(timeout=JOIN) == (3000, pytest.approx(3e-3))
        for start in range(0, 300, 50):  # in chunks: the reader waits between them
            for i in range(start, start + 50):
                inq.put(shmtensor.full((1000,), i, dtype=np.int64) if i % 2 else
                        np.full(1000, i, dtype=np.int64))
            got = [outq.get(timeout=JOIN) for _ in range(50)]
            assert got == [1000 * i for i in range(start, start + 50)]
        join_all(p)
        assert p.exitcode == 0
        inq.close()
        outq.close()


@pytest.mark.parametrize("joinable", [False, True], ids=["Queue", "JoinableQueue"])
def test_a_put_cut_short_by_a_signal_handler_leaves_no_lock_held(joinable):
    # torch's SIGCHLD handler raises in the main thread when a DataLoader worker dies; an
    # exception raised as a lock's Python-level __enter__/__exit__ returns (where CPython
    # runs a pending handler) would leave the lock held by nobody: every later put hangs
    import sys
    import threading

    class Raised(Exception):
        pass

    def returns_raise(frame, event, arg):
        if event == "return":
            raise Raised
        return returns_raise

    def tracer(frame, event, arg):
        code = frame.f_code
        if code.co_name in ("__enter__", "__exit__") and code.co_filename in (
                threading.__file__, sys.modules["multiprocessing.synchronize"].__file__):
            return returns_raise
        return None

    q = smp.JoinableQueue() if joinable else smp.Queue()
    try:
        q.put("warm")  # the feeder started (its start waits on an Event) before the trace
        assert q.get(timeout=JOIN) == "warm"
        sys.settrace(tracer)
        try:
            q.put("x")
        except Raised:
            pass
        finally:
            sys.settrace(None)
        lock = q._notempty._lock  # a plain lock: any thread may let go of it
        held = not lock.acquire(False)
        lock.release()  # either way: close() below takes it
        assert not held, "a put left the queue's lock held"
        q.put("after")
        got = [q.get(timeout=JOIN) for _ in range(2)]
        assert got[-1] == "after"
    finally:
        q.close()
        q.join_thread()


@pytest.mark.parametrize("missing", ["_close", "_jointhread"])
def test_a_feeder_whose_finalizers_a_signal_cut_short_still_closes_and_joins(missing):
    """A signal handler's exception between the feeder's start and its two finalizers
    (``_feeder_finalizers``) left one unregistered: ``close`` then sent no sentinel, and
    ``join_thread`` waited for good.  Both are made where missing at close and join."""
    import threading
    q = smp.get_context("spawn").Queue()
    q.put("x")
    assert q.get(timeout=JOIN) == "x"
    getattr(q, missing).cancel()  # as if its registration never happened
    setattr(q, missing, None)
    feeder = q._thread
    joined = threading.Thread(target=lambda: (q.close(), q.join_thread()), daemon=True)
    joined.start()
    joined.join(JOIN)
    assert not joined.is_alive(), "close() and join_thread() did not return"
    assert not feeder.is_alive(), "join_thread() returned before the feeder ended"


def test_a_queue_still_works_after_a_signal_handler_raised_all_through_its_puts():
    """A SIGALRM handler raising every 20-400 us while the main thread puts (small
    messages, arrays copied into segments, bodies the feeder sends) and gets: afterwards
    this thread and another can still put and get.  A lock taken by a Python-level call
    whose return the handler interrupted (the put's help to the feeder) would leave the
    feeder waiting for good, and every later message unsent."""
    import random
    import signal
    import threading

    class Alarm(Exception):
        pass

    armed = [False]

    def handler(signum, frame):
        if armed[0]:
            raise Alarm

    rng = random.Random(7)
    q = smp.get_context("fork").Queue()
    old = signal.signal(signal.SIGALRM, handler)
    try:
        end = time.monotonic() + 3.0
        i = 0
        while time.monotonic() < end:
            i += 1
            message = (i, np.full(8, i)) if i % 3 == 0 else (
                (i, np.full(10_000, i)) if i % 3 == 1 else (i, b"y" * 70_000))
            try:
                armed[0] = True
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(20e-6, 400e-6))
                try:
                    q.put(message)
                    q.get(True, 0.001)
                except (Alarm, Empty):
                    pass
            except Alarm:
                pass
            finally:
                armed[0] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, old)
    try:
        while True:
            q.get(timeout=1.0)  # what is left (a message may have been lost: a put raised)
    except Empty:
        pass
    q.put("after")
    assert q.get(timeout=JOIN) == "after", "the queue stopped delivering"
    got = []
    t = threading.Thread(target=lambda: (q.put("thread"), got.append(q.get(timeout=JOIN))))
    t.start()
    t.join(JOIN)
    assert got == ["thread"] and not t.is_alive()
    q.close()
    q.join_thread()


class _Alarm(Exception):
    pass


def _raise_alarm(signum, frame, *extra):
    raise _Alarm


class _AlarmRaiser:
    def __call__(self, signum, frame):
        raise _Alarm

    def method(self, signum, frame):
        raise _Alarm


@pytest.mark.parametrize("kind", ["function", "partial", "callable", "method"])
def test_a_signal_handlers_exception_while_put_pickles_is_raised_by_put(kind):
    """An exception a signal handler raises while ``put`` pickles (a SIGCHLD handler that
    says a worker died, an alarm that ends a wait) is the caller's: ``put`` raises it and
    queues nothing, instead of reporting it as an object that cannot be pickled (and
    dropping the message while put returns).  Whatever the handler is: a function, a
    ``functools.partial`` of one, a callable object, a bound method."""
    import functools
    import signal

    Alarm = _Alarm
    handler = {"function": _raise_alarm,
               "partial": functools.partial(functools.partial(_raise_alarm), 1),
               "callable": _AlarmRaiser(), "method": _AlarmRaiser().method}[kind]

    class Slow:
        def __reduce__(self):
            os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(1000):  # the handler runs at one of these steps
                pass
            return (int, ())

    errors = []
    q = smp.Queue()
    q._on_queue_feeder_error = lambda e, obj: errors.append(e)
    old = signal.signal(signal.SIGUSR1, handler)
    try:
        with pytest.raises(Alarm):
            q.put(Slow())
    finally:
        signal.signal(signal.SIGUSR1, old)
    q.put("after")
    assert q.get(timeout=JOIN) == "after"
    assert not errors, "the handler's exception was taken for a pickling error"
    q.close()
    q.join_thread()


@pytest.mark.parametrize("twice", [False, True], ids=["in_start", "in_start_and_wait"])
def test_a_feeder_whose_start_was_cut_short_is_still_the_queues_only_feeder(monkeypatch,
                                                                          twice):
    """A signal handler's exception in ``Thread.start``'s wait for the new feeder (the
    first put's), and again in the put's own wait for it to feed, leaves that thread
    running: the queue keeps it as its feeder, starts no second one, and ``join_thread``
    sees it end."""
    import threading

    class Alarm(Exception):
        pass

    start = threading.Thread.start

    def cut_short(self):
        start(self)
        if self.name == "QueueFeederThread":
            raise Alarm

    from shmtensor import _queues
    began = _queues._began

    def cut_wait(sending, seconds):
        began(sending, seconds)
        raise Alarm

    before = {t for t in threading.enumerate() if t.name == "QueueFeederThread"}
    q = smp.Queue()
    if twice:
        monkeypatch.setattr(_queues, "_began", cut_wait)
    monkeypatch.setattr(threading.Thread, "start", cut_short)
    with pytest.raises(Alarm):
        q.put("first")
    monkeypatch.setattr(threading.Thread, "start", start)
    if twice:
        monkeypatch.setattr(_queues, "_began", began)
        assert q._thread is None and q._sending.began  # cut short in both waits
    q.put("second")  # (a put that raises has queued nothing)
    assert q.get(timeout=JOIN) == "second"
    feeders = {t for t in threading.enumerate() if t.name == "QueueFeederThread"} - before
    assert len(feeders) == 1, f"{len(feeders)} feeders for one queue"
    q.close()
    q.join_thread()
    assert not any(t.is_alive() for t in feeders)


def test_a_pickling_cut_short_before_it_began_leaves_no_message_being_pickled(monkeypatch):
    """An exception (a signal handler's) right after a message's send context was set and
    before its pickling began must not leave that context set: every later pickling in
    the thread (a spawned Process's, which then takes the stdlib's pickler and cannot send
    a lambda) would take itself for part of that message."""
    import io
    from shmtensor import _reductions, _wire

    class Alarm(Exception):
        pass

    def raising():
        raise Alarm

    monkeypatch.setattr(_reductions.io, "BytesIO", raising)
    with pytest.raises(Alarm):
        _reductions.dumps(("x", 1))
    monkeypatch.setattr(_reductions.io, "BytesIO", io.BytesIO)
    assert getattr(_wire.current, "send", None) is None


@pytest.mark.parametrize("cut", [KeyError, KeyboardInterrupt],
                         ids=["Exception", "BaseException"])
@pytest.mark.parametrize("then", ["put", "feeder"])
def test_a_frame_sent_by_a_put_helping_the_feeder_is_never_sent_again(monkeypatch, cut,
                                                                      then):
    """A put helps the feeder send what the queue's buffer holds (its reader lagged).  An
    exception (a signal handler's) right after the channel took a frame, before the frame
    left the buffer, must not have the next put's help or the feeder send it again: the
    reader gets each message once, in order."""
    import threading
    from shmtensor import _channel, _queues

    q = smp.Queue()
    # no feeder thread: this test sends the buffer's frames, as a put's help or the feeder
    q._thread = threading.Thread(target=lambda: None)
    try:
        with q._sending.lock:  # as while the feeder sends: the puts queue behind it
            for i in range(3):
                q.put(i)
        assert len(q._buffer) == 3

        post, calls = _channel.Channel.post, []

        def cut_short(self, *args, **kwargs):
            post(self, *args, **kwargs)
            calls.append(1)
            if len(calls) == 1:
                raise cut("right after the channel took the frame")
        monkeypatch.setattr(_channel.Channel, "post", cut_short)
        if cut is KeyboardInterrupt:
            with pytest.raises(KeyboardInterrupt):
                q._help_send()
            assert len(q._buffer) == 3 and q._buffer[0].sent  # sent, left for the next
        else:
            q._help_send()  # not a signal handler's: the put goes on with the next frames
        if then == "put":
            q._help_send()
        else:
            while q._buffer:
                assert _queues._send_item(q._buffer.popleft(), q._chan)
        assert not q._buffer
        got = [q.get(timeout=JOIN) for _ in range(3)]
        assert got == [0, 1, 2]
        with pytest.raises(Empty):
            q.get(timeout=0.2)  # nothing sent twice
    finally:
        q._thread = None
        q.close()
        q.join_thread()


@pytest.mark.parametrize("when, cut_by", [("before", KeyboardInterrupt),
                                          ("before", TimeoutError), ("after", TimeoutError)])
def test_a_put_cut_short_around_its_write_keeps_the_queues_counts(monkeypatch, when, cut_by):
    """An exception (a signal handler's) in the put's send: before the record is written,
    put raises and gives back what it took (the bounded queue's place, the joinable
    task), so join() does not wait for a message that never went; after it is written,
    even an OSError (TimeoutError) is not taken for a failed send: the message is
    delivered and counted once, and a later put sends in the caller's thread again."""
    from shmtensor import _channel

    q = smp.JoinableQueue(4)
    try:
        q.put("warm")
        assert q.get(timeout=JOIN) == "warm"
        q.task_done()
        post, cut = _channel.Channel.post, []

        def cut_short(self, *args, **kwargs):
            if not cut:
                cut.append(1)
                if when == "before":
                    raise cut_by("before the write")
                post(self, *args, **kwargs)
                raise cut_by("after the write")
            return post(self, *args, **kwargs)
        monkeypatch.setattr(_channel.Channel, "post", cut_short)
        with pytest.raises(cut_by, match=f"{when} the write"):
            q.put(1)
        if when == "after":
            assert q.get(timeout=JOIN) == 1
            q.task_done()
        assert q._sem.get_value() == 4 and q._unfinished_tasks.get_value() == 0
        q.join()  # nothing unfinished: returns at once
        assert not q._buffer
        sent_now = []
        real = q._send_now
        monkeypatch.setattr(q, "_send_now", lambda *a: sent_now.append(real(*a)) or sent_now[-1])
        q.put(2)
        assert sent_now == [True] and q.get(timeout=JOIN) == 2
        q.task_done()
        with pytest.raises(Empty):
            q.get(timeout=0.2)
    finally:
        q.close()
        q.join_thread()


def test_a_put_never_overtakes_a_frame_the_feeder_put_back_and_took_again(monkeypatch):
    """A put sends in its own thread only when nothing put before it is unsent.  The
    feeder takes a frame off the buffer, finds the channel full, puts it back, lets go of
    the sending lock, and takes it again: a put that looked at the buffer (empty: the
    frame in the feeder's hand), then at the lock (free: the frame back), then at the
    buffer (empty again: taken again) would send its message first.  The put holds the
    lock while it looks and sends (review AF's schedule, its windows stretched)."""
    import threading
    from shmtensor import _queues

    class SlowToLook:
        """The sending lock; in the putting thread, ``locked()`` waits until the lock is
        free, then the thread is preempted for 3 ms before its next look."""

        def __init__(self, lock, who):
            self._lock, self._who, self.armed = lock, who, False

        def acquire(self, *args):
            return self._lock.acquire(*args)

        def release(self):
            return self._lock.release()

        def __enter__(self):
            return self._lock.__enter__()

        def __exit__(self, *args):
            return self._lock.__exit__(*args)

        def locked(self):
            if threading.current_thread() is self._who and self.armed:
                self.armed = False
                end = time.monotonic() + 1
                while self._lock.locked() and time.monotonic() < end:
                    time.sleep(0)
                time.sleep(0.003)
                return False
            return self._lock.locked()

    q = smp.Queue()
    try:
        q.put(("start", 0))  # the feeder started
        assert q.get(timeout=JOIN)[0] == "start"
        feeder, real, tries = q._thread, _queues._try_send, [0]

        def try_send(item, chan):
            if threading.current_thread() is feeder:
                tries[0] += 1
                time.sleep(0.005)
                if tries[0] == 1:
                    return False  # the channel had no room: the frame goes back
            return real(item, chan)
        monkeypatch.setattr(_queues, "_try_send", try_send)
        lock = q._sending.lock = SlowToLook(q._sending.lock, threading.current_thread())
        q.put(("A", b"a" * 40_000))  # over ATOMIC_MAX: the feeder's to send
        time.sleep(0.002)  # the feeder took A, and is in its first try
        lock.armed = True
        q.put(("B", 1))
        assert [q.get(timeout=JOIN)[0] for _ in range(2)] == ["A", "B"]
    finally:
        q.close()
        q.join_thread()


def _wait_until_inside(t: threading.Thread, names: tuple[str, ...]) -> None:
    """Until thread ``t`` runs a function named in ``names`` (then a moment more, for
    it to reach its wait)."""
    deadline = time.monotonic() + JOIN
    while True:
        frame = sys._current_frames().get(t.ident)
        while frame is not None and frame.f_code.co_name not in names:
            frame = frame.f_back
        if frame is not None:
            break
        assert time.monotonic() < deadline and t.is_alive(), "the thread did not wait"
        time.sleep(0.01)
    del frame
    time.sleep(0.05)


def _hold_and_put(q, go):
    go.wait(JOIN)
    q.put("from the child")


@pytest.mark.parametrize("kind", ["Queue", "JoinableQueue"])
@pytest.mark.parametrize("lib", ["stdlib", "shmtensor"])
def test_close_ends_a_waiting_get_once_nothing_can_come_as_the_stdlibs(lib, kind, request):
    """close() and join_thread() while another thread waits in get(), with no other
    process on the queue: a blocking get raises EOFError and one with a timeout OSError
    (the stdlib's reader meets the end of its pipe, or its closed handle)."""
    import multiprocessing
    if lib == "shmtensor":
        request.getfixturevalue("lc")  # (the stdlib's queue leaks its pipe here)
    ctx = (multiprocessing if lib == "stdlib" else smp).get_context("fork")
    for timeout, raised in ((None, EOFError), (JOIN, OSError)):
        q = getattr(ctx, kind)()
        q.put(1)
        assert q.get(timeout=JOIN) == 1  # the feeder runs
        got: list = []

        def waiter() -> None:
            try:
                got.append(q.get(timeout=timeout))
            except BaseException as e:  # its type: its frames would hold the queue
                got.append(type(e))

        t = threading.Thread(target=waiter)
        t.start()
        _wait_until_inside(t, ("_recv_bytes", "wait", "_sleep_while"))
        q.close()
        q.join_thread()
        t.join(JOIN)
        assert not t.is_alive() and got and issubclass(got[0], raised), got


@pytest.mark.parametrize("kind", ["Queue", "JoinableQueue"])
def test_a_get_waiting_at_close_still_takes_what_another_process_puts(kind, lc):
    """While a child has the queue, close() does not end this process's waiting get
    (something may still come, as through the stdlib's pipe, whose writer the child
    holds): it takes what the child puts after the close."""
    ctx = smp.get_context("fork")
    q = getattr(ctx, kind)()
    q.put(1)
    assert q.get(timeout=JOIN) == 1
    go = ctx.Event()
    p = ctx.Process(target=_hold_and_put, args=(q, go))
    p.start()
    got: list = []
    t = threading.Thread(target=lambda: got.append(q.get(timeout=JOIN)))
    t.start()
    _wait_until_inside(t, ("_sleep_while",))
    q.close()
    q.join_thread()
    go.set()
    t.join(JOIN)
    p.join(JOIN)
    assert got == ["from the child"] and p.exitcode == 0


@pytest.mark.parametrize("kind", ["Queue", "JoinableQueue"])
def test_empty_after_close_raises_as_the_stdlibs_once_the_queue_was_used(kind):
    """CPython 3.13's test_closed_queue_empty_exceptions, on every version: a queue never
    put to says empty after close(); one that was used raises OSError (its reader is
    closed once the feeder stopped), on ours as on the stdlib's."""
    import multiprocessing
    for module in (multiprocessing, smp):
        unused = getattr(module, kind)()
        unused.close()
        unused.join_thread()
        assert unused.empty()
        used = getattr(module, kind)()
        used.put("foo")
        used.close()
        used.join_thread()
        with pytest.raises(OSError, match="is closed"):
            used.empty()
