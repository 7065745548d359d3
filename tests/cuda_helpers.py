"""Process targets for the CUDA tests (spawned children import this)."""

import time

import numpy as np


def cp():
    import cupy
    return cupy


def __getattr__(name):
    """``GpuTagged``: a subclass of cupy.ndarray, made on first use (this module is
    imported where CuPy is not installed)."""
    if name != "GpuTagged":
        raise AttributeError(name)

    class GpuTagged(cp().ndarray):
        pass

    GpuTagged.__module__, GpuTagged.__qualname__ = __name__, "GpuTagged"
    globals()["GpuTagged"] = GpuTagged
    return GpuTagged


def use(kind):
    """Allocate CuPy arrays in shared VMM memory when ``kind`` is "vmm"."""
    if kind == "vmm":
        import shmtensor.cuda
        shmtensor.cuda.set_allocator()


def simple_fill(queue, event):
    data = queue.get()
    data[0][:] = 4
    cp().cuda.get_current_stream().synchronize()
    event.set()


def subclass_fill(queue, done):
    """Fill a received CuPy subclass array with 4; report its type's name."""
    a = queue.get()
    a[:] = 4
    cp().cuda.get_current_stream().synchronize()
    done.put(type(a).__name__)


def export_through_queue_and_ray(q, back, report):
    """Put one CuPy array on ``q``, then the handle ``shmtensor.ray`` would carry for the
    same allocation (``_cupy.handle_of``, as its serializer makes it, without a Ray
    cluster); report whether the array that comes back on ``back`` is this process's own
    memory, and its first element."""
    import os
    from shmtensor.ray import _cupy
    c = cp()
    a = c.arange(256, dtype=c.float32)
    h, token = _cupy.handle_of(c, a, "node")  # token: kept while h may be unsent
    q.put(a)
    q.put(h)
    got = back.get(timeout=60)
    report.put((got.data.ptr == a.data.ptr, float(got[0])))
    del got
    os.close(h.lease_fd)
    del token


def send_array(queue, event, dtype):
    t = cp().ones((5, 5), dtype=dtype)
    queue.put(t)
    queue.put(t)
    event.wait(60)


def send_and_delete(queue, event, dtype, count, size=5, kind="ipc"):
    use(kind)
    for i in range(count):
        t = cp().full([size], i, dtype=dtype)
        queue.put(t)
        del t
    event.wait(120)


def receive_and_send_sum(queue, out_queue, event, dtype, count, size=5, kind="ipc"):
    use(kind)
    s = cp().zeros([size], dtype=dtype)
    for _ in range(count):
        s += queue.get()
    out_queue.put(s)
    event.wait(120)


def receive_and_send(queue, out_queue, event, count, kind="ipc"):
    use(kind)
    for _ in range(count):
        t = queue.get()
        out_queue.put(t.copy())
    event.wait(120)


def forward(queue, out_queue, event):
    t = queue.get()
    out_queue.put(t)  # the very array received: forwarded, not copied
    del t
    event.wait(60)


def hold_and_report(queue, out, event):
    t = queue.get()
    out.put(float(t.sum()))
    event.wait(60)
    del t


def send_one_shared(queue, event):
    import shmtensor.cuda
    queue.put(shmtensor.cuda.full((1000,), 7.0))
    event.wait(60)


def report_sums(queue, out, event):
    alone = queue.get()
    whole, view = queue.get()
    out.put((float(alone.sum()), float(whole.sum()), float(view.sum())))
    event.wait(60)  # holding all three until told


def receive_twice_release_in_turn(queue, out, step, done):
    """Hold two receipts of one block, then let go of them one at a time."""
    import shmtensor.cuda
    first, second = queue.get(), queue.get()
    out.put(float(first.sum()) + float(second.sum()))
    for event, name in ((step, "first"), (done, "second")):
        event.wait(60)
        if name == "first":
            del first
        else:
            del second
        shmtensor.cuda.ipc_collect()  # drains the release now
        out.put(name)
    done.wait(60)


def hold_until_killed(queue, out):
    t = queue.get()
    out.put(float(t.sum()))
    time.sleep(600)


