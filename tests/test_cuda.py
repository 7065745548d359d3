"""CUDA sharing (the CUDA issue).  Needs CuPy and a GPU: skipped cleanly elsewhere."""

import os
import pickle
import signal
import threading
import time

import numpy as np
import pytest

import shmtensor
import shmtensor.cuda
import shmtensor.multiprocessing as smp

import cuda_helpers as ch
from conftest import JOIN, join_all

pytestmark = [pytest.mark.requires_cuda,
              pytest.mark.skipif(not shmtensor.cuda.is_available(),
                                 reason="needs CuPy and a visible CUDA device")]


@pytest.fixture
def cp():
    import cupy
    cupy.zeros(1)  # initialise CUDA outside the leak checks, as the seed does
    return cupy


@pytest.fixture
def ctx():
    return smp.get_context("spawn")


@pytest.fixture(params=["ipc", "vmm"])
def kind(request, cp):
    """Where this process's CuPy arrays live: CuPy's pool (legacy CUDA IPC) or shared VMM."""
    if request.param == "vmm":
        shmtensor.cuda.set_allocator()
    yield request.param
    cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)


def test_cuda_simple_fill_and_receive(cp, ctx, lc):
    x = cp.zeros((5, 5), dtype=cp.float32)
    q, e = ctx.Queue(), ctx.Event()
    data = [x, x[:, 1]]
    q.put(data)
    p = ctx.Process(target=ch.simple_fill, args=(q, e))
    p.start()
    assert e.wait(JOIN)
    assert bool((data[0] == 4).all()) and bool((data[1] == 4).all())
    join_all(p)
    q, e = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=ch.send_array, args=(q, e, np.float32))
    p.start()
    t1, t2 = q.get(timeout=JOIN), q.get(timeout=JOIN)
    assert bool((t1 == 1).all()) and t1.data.ptr == t2.data.ptr
    del t1, t2
    e.set()
    join_all(p)
    shmtensor.cuda.ipc_collect()


def test_cuda_subclass_array_is_the_same_memory_and_class(cp, kind, ctx, lc):
    """A subclass of cupy.ndarray that keeps its pickling is sent as one (the same GPU
    memory: the child's fill is seen here) and arrives as its own class."""
    a = cp.zeros(64, dtype=cp.float32).view(type=ch.GpuTagged)
    q, done = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=ch.subclass_fill, args=(q, done))
    p.start()
    q.put(a)
    assert done.get(timeout=JOIN) == "GpuTagged"
    join_all(p)
    assert bool((a == 4).all()), "the child's fill was lost: the array arrived as a copy"


def test_cuda_array_received_through_ray_maps_once_and_goes_on_through_a_queue(cp, ctx, lc):
    """shmtensor.ray attaches through shmtensor.cuda's own table of opened handles: an
    allocation that reaches a process through a queue and through Ray is one mapping, and
    an array received through Ray can be sent on through a queue (CUDA refuses to export
    an imported handle: the message names the exporter's), arriving home as the
    exporter's own memory."""
    from shmtensor.cuda import _ipc
    from shmtensor.ray import _cupy
    q, back, report = ctx.Queue(), ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=ch.export_through_queue_and_ray, args=(q, back, report))
    p.start()
    a = q.get(timeout=JOIN)
    h = q.get(timeout=JOIN)
    b = _cupy.attach(h)  # the same allocation, already open for ``a``
    assert b.data.ptr == a.data.ptr
    assert sum(m.handle == h.ipc_handle for m in _ipc._mappings.open.values()) == 1
    b[0] = 5
    cp.cuda.get_current_stream().synchronize()
    back.put(b)
    assert report.get(timeout=JOIN) == (True, 5.0)
    del a, b
    join_all(p)


def test_cuda_memory_allocation(cp, ctx, lc):
    q, e = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=ch.send_and_delete, args=(q, e, np.int32, 5))
    p.start()
    t = [q.get(timeout=JOIN) for _ in range(5)]
    assert bool((t[0] == 0).all()) and int(t[4][0]) == 4
    del t
    e.set()
    join_all(p)


def test_cuda_ipc_deadlock(cp, ctx, lc):
    q = ctx.Queue(1)
    procs = [ctx.Process(target=ch.actor, args=(q, 100)),
             ctx.Process(target=ch.learner, args=(q, 100))]
    for p in procs:
        p.start()
    join_all(*procs)
    assert all(p.exitcode == 0 for p in procs)
    q.close()
    q.join_thread()


