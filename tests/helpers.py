"""Process targets for the tests (importable by spawned children)."""

import os
import pickle
import signal
import sys
import time

import numpy as np

import shmtensor
import shmtensor.multiprocessing as smp


def exit_once_segments_freed(done, timeout):
    """A producer's end: wait (up to ``timeout``) for ``done``, let go of idle segments and
    exit 0 if none of its own is live or idle any more, else 3 (its memory still held)."""
    done.wait(timeout)
    shmtensor.empty_cache()
    info = shmtensor.debug_info()
    os._exit(0 if info["segments_own_live"] + info["segments_own_idle"] == 0 else 3)


def simple_fill(queue, event):
    data = queue.get()
    data[0][:] = 4
    event.set()


def send_array(queue, event):
    t = shmtensor.ones((5, 5))
    queue.put(t)
    queue.put(t)
    event.wait(60)


def send_array_twice(queue, took, event):
    """``send_array``, the second put once the reader took the first (``took``)."""
    t = shmtensor.ones((5, 5))
    queue.put(t)
    took.wait(60)
    queue.put(t)
    event.wait(60)


def put_and_exit(queue, n, size):
    for i in range(n):
        queue.put(np.full(size, i, dtype=np.int64))
    queue.put(shmtensor.full((10,), 42, dtype=np.int64))


def pool_fill(a):
    a.fill(4)
    return a + 1


def inherit_add(a):
    a += 3


def hold_and_wait(queue, out, event):
    kept = queue.get()
    out.put(int(kept.sum()))
    event.wait(60)


def send_forever(queue, size):
    i = 0
    while True:
        queue.put(np.full(size, i, dtype=np.int64))
        i += 1


def sum_many(queue, out, n):
    kept = [queue.get() for _ in range(n)]
    out.put((len(kept), int(sum(int(k[0]) for k in kept))))


def limit_fds_and_receive(queue, out, n, limit):
    import resource
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    kept = [queue.get() for _ in range(n)]
    nfds = len(os.listdir("/proc/self/fd"))
    ok = all(int(k[0]) == i for i, k in enumerate(kept))
    out.put((ok, nfds, len(kept)))


def send_back(inq, outq):
    a = inq.get()
    outq.put(a)
    outq.put(a[1:3])


def executor_task(a):
    import shmtensor as st
    out = st.empty_like(a)
    out[:] = a * 2
    return out


def suicide_after_get(queue):
    queue.get()
    os.kill(os.getpid(), signal.SIGKILL)


def sleep_forever():
    time.sleep(3600)


def fault_producer(queue, stop, size):
    """Send uniform arrays (shared and not) until told to stop (``stop[0]``); recycling runs
    throughout.  ``stop[1]`` counts sends, up to 100."""
    import queue as _q
    i = 0
    while not stop[0]:
        a = shmtensor.full(size, i, dtype=np.int64) if i % 2 else np.full(size, i, dtype=np.int64)
        try:
            queue.put(a, timeout=0.2)
        except _q.Full:
            continue
        i += 1
        if i <= 100:
            stop[1] = i


def fault_consumer(queue, out, keep):
    """Receive, check each array is whole, keep the last few; report when the stream dries."""
    import queue as _q
    kept, n = [], 0
    while True:
        try:
            a = queue.get(timeout=2.0)
        except _q.Empty:
            break
        if not (a == a[0]).all():
            out.put(("corrupt", n))
            return
        kept = (kept + [(int(a[0]), a)])[-keep:]
        n += 1
    intact = all((a == v).all() for v, a in kept)
    out.put(("ok" if intact else "corrupt", n))


def square(x):
    return x * x


def add(a, b):
    return a + b


class NotRebuildable(Exception):
    def __init__(self, a, b):
        super().__init__(a)


def raise_value_error(x):
    raise ValueError(f"bad {x}")


def raise_weird(x):
    raise NotRebuildable(x, 2)


def crash(how):
    import ctypes
    time.sleep(0.2)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "exit":
        os._exit(3)
    elif how == "segfault":
        ctypes.string_at(0)
    elif how == "sys.exit":
        sys.exit()
    return how


_init_value = None


def set_init(v):
    global _init_value
    _init_value = v


def get_init(_):
    return _init_value, os.getpid()


def spawn_ok(rank, out):
    out.put(rank)


def spawn_fail_rank1(rank):
    if rank == 1:
        raise KeyError(f"rank {rank} failed")
    time.sleep(60)


def spawn_exit_rank0(rank):
    if rank == 0:
        os._exit(4)
    time.sleep(60)