def actor(queue, iterations):
    for _ in range(iterations):
        if not queue.empty():
            queue.get()
        time.sleep(0.01)


def learner(queue, iterations):
    import copy
    state = {"w": cp().ones((64, 64)), "b": cp().zeros(64)}
    for _ in range(iterations):
        if not queue.full():
            queue.put(copy.deepcopy(state))
        time.sleep(0.01)


def mixed_type_producer(queue, event):
    for _ in range(10):
        queue.put(cp().ones((2, 2), dtype=np.float32))
        queue.put(cp().zeros((2, 2), dtype=np.uint8))
        event.wait(60)
        event.clear()


def multiply_two(queue, ready, done):
    ready.set()
    with cp().cuda.Stream():
        event, tensor = queue.get()
        event.wait()
        tensor *= 2
        event.record()
        done.set()


def sum_on_device1(inq, outq):
    with cp().cuda.Device(1):  # received while device 1 is current...
        arrays = inq.get()
        for a in arrays:
            with a.device:  # ...each array is on its own device (CuPy computes there)
                outq.put((float(a.sum()), a.device.id, a.size))


def report_and_return(inq, outq, count):
    """Receive ``count`` arrays one at a time while device 0 is current; send back each
    one's device, its sum and the array itself (a forward of what was received)."""
    for _ in range(count):
        a = inq.get()
        with a.device:
            total = float(a.sum())
        outq.put((a.device.id, total, a))
        del a


def bad_fork_child(queue, out, inherited):
    """In a forked child of a CUDA parent: every shmtensor CUDA entry point says fork."""
    import shmtensor.cuda
    import shmtensor.multiprocessing as smp
    msgs = []
    sq = smp.get_context("fork").SimpleQueue()  # pickles in put(), as the stdlib's does
    attempts = {"receive a legacy IPC array": queue.get, "receive a VMM array": queue.get,
                "receive an event": queue.get, "send": lambda: sq.put(inherited),
                "ipc_collect": shmtensor.cuda.ipc_collect}
    for what, attempt in attempts.items():
        try:
            attempt()
            msgs.append(f"{what}: no exception")
        except RuntimeError as e:
            msgs.append(f"{what}: {e}")
    out.put(msgs)


def gc_stress(seconds, threads=8):
    """``threads`` threads make, send, receive and drop CuPy arrays (both allocators) on one
    queue while others force GC passes: returns the arrays that went round."""
    import gc
    import threading

    import shmtensor.cuda
    import shmtensor.multiprocessing as smp
    q = smp.get_context("spawn").SimpleQueue()
    lock = threading.Lock()
    done = [0]
    stop = time.monotonic() + seconds
    errors = []

    class Cycle:  # garbage in reference cycles: only a GC pass frees it, on any thread
        def __init__(self, a):
            self.a, self.me = a, self

    def work(i):
        try:
            while time.monotonic() < stop:
                if i % 2:
                    a = shmtensor.cuda.full((i + 1) * 64, float(i), dtype="float32")
                else:
                    a = cp().full((i + 1) * 64, float(i), dtype="float32")
                with lock:
                    q.put([a, a[1:]])
                    b, v = q.get()
                assert float(b[0]) == float(v[0]) == float(i)  # it may be another thread's
                Cycle(b), Cycle(v)
                del a, b, v
                if i == 0:
                    gc.collect()
                done[0] += 1
        except BaseException as e:  # reported to the test
            errors.append(repr(e))

    ts = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(seconds + 60)
    hung = sum(t.is_alive() for t in ts)
    gc.collect()
    shmtensor.cuda.ipc_collect()
    return done[0], hung, errors


_SLOW_FILL = r'''
extern "C" __global__ void slow_fill(float* x, int n, float v, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}'''


def slow_fill(a, value, cycles):
    """Queue a kernel that spins ``cycles`` GPU clocks, then fills float32 ``a``."""
    kernel = cp().RawKernel(_SLOW_FILL, "slow_fill")
    kernel(((a.size + 255) // 256,), (256,), (a, np.int32(a.size), np.float32(value),
                                              np.int64(cycles)))