@pytest.mark.parametrize("mode", ["ipc", "vmm"])
def test_cuda_send_many(cp, ctx, lc, mode, count=10_000):
    q1, q2, q3 = ctx.Queue(), ctx.Queue(), ctx.Queue()
    e1, e2, e3 = ctx.Event(), ctx.Event(), ctx.Event()
    p1 = ctx.Process(target=ch.send_and_delete, args=(q1, e1, np.int64, count, 5, mode))
    p2 = ctx.Process(target=ch.receive_and_send, args=(q1, q2, e2, count, mode))
    p3 = ctx.Process(target=ch.receive_and_send_sum, args=(q2, q3, e3, np.int64, count, 5, mode))
    for p in (p1, p2, p3):
        p.start()
    result = q3.get(timeout=600)
    assert int(result[0]) == count * (count - 1) // 2
    del result
    for e in (e1, e2, e3):
        e.set()
    join_all(p1, p2, p3)


def test_ipc_arrays_after_the_first_go_without_fds_and_arrive_whole(cp, ctx, lc, counted):
    # once this process reads the queue alone and took the announce of the producer's
    # lease file, each array the producer exported goes as a record without fds (its
    # IPC handle in the record), held here as the record is taken
    n = 200
    q, e = ctx.Queue(), ctx.Event()
    q.put("join")  # this process becomes the sole reader first
    assert q.get(timeout=JOIN) == "join"
    p = ctx.Process(target=ch.send_and_delete, args=(q, e, np.int64, n, 5, "ipc"))
    p.start()
    got = [q.get(timeout=JOIN) for _ in range(n)]
    assert [int(a[0]) for a in got] == list(range(n))
    assert all(bool((a == i).all()) for i, a in enumerate(got))
    assert counted[0] >= n - 8  # all but the announce of each of its 8 lease files
    del got
    e.set()
    join_all(p)
    assert p.exitcode == 0
    q.close()


def test_ipc_evicted_mappings_are_closed_off_thread_and_taken_back(cp, ctx, lc, monkeypatch):
    """More handles than the idle limit: evicted mappings go to the closer thread, a handle
    met again is taken back from it or opened anew once closed, and every value is right."""
    from shmtensor.cuda import _ipc
    monkeypatch.setattr(_ipc, "MAPPED_IDLE_LIMIT", 8)
    monkeypatch.setattr(_ipc._mappings, "evict_at", 8)
    count, rounds = 40, 3
    q, e = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=ch.send_distinct_rounds, args=(q, e, count, rounds))
    p.start()
    try:
        for _ in range(rounds):
            for i in range(count):
                b = q.get(timeout=JOIN)
                assert float(b[0]) == i and float(b[4]) == i
                del b
        assert any(t.name == "shmtensor-cuda-close" for t in threading.enumerate())
        assert shmtensor.cuda.ipc_collect() >= 0
        assert shmtensor.debug_info()["cuda_opened"] == 0  # collect waited for the closer
    finally:
        e.set()
        join_all(p)


def test_ipc_small_arrays_of_cupys_pool_share_one_handle_and_come_back(cp, ctx, lc):
    """CuPy's pool makes each small array its own allocation unless it has a larger free
    chunk: after the first export one is left there, so the next arrays share one handle
    (the receiver opens it once); each keeps a lease of its own, so all return at the end."""
    count = 300
    q, out, e = ctx.Queue(), ctx.SimpleQueue(), ctx.Event()
    p = ctx.Process(target=ch.send_fresh_then_report, args=(q, out, e, count))
    p.start()
    try:
        got = [q.get(timeout=JOIN) for _ in range(count)]
        assert [float(b[3]) for b in got] == list(range(count))
        assert shmtensor.debug_info()["cuda_opened"] <= 3
        del got
        shmtensor.cuda.ipc_collect()  # release now, not after the releaser's pause
        e.set()
        assert out.get() == 0
    finally:
        e.set()
        join_all(p)