def batch_worker(out, n):
    pool = shmtensor.BatchPool((4, 1000), np.float32, slots=2)
    for i in range(n):
        b = pool.acquire(timeout=30)
        b[...] = i
        out.put(b)
        del b
    out.put(shmtensor.debug_info()["segments_created"])


class NumpyDataset:
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return np.full((3, 4), i, dtype=np.float32)


def exit_in_task(x):
    os._exit(9)


def slow_scale(a):
    """A pool task that holds its (shared or copied) array for a while, then returns it."""
    time.sleep(0.05)
    return a * 2


def slow_joinable_consumer(queue, n):
    """get / a moment of work / task_done, n times: a producer must not starve us of task_done."""
    for _ in range(n):
        queue.get()
        time.sleep(0.001)
        queue.task_done()


def _drop_all(r):
    """Receive and drop until None."""
    while r.recv() is not None:
        pass


def keep_sent_segments_until_out_of_fds(out, limit, size):
    """Under ``limit`` fds: make own segments, send each once to a child that drops it, and
    keep them all until a segment or a send fails; report how many were kept, what the
    error said, whether every kept one is intact and held, and the kept descriptions and
    budget left."""
    import multiprocessing
    import resource

    import shmtensor.multiprocessing as smp
    from shmtensor import _segments
    from shmtensor.ipc import ofd_lease
    r, w = smp.Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(target=_drop_all, args=(r,))
    child.start()
    r.close()
    ofd_lease.own_table()
    start = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    kept, error = [], ""
    try:
        while len(kept) < 4 * limit:
            a = shmtensor.full(size, len(kept), dtype=np.int64)
            w.send(a)
            kept.append(a)
    except OSError as e:
        error = str(e)
    w.send(None)
    child.join(60)
    table = ofd_lease.own_table()
    intact = all(int(a[0]) == i and int(a[-1]) == i for i, a in enumerate(kept))
    held = all(table.is_held(_segments.segment_of(a).slot) for a in kept)
    out.put((len(kept), start, error, intact, held, ofd_lease._kept, ofd_lease.kept_budget(),
             child.exitcode))


def relay_sums_with_spin(inq, outq, n):
    """Sum each array of ``n`` received, and say how this child's reader waits."""
    import shmtensor
    wait = inq._reader._wait
    outq.put((shmtensor.get_receive_spin(), None if wait is None else wait.budget))
    for _ in range(n):
        outq.put(int(inq.get().sum()))


def _queue_holder(base, name: str):
    class QueueHolder(base):
        """A worker that keeps its queues as attributes, as many users write them: they
        are made in the child as the process itself is unpickled."""

        def __init__(self, inq, outq) -> None:
            super().__init__()
            self.inq, self.outq = inq, outq

        def run(self) -> None:
            relay_sums_with_spin(self.inq, self.outq, 1)
    QueueHolder.__name__ = QueueHolder.__qualname__ = name
    return QueueHolder


# a spawned child finds its process's class by name: one module-level class per method
SpawnQueueHolder = _queue_holder(smp.get_context("spawn").Process, "SpawnQueueHolder")
ForkserverQueueHolder = _queue_holder(smp.get_context("forkserver").Process,
                                      "ForkserverQueueHolder")


def array_of(i: int, n: int = 16384):
    """A result big enough to cross through a segment (128 KiB)."""
    return np.full(n, i, dtype=np.float64)


def stall_mid_message(q):
    """Start a put on ``q`` (a queue on a channel) that stops in the middle of writing
    its message, the channel's writers' lock held and its record not yet written, as a
    writer that stalls there; returns ``finish()``, which lets it complete (and waits)."""
    import threading

    from shmtensor import _channel
    go, started = threading.Event(), threading.Event()
    record = _channel._INLINE + pickle.dumps(("late", bytes(100)))

    def hook(number):
        started.set()
        go.wait(60)

    sem = getattr(q, "_sem", None)  # a SimpleQueue counts nothing
    if sem is not None:
        sem.acquire()  # counted as put() counts it
    t = threading.Thread(target=q._chan.ring.put, args=(record,), kwargs={"hook": hook})
    t.start()
    assert started.wait(60), "the stalled put never began"

    def finish():
        go.set()
        t.join(60)
        assert not t.is_alive(), "the stalled put did not finish"
    return finish


def put_and_die_between_datagram_and_record(queue, ready, size):
    """Put an array on ``queue`` (a channel's) that stops right after its side datagram
    went out, before its record is written, and wait there to be killed."""
    from shmtensor import _channel
    real = _channel.Channel._send_side

    def send_then_stall(self, *args, **kwargs):
        real(self, *args, **kwargs)
        ready.set()
        time.sleep(3600)
    _channel.Channel._send_side = send_then_stall
    queue.put(np.full(size, 7, dtype=np.int64))