def slow_writer(queue, value, cycles, kind="ipc"):
    """Launch a kernel that spins, then writes, and send the array without host sync."""
    use(kind)
    a = cp().zeros(1024, dtype=np.float32)
    slow_fill(a, value, cycles)
    queue.put(a)  # no synchronize: ordering comes from the interprocess event
    time.sleep(30)


def event_importer(queue, out):
    """Receive the parent's event, say ready, wait for its record, then check it on the host."""
    event = queue.get(timeout=60)
    out.put("ready")
    assert queue.get(timeout=60) == "recorded"
    event.synchronize()
    out.put(event.query())


def vmm_producer_then_exit(queue):
    """Send shared-memory arrays and exit at once: the consumer reads after we are gone."""
    import shmtensor.cuda
    big = shmtensor.cuda.full((1 << 20,), 2.5, dtype=np.float64)  # 8 MiB: a slab of its own
    small = [shmtensor.cuda.full((16,), i, dtype=np.int32) for i in range(50)]
    grid = shmtensor.cuda.empty((6, 8), dtype=np.float32)
    grid[...] = cp().arange(48, dtype=np.float32).reshape(6, 8)
    queue.put((big, small, grid[1:5:2, ::3], grid.T))
    queue.close()
    queue.join_thread()


def report_mapped(queue, out, event):
    import shmtensor
    arrays = queue.get()
    out.put((sum(int(a.sum()) for a in arrays), shmtensor.debug_info()["cuda_vmm_mapped"]))
    event.wait(60)
    del arrays


def send_distinct_rounds(queue, event, count, rounds):
    """Keep ``count`` arrays of CuPy's pool (one allocation, one handle each) and send them
    all, ``rounds`` times over."""
    cupy = cp()
    arrays = [cupy.full((5,), i, cupy.float32) for i in range(count)]
    for _ in range(rounds):
        for a in arrays:
            queue.put(a)
    event.wait()


def send_fresh_then_report(queue, out, event, count):
    """Make and send ``count`` small arrays of CuPy's pool one by one (keeping them); once
    ``event`` is set, drop them and report how many chunks are still kept for others."""
    import shmtensor.cuda
    cupy = cp()
    kept = []
    for i in range(count):
        kept.append(cupy.full((5,), i, cupy.float32))
        queue.put(kept[-1])
    event.wait()
    del kept
    deadline = time.monotonic() + 30
    while shmtensor.cuda.exports() and time.monotonic() < deadline:
        shmtensor.cuda.ipc_collect()
        time.sleep(0.05)
    out.put(len(shmtensor.cuda.exports()))


def echo_to_host(queue, out, count):
    """Receive ``count`` arrays, one per message, and send back each one's host copy,
    shape, strides and whether it is C-contiguous."""
    cupy = cp()
    for _ in range(count):
        a = queue.get(timeout=60)
        out.put((cupy.asnumpy(a), a.shape, a.strides, a.flags.c_contiguous))
        del a


# --- threads that never touched CUDA (test_cuda_threads.py) ---

def has_current_context() -> bool:
    """Whether the calling thread has a current CUDA context (a new thread has none)."""
    import ctypes
    ctx = ctypes.c_void_p()
    ctypes.CDLL("libcuda.so.1").cuCtxGetCurrent(ctypes.byref(ctx))
    return bool(ctx.value)


def in_fresh_thread(fn, *args):
    """``fn(*args)`` in a new thread, which must start with no CUDA context: its result, or
    the exception it raised, raised here."""
    import threading
    box = {}

    def run():
        try:
            assert not has_current_context(), "a new thread already had a CUDA context"
            box["value"] = fn(*args)
        except BaseException as e:  # handed to the caller
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the thread did not finish"
    if "error" in box:
        raise box["error"]
    return box["value"]


def describe(obj):
    """Host values of what arrived: arrays as (device, sum), events as "event"."""
    if isinstance(obj, (list, tuple)):
        return [describe(o) for o in obj]
    if type(obj).__name__ == "IpcEvent":
        return "event"
    return (obj.device.id, float(obj.sum()))


def describe_each(source, out, count):
    """Receive ``count`` messages from a queue or a connection; report what arrived."""
    get = getattr(source, "get", None) or source.recv
    for _ in range(count):
        out.put(describe(get()))