@pytest.mark.skipif(shmtensor.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_small_arrays_two_gpus(cp, kind, ctx, lc):
    arrays = []
    for i in range(5):
        with cp.cuda.Device(i % 2):
            arrays.append(cp.arange(i * 5.0, (i + 1) * 5))
    inq, outq = ctx.Queue(), ctx.Queue()
    inq.put(arrays)
    p = ctx.Process(target=ch.sum_on_device1, args=(inq, outq))
    p.start()
    results = [outq.get(timeout=JOIN) for _ in range(5)]
    join_all(p)
    for i, (s, device, size) in enumerate(results):
        with arrays[i].device:  # CuPy computes on the current device: make it the array's
            expected = float(arrays[i].sum())
        assert s == expected and device == i % 2 and size == 5
    del arrays


@pytest.mark.skipif(shmtensor.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_arrays_sent_alone_from_the_second_gpu(cp, kind, ctx, lc):
    """One array per message (the lane), on GPU 1, put while GPU 1 or GPU 0 is current; the
    child reads it while GPU 0 is current and sends it back: values, devices, and the
    releases on GPU 1 (the leak check) must all hold."""
    with cp.cuda.Device(1):
        arrays = [cp.arange(i * 5.0, (i + 1) * 5) for i in range(4)]
    inq, outq = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=ch.report_and_return, args=(inq, outq, len(arrays)))
    p.start()
    for i, a in enumerate(arrays):
        if i % 2:
            inq.put(a)  # GPU 0 current: the general path switches devices
        else:
            with cp.cuda.Device(1):
                inq.put(a)
    back = [outq.get(timeout=JOIN) for _ in arrays]
    join_all(p)
    for i, (device, total, b) in enumerate(back):
        assert device == 1 and b.device.id == 1
        assert total == sum(range(i * 5, (i + 1) * 5))
        with b.device:
            assert bool((b == arrays[i]).all())
    del back, b, arrays
    shmtensor.cuda.ipc_collect()


def test_cuda_event_exporter(cp, ctx, lc):
    q, ready, done = ctx.Queue(), ctx.Event(), ctx.Event()
    p = ctx.Process(target=ch.multiply_two, args=(q, ready, done))
    p.start()
    ready.wait(JOIN)
    with cp.cuda.Stream() as s:
        tensor = cp.ones((1024, 1024), dtype=cp.float32)
        event = cp.cuda.Event(interprocess=True, disable_timing=True)
        event.record(s)
        q.put((event, tensor))
        done.wait(JOIN)
        event.synchronize()  # the child recorded the event after its multiply
        assert bool((tensor == 2).all())
    join_all(p)
    del tensor, event


def test_cuda_event_importer(cp, ctx, lc):
    e0 = cp.cuda.Event(interprocess=True, disable_timing=True)
    assert e0.done
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=ch.event_importer, args=(q, out))
    p.start()
    q.put(e0)
    assert out.get(timeout=JOIN) == "ready"
    spin = cp.zeros(1, dtype=cp.float32)
    ch.slow_fill(spin, 1.0, 100_000_000)  # ~50 ms of GPU time before the record
    e0.record()
    q.put("recorded")
    assert out.get(timeout=JOIN) is True  # the child's host waited for our kernel
    assert float(spin[0]) == 1.0
    join_all(p)
    del e0, spin


@pytest.mark.skipif(shmtensor.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_event_handle_multi_gpu(cp, ctx, lc):
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=ch.event_importer, args=(q, out))  # its current device: 0
    p.start()
    with cp.cuda.Device(1):  # sent while its device is current
        e1 = cp.cuda.Event(interprocess=True, disable_timing=True)
        q.put(e1)
        assert out.get(timeout=JOIN) == "ready"
        spin = cp.zeros(1, dtype=cp.float32)
        ch.slow_fill(spin, 1.0, 100_000_000)
        e1.record()
    q.put("recorded")
    assert out.get(timeout=JOIN) is True  # device 0's process waited for device 1's kernel
    with cp.cuda.Device(1):
        assert float(spin[0]) == 1.0
    join_all(p)
    del e1, spin


def test_cuda_empty_and_mixed_dtypes(cp, ctx, lc):
    q = ctx.Queue()
    q.put([cp.empty(0), cp.empty((0, 3), dtype=cp.int8), cp.arange(4, dtype=cp.int16)])
    a, b, c = q.get(timeout=JOIN)
    assert a.shape == (0,) and b.shape == (0, 3) and b.dtype == cp.int8
    assert c.dtype == cp.int16 and int(c.sum()) == 6
    del a, b, c
    e = ctx.Event()
    p = ctx.Process(target=ch.mixed_type_producer, args=(q, e))
    p.start()
    for _ in range(10):
        f, b = q.get(timeout=JOIN), q.get(timeout=JOIN)
        assert f.dtype == cp.float32 and bool((f == 1).all())
        assert b.dtype == cp.uint8 and bool((b == 0).all())
        del f, b
        e.set()
    join_all(p)


def test_one_array_messages_keep_every_layout(cp, kind, ctx, lc):
    """An array sent alone takes its kind's lane (no pickler); views, offsets, transposes,
    0-d and odd dtypes arrive with their values and layout, and an empty one takes the
    general path."""
    base = cp.arange(60, dtype=cp.float64).reshape(6, 10)
    arrays = [base, base[:, 3], base[2:], base.T, base[1:5:2, ::3], cp.asarray(7.5),
              cp.arange(5, dtype=cp.float16), (cp.arange(6) % 2).astype(cp.bool_),
              (cp.arange(4) * (1 + 2j)).astype(cp.complex64), cp.ones((3, 1, 2), cp.int32),
              cp.empty((0, 4))]
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=ch.echo_to_host, args=(q, out, len(arrays)))
    p.start()
    try:
        for a in arrays:
            q.put(a)
            host, shape, strides, contiguous = out.get(timeout=JOIN)
            assert shape == a.shape and strides == a.strides
            assert contiguous == a.flags.c_contiguous and host.dtype == a.dtype
            assert (host == cp.asnumpy(a)).all()
    finally:
        join_all(p)


def test_cuda_bad_fork_error_at_every_entry_point(cp):
    fork = smp.get_context("fork")
    q, out = fork.Queue(), fork.Queue()
    q.put(cp.zeros(3))
    q.put(shmtensor.cuda.zeros(3))
    q.put(cp.cuda.Event(interprocess=True, disable_timing=True, block=False))
    inherited = cp.ones(3)  # the child has this object (fork), not its memory
    p = fork.Process(target=ch.bad_fork_child, args=(q, out, inherited))
    p.start()
    msgs = out.get(timeout=JOIN)
    join_all(p)
    assert len(msgs) == 5
    for msg in msgs:
        assert "Cannot re-initialize CUDA in forked subprocess" in msg, msg
        assert "spawn or forkserver" in msg, msg