def total(a):
    return float(a.sum())


def doubled(a):
    return a * 2


def send_then_wait(queue, conn, event, kind):
    """Send arrays alone and in a list by a queue and a connection; keep them until told."""
    use(kind)
    a = cp().arange(10, dtype=np.float64)
    for channel in (queue.put, conn.send):
        channel(a)
        channel([a, a[2:]])
    event.wait(60)


def event_on_device1_sent_while_device0_is_current(in_thread):
    """Make an interprocess event on GPU 1, send it while GPU 0 is current (or from a new
    thread), record it after a slow kernel; the receiver (GPU 0) waits for that kernel."""
    import shmtensor.multiprocessing as smp
    ctx = smp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=event_importer, args=(q, out))
    p.start()
    with cp().cuda.Device(1):
        e1 = cp().cuda.Event(interprocess=True, disable_timing=True)
        spin = cp().zeros(1, dtype=np.float32)
    if in_thread:
        in_fresh_thread(q.put, e1)
    else:
        with cp().cuda.Device(0):
            q.put(e1)
    assert out.get(timeout=60) == "ready"
    with cp().cuda.Device(1):
        slow_fill(spin, 1.0, 100_000_000)
        e1.record()
    q.put("recorded")
    assert out.get(timeout=60) is True  # GPU 0's process waited for GPU 1's kernel
    with cp().cuda.Device(1):
        assert float(spin[0]) == 1.0
    p.join(60)
    assert p.exitcode == 0


def event_on(device):
    """An interprocess event made on ``device`` (in a thread that may have no context)."""
    with cp().cuda.Device(device):
        return cp().cuda.Event(interprocess=True, disable_timing=True)


def event_made_before_shmtensor():
    """Make an event on GPU 1 before importing shmtensor, use both GPUs, then send it and
    one made after; prints what each send did (run in a fresh process)."""
    import cupy
    with cupy.cuda.Device(1):
        early = cupy.cuda.Event(interprocess=True, disable_timing=True)
    cupy.zeros(1)  # GPU 0's context is active too
    import shmtensor.multiprocessing as smp
    from shmtensor.ipc import cuda_ipc
    r, w = smp.Pipe(duplex=False)
    try:
        w.send(early)
        print("sent: made before")
    except cuda_ipc.CudaIpcError as e:
        print(f"refused: {e}")
    with cupy.cuda.Device(1):
        late = cupy.cuda.Event(interprocess=True, disable_timing=True)
    w.send(late)  # GPU 0 is current
    print("sent: made after")
    r.close()
    w.close()


def event_creation_cost(rounds=7, n=20000):
    """Microseconds per ``cupy.cuda.Event()`` (made and destroyed), plain and interprocess,
    with shmtensor's device-recording ``__init__`` and with CuPy's own: the best of
    ``rounds`` alternating rounds of ``n`` events."""
    import shmtensor  # noqa: F401 (installs the recording __init__)
    cupy = cp()
    cupy.zeros(1)
    cls = cupy.cuda.Event
    wrapped, plain = cls.__init__, cls.__init__.__wrapped__
    best = {}
    try:
        for _ in range(rounds):
            for name, init in (("shmtensor", wrapped), ("cupy", plain)):
                cls.__init__ = init
                for kind, kwargs in (("plain", {}),
                                     ("interprocess", {"interprocess": True,
                                                       "disable_timing": True})):
                    t = time.perf_counter()
                    for _ in range(n):
                        cls(**kwargs)
                    us = (time.perf_counter() - t) / n * 1e6
                    key = f"{kind} {name}"
                    best[key] = min(best.get(key, us), us)
    finally:
        cls.__init__ = wrapped
    return best


def attach_ray_handle(conn):
    """Attach the shmtensor.ray CuPy handles ``conn`` sends (no Ray needed), answering each
    with the array's sum, or the ValueError's message."""
    import cupy  # noqa: F401 (first: the attach needs it imported)
    from shmtensor.ray import _cupy
    while True:
        h = conn.recv()
        if h is None:
            break
        try:
            a = _cupy.attach(h)
            conn.send(float(a.sum()))
            del a
        except ValueError as e:
            conn.send(str(e))