_LATE_IMPORT = """
import os, socket, sys
import cupy
cupy.zeros(1)  # CUDA initialised before shmtensor was ever imported
parent_end, child_end = socket.socketpair()
pid = os.fork()
if pid == 0:
    from shmtensor import _connection  # imported only now, in the child
    try:
        _connection.Connection(os.dup(child_end.fileno())).recv()
        print("no exception")
    except RuntimeError as e:
        print(e)
    os._exit(0)
from shmtensor import _connection
_connection.Connection(os.dup(parent_end.fileno())).send(cupy.arange(3))
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_cuda_bad_fork_error_when_shmtensor_came_after_the_fork(cp):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _LATE_IMPORT], capture_output=True, text=True,
                         timeout=JOIN)
    assert out.returncode == 0, out.stderr
    assert "Cannot re-initialize CUDA in forked subprocess" in out.stdout, out.stdout


def test_cuda_finalizers_cannot_deadlock_under_gc(cp):
    import gc
    old = gc.get_threshold()
    gc.set_threshold(50, 2, 2)  # GC passes often, inside any locked section of any thread
    try:
        done, hung, errors = ch.gc_stress(seconds=8.0)
    finally:
        gc.set_threshold(*old)
    assert not errors, errors[:3]
    assert hung == 0  # a deadlock leaves threads stuck past their bound
    assert done > 100


@pytest.mark.parametrize("mode", ["ipc", "vmm"])
def test_cuda_stream_ordering_without_host_sync(cp, ctx, lc, mode):
    q = ctx.Queue()
    p = ctx.Process(target=ch.slow_writer, args=(q, 7.0, 2_000_000_000, mode))
    p.start()
    a = q.get(timeout=JOIN)
    # the writer's kernel spins ~1 s; our stream waits on its event, the host did not
    assert bool((a == 7.0).all())
    del a
    p.terminate()
    join_all(p)


def test_cuda_no_reuse_before_consumer_release(cp, kind, ctx, lc):
    q, out, e = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=ch.hold_and_report, args=(q, out, e))
    p.start()
    a = cp.full(1 << 20, 3.0, dtype=cp.float32)
    ptr = a.data.ptr
    q.put(a)
    assert out.get(timeout=JOIN) == float(3 << 20)
    del a
    b = cp.zeros(1 << 20, dtype=cp.float32)  # CuPy's pool would hand back the same block
    assert b.data.ptr != ptr  # ...but the export keeps it while the consumer holds it
    assert shmtensor.cuda.exports() and shmtensor.cuda.exports()[0]["held"]
    e.set()
    join_all(p)
    deadline = time.monotonic() + 10
    while shmtensor.cuda.ipc_collect() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not shmtensor.cuda.exports()
    del b


def test_cuda_an_array_sent_again_keeps_its_lease_when_its_receipt_home_dies(cp, kind, lc):
    """An array that came home is held by its receipt (a VMM block: by the description the
    message brought), not by the memory a message sending the original again keeps: that
    receipt dying between working out the fds and the send must leave the message its own
    lock, and a valid fd (it sent a closed or reused fd number before)."""
    import gc
    import socket

    from shmtensor import _reductions
    from shmtensor.ipc import ofd_lease, scm_rights

    a = cp.full((1000,), 7.0)
    r, w = smp.Pipe(duplex=False)
    try:
        w.send(a)
        back = r.recv()  # home again
    finally:
        r.close()
        w.close()
    data, sctx = _reductions.dumps(a)  # one array: its kind's lane
    sctx.wire_fds()  # worked out first, as when the socket is full
    table_id, slot = sctx.table_id, sctx.slot
    del back
    gc.collect()
    shmtensor.cuda.ipc_collect()  # the receipt's release has run
    other = os.open(os.devnull, os.O_RDONLY)  # takes a freed fd number, if one was freed
    s1, s2 = socket.socketpair()
    try:
        scm_rights.send_frame(s1, data, sctx.wire_fds())
        sctx.release()
        assert ofd_lease.own_table().id == table_id and ofd_lease.own_table().is_held(slot)
        got = _reductions.loads(*scm_rights.recv_frame(s2))
        assert float(got.sum()) == 7000.0 and got.data.ptr == a.data.ptr
        del got
    finally:
        os.close(other)
        s1.close()
        s2.close()


def test_cuda_consumer_sigkill_then_producer_reclaims(cp, kind, ctx, lc):
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=ch.hold_until_killed, args=(q, out))
    p.start()
    a = cp.ones(1000)
    q.put(a)
    assert out.get(timeout=JOIN) == 1000.0
    del a
    assert shmtensor.cuda.ipc_collect() == 0  # held by the live consumer
    os.kill(p.pid, signal.SIGKILL)
    p.join(JOIN)
    deadline = time.monotonic() + 10
    while shmtensor.cuda.exports() and time.monotonic() < deadline:
        shmtensor.cuda.ipc_collect()
        time.sleep(0.05)
    assert not shmtensor.cuda.exports()


def test_cuda_forwarding_through_three_processes(cp, kind, ctx, lc):
    q1, q2, out, e1, e2 = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    p2 = ctx.Process(target=ch.forward, args=(q1, q2, e1))
    p3 = ctx.Process(target=ch.hold_and_report, args=(q2, out, e2))
    p2.start()
    p3.start()
    a = cp.arange(1000, dtype=cp.float64)
    q1.put(a)
    assert out.get(timeout=JOIN) == float(sum(range(1000)))
    del a
    e1.set()
    join_all(p2)  # the forwarder is gone; the third process still holds the memory
    assert shmtensor.cuda.ipc_collect() == 0 and shmtensor.cuda.exports()[0]["held"]
    e2.set()
    join_all(p3)
    deadline = time.monotonic() + 10
    while shmtensor.cuda.exports() and time.monotonic() < deadline:
        shmtensor.cuda.ipc_collect()
        time.sleep(0.05)
    assert not shmtensor.cuda.exports()


def test_vmm_memory_outlives_its_producer(cp, ctx, lc):
    q = ctx.Queue()
    p = ctx.Process(target=ch.vmm_producer_then_exit, args=(q,))
    p.start()
    join_all(p)  # gone before anything is read
    assert p.exitcode == 0
    big, small, view, grid_t = q.get(timeout=JOIN)
    assert float(big.sum()) == 2.5 * (1 << 20)
    assert [int(a[0]) for a in small] == list(range(50)) and small[7].shape == (16,)
    expected = np.arange(48, dtype=np.float32).reshape(6, 8)
    assert view.shape == (2, 3) and view.strides == (64, 12)
    assert (cp.asnumpy(view) == expected[1:5:2, ::3]).all()
    assert grid_t.shape == (8, 6) and (cp.asnumpy(grid_t) == expected.T).all()
    info = shmtensor.debug_info()
    assert info["cuda_vmm_mapped"] == 2  # the 8 MiB slab, and one 2 MiB slab of 512 B blocks
    view[...] = 0  # writable, and still readable after the producer's exit
    assert float(grid_t.sum()) == float(expected.sum() - expected[1:5:2, ::3].sum())
    del big, small, view, grid_t
    shmtensor.cuda.ipc_collect()
    assert shmtensor.debug_info()["cuda_vmm_mapped"] == 0


def test_vmm_small_arrays_share_a_slab_and_come_back_home(cp, ctx, lc):
    arrays = [shmtensor.cuda.full((100,), i, dtype=cp.int64) for i in range(200)]
    q = ctx.Queue()
    q.put(arrays[0])
    back = q.get(timeout=JOIN)  # sent to ourselves: our own memory, not a new mapping
    assert back.data.ptr == arrays[0].data.ptr and shmtensor.debug_info()["cuda_vmm_mapped"] == 0
    del back
    out, e = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=ch.report_mapped, args=(q, out, e))
    p.start()
    q.put(arrays)
    total, mapped = out.get(timeout=JOIN)
    assert total == 100 * sum(range(200)) and mapped == 1  # 200 arrays, one 2 MiB slab
    assert shmtensor.debug_info()["cuda_vmm_slabs"] == 1
    del arrays
    e.set()
    join_all(p)
    deadline = time.monotonic() + 10
    while shmtensor.cuda.ipc_collect() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert shmtensor.debug_info()["cuda_vmm_slabs"] == 0 and not shmtensor.cuda.exports()


def test_vmm_one_array_alone_or_in_a_container_crosses_alike(cp, ctx, lc):
    from shmtensor import _reductions
    from shmtensor.cuda import _vmm
    a = shmtensor.cuda.full((1000,), 3, dtype=cp.float32)
    data, sent = _reductions.dumps(a[5:])  # alone: the lane, no pickler
    assert bytes(data[:len(_vmm.LANE)]) == _vmm.LANE
    sent.release()
    data, sent = _reductions.dumps([a])  # in a container: the general path
    assert bytes(data[:1]) == pickle.PROTO
    sent.release()
    q = ctx.Queue()
    q.put(a[5:])
    q.put([a, a[10:20]])
    alone, (whole, view) = q.get(timeout=JOIN), q.get(timeout=JOIN)
    assert alone.data.ptr == a.data.ptr + 20 and view.data.ptr == a.data.ptr + 40
    assert alone.shape == (995,) and float(whole.sum()) == 3000.0
    out, e = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=ch.report_sums, args=(q, out, e))
    p.start()
    q.put(a[5:])
    q.put([a, a[10:20]])
    assert out.get(timeout=JOIN) == (2985.0, 3000.0, 30.0)
    block = a.data.mem._owner
    slot = block.slab.slots[block.index]
    from shmtensor.ipc import ofd_lease
    assert ofd_lease.own_table().is_held(slot)  # the child still holds what it got
    e.set()
    join_all(p)
    del alone, whole, view
    deadline = time.monotonic() + 10
    while ofd_lease.own_table().is_held(slot) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not ofd_lease.own_table().is_held(slot)
    del a


def test_vmm_two_receipts_of_one_block_are_two_holds(cp, ctx, lc):
    # Each received array owns one counted hold on its block: a consumer that received the
    # same block twice keeps it held until it has let go of both.
    from shmtensor.ipc import ofd_lease
    a = shmtensor.cuda.full((1000,), 2, dtype=cp.float32)
    block = a.data.mem._owner
    q, out, step, done = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    p = ctx.Process(target=ch.receive_twice_release_in_turn, args=(q, out, step, done))
    p.start()
    q.put(a)
    q.put(a)
    assert out.get(timeout=JOIN) == 4000.0
    slot = block.slab.slots[block.index]
    del a, block
    table = ofd_lease.own_table()
    step.set()
    assert out.get(timeout=JOIN) == "first"
    assert table.is_held(slot)  # the second receipt still holds it
    done.set()
    assert out.get(timeout=JOIN) == "second"
    deadline = time.monotonic() + 10
    while table.is_held(slot) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not table.is_held(slot)
    join_all(p)


def test_vmm_a_mapping_is_pinned_while_a_message_is_built_on_it(cp, ctx, lc, monkeypatch):
    from shmtensor.ipc import ofd_lease
    from shmtensor.cuda import _vmm
    q, e = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=ch.send_one_shared, args=(q, e))
    p.start()
    real = ofd_lease.hold

    def evicting(*args, **kwargs):
        _vmm._evict(0, 0)  # what another thread's drain may do meanwhile
        return real(*args, **kwargs)

    monkeypatch.setattr(ofd_lease, "hold", evicting)
    a = q.get(timeout=JOIN)
    monkeypatch.undo()
    assert shmtensor.debug_info()["cuda_vmm_mapped"] == 1  # the new mapping stayed
    assert float(a.sum()) == 7000.0
    del a
    e.set()
    join_all(p)


@pytest.mark.parametrize("stream", ["null", "per-thread default", "user"])
def test_cuda_release_waits_for_the_receivers_stream(cp, ctx, stream):
    from shmtensor.ipc import ofd_lease
    a = shmtensor.cuda.zeros(1024, dtype=cp.float32)
    block = a.data.mem._owner
    q = ctx.SimpleQueue()
    q.put(a)
    b = q.get()  # our own memory, held through our own lease table as any receiver holds it
    slot = block.slab.slots[block.index]
    s = {"null": cp.cuda.Stream.null, "per-thread default": cp.cuda.Stream.ptds,
         "user": cp.cuda.Stream(non_blocking=True)}[stream]
    with s:
        ch.slow_fill(b, 5.0, 1_000_000_000)  # ~0.5 s of GPU time on that stream
        del b  # released only once that work is done, whoever flushes the release
    time.sleep(0.2)
    from shmtensor.cuda import _release
    _release.drain(block=False)
    assert ofd_lease.own_table().is_held(slot)  # the kernel still runs
    s.synchronize()
    deadline = time.monotonic() + 10
    while ofd_lease.own_table().is_held(slot) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not ofd_lease.own_table().is_held(slot)
    assert float(a[0]) == 5.0
    del a


def test_importing_shmtensor_does_not_initialise_cuda():
    import subprocess
    import sys
    code = ("import shmtensor, shmtensor.cuda, shmtensor.multiprocessing, sys; "
            "n = shmtensor.cuda.device_count(); "
            "from shmtensor.ipc import cuda_ipc; print(n, cuda_ipc.cuda_initialized(), 'cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60).stdout.split()
    assert int(out[0]) >= 1 and out[1] == "False" and out[2] == "False"


def test_importing_shmtensor_after_cupy_does_not_initialise_cuda():
    """CuPy's reducers register at once when CuPy came first, without a driver call: a
    parent that then forks workers stays fork-safe, and the arrays still cross."""
    import subprocess
    import sys
    code = ("import cupy, sys\n"
            "import shmtensor, shmtensor.multiprocessing as smp\n"
            "from shmtensor.ipc import cuda_ipc\n"
            "print(cuda_ipc.cuda_initialized())\n"
            "q = smp.get_context('spawn').SimpleQueue()\n"
            "q.put(cupy.arange(3)); print(int(q.get().sum()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "3"]


def test_a_ray_handle_maps_as_a_queue_message_does_and_comes_home_as_itself(cp, lc):
    # shmtensor.ray's CuPy handle goes through the queues' receive (no Ray needed to make
    # or attach one): another process maps it; its exporter gets its own memory; a view
    # outside the allocation is refused
    from shmtensor.ray import _cupy
    a = cp.arange(1000, dtype=cp.float32).reshape(10, 100)
    h, token = _cupy.handle_of(cp, a, "node")
    ctx = smp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=ch.attach_ray_handle, args=(there,))
    p.start()
    try:
        here.send(h)
        assert here.recv() == 499500.0
        for offset in (-4096, h.size):
            here.send(h._replace(offset=offset))
            assert "outside its memory" in here.recv()
        here.send(None)
        join_all(p)
        assert p.exitcode == 0
    finally:
        os.close(h.lease_fd)
    home = _cupy.attach(h)
    assert home.data.ptr == a.data.ptr and float(home.sum()) == 499500.0
    del home, token
