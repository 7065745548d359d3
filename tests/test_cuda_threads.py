"""CUDA arrays and events sent and received by threads that never touched CUDA (a pool's
task thread, an executor's queue thread, a user's thread), and events sent while another
GPU is current.  Needs CuPy and a GPU (two for the last tests): skipped elsewhere."""

import subprocess
import sys

import numpy as np
import pytest

import shmtensor.cuda
import shmtensor.futures
import shmtensor.multiprocessing as smp

import cuda_helpers as ch
from conftest import JOIN, join_all

pytestmark = [pytest.mark.requires_cuda,
              pytest.mark.skipif(not shmtensor.cuda.is_available(),
                                 reason="needs CuPy and a visible CUDA device")]
two_gpus = pytest.mark.skipif(shmtensor.cuda.device_count() < 2, reason="needs two GPUs")


# the fixtures of the CUDA tests: CUDA initialised in the main thread, the spawn context,
# and where CuPy allocates (its pool or shared VMM)
from test_cuda import cp, ctx, kind  # noqa: E402,F401


@pytest.mark.parametrize("channel", ["queue", "pipe"])
def test_arrays_and_events_sent_from_a_thread_that_never_touched_cuda(cp, kind, ctx, lc,
                                                                      channel):
    a = cp.arange(10, dtype=cp.float64)
    ev = cp.cuda.Event(interprocess=True, disable_timing=True)
    out = ctx.Queue()
    if channel == "queue":
        source = sink = ctx.Queue()
        send = sink.put
    else:
        source, sink = ctx.Pipe(duplex=False)
        send = sink.send
    p = ctx.Process(target=ch.describe_each, args=(source, out, 3))
    p.start()
    try:
        ch.in_fresh_thread(send, a)  # alone: its kind's lane
        ch.in_fresh_thread(send, [a, a[2:], ev])  # in a container: the general path
        ch.in_fresh_thread(send, cp.arange(4, dtype=cp.float32))  # a new allocation
        assert out.get(timeout=JOIN) == (0, 45.0)
        assert out.get(timeout=JOIN) == [(0, 45.0), (0, 44.0), "event"]
        assert out.get(timeout=JOIN) == (0, 6.0)
    except BaseException:
        p.kill()  # it waits for messages that will not come
        raise
    finally:
        join_all(p)
    assert p.exitcode == 0
    del a, ev
    shmtensor.cuda.ipc_collect()


def test_arrays_received_in_a_thread_that_never_touched_cuda(cp, kind, ctx, lc):
    q, e = ctx.Queue(), ctx.Event()
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=ch.send_then_wait, args=(q, w, e, kind))
    p.start()
    try:
        for get in (lambda: q.get(timeout=JOIN), r.recv):
            assert ch.in_fresh_thread(lambda: ch.describe(get())) == (0, 45.0)
            assert ch.in_fresh_thread(lambda: ch.describe(get())) == [(0, 45.0), (0, 44.0)]
    finally:
        e.set()
        join_all(p)
    assert p.exitcode == 0
    shmtensor.cuda.ipc_collect()


def test_pool_map_over_cupy_arrays(cp, kind, ctx, lc):
    """The pool's task thread pickles the arrays: it never made a CUDA call."""
    arrays = [cp.full((100,), i, dtype=cp.float32) for i in range(8)]
    with ctx.Pool(2) as pool:
        assert pool.map(ch.total, arrays, chunksize=1) == [100.0 * i for i in range(8)]
        assert pool.map(ch.total, arrays, chunksize=3) == [100.0 * i for i in range(8)]
    pool.join()
    del arrays
    shmtensor.cuda.ipc_collect()


def test_process_pool_executor_with_cupy_arguments_and_results(cp, kind, ctx, lc):
    """Calls are queued by the executor's manager thread and results received there: neither
    ever made a CUDA call."""
    arrays = [cp.arange(50, dtype=cp.float64) + i for i in range(6)]
    with shmtensor.futures.ProcessPoolExecutor(2, mp_context=ctx, initializer=ch.use,
                                               initargs=(kind,)) as ex:
        futures = [ex.submit(ch.doubled, a) for a in arrays]
        results = [f.result(timeout=JOIN) for f in futures]
        for a, b in zip(arrays, results):
            assert isinstance(b, cp.ndarray) and bool((b == 2 * a).all())
        del results, futures, b  # before the workers, which made them, go
        shmtensor.cuda.ipc_collect()
    del arrays
    shmtensor.cuda.ipc_collect()


_CHILD = ("import sys; sys.path[:0] = {paths!r}\n"
          "import cuda_helpers as ch\n"
          "ch.{function}({args})\n"
          "print('ok')\n")


def _in_child(function, *args):
    """``cuda_helpers.function(*args)`` in a new Python process, which the driver may crash:
    its stdout, after checking that it printed ok and exited with 0.  In a session of its
    own, killed with all it started once it ends: a receiver it spawned would otherwise
    wait on for a sender that crashed."""
    import os
    import signal
    import tempfile
    paths = [os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))]
    code = _CHILD.format(paths=paths, function=function, args=", ".join(map(repr, args)))
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=err, text=True,
                             start_new_session=True)
        try:
            p.wait(timeout=180)
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:  # nothing of it left
                pass
            p.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    assert p.returncode == 0 and stdout.split()[-1:] == ["ok"], (p.returncode, stderr[-2000:])
    return stdout


@two_gpus
@pytest.mark.parametrize("in_thread", [False, True], ids=["device0-current", "new-thread"])
def test_event_of_one_gpu_sent_while_another_is_current(in_thread):
    """Asked for the handle of another device's event, the driver crashes the process: run
    in a child, so that a crash is a failure here.  The event recorded the device it was
    made on (shmtensor was imported first, CuPy after), and its handle is asked there."""
    _in_child("event_on_device1_sent_while_device0_is_current", in_thread)


@two_gpus
def test_event_made_before_shmtensor_is_refused_with_two_gpus_in_use():
    """An event made before ``import shmtensor`` did not record its device: with both GPUs'
    contexts active it is refused before any driver call (no crash), with the fix; one
    made after is sent."""
    stdout = _in_child("event_made_before_shmtensor")
    refused = [line for line in stdout.splitlines() if line.startswith("refused: ")]
    assert len(refused) == 1, stdout
    assert "its device was not recorded (it was made before `import shmtensor`)" in refused[0]
    assert "several GPUs ([0, 1])" in refused[0]
    assert "Make the event after `import shmtensor`" in refused[0]
    assert "sent: made after" in stdout


def test_events_record_their_device(cp):
    """Every CuPy event made after ``import shmtensor``, by the user or by CuPy itself
    (``Stream.record``), records its device, in any thread; one wrapper, one class."""
    assert cp.cuda.Event is cp.cuda.stream.Event
    init = cp.cuda.Event.__init__
    assert init._shmtensor_records_device and not hasattr(init.__wrapped__, "__wrapped__")
    from shmtensor.cuda import _events
    _events.record_devices(cp)
    assert cp.cuda.Event.__init__ is init
    devices = range(min(shmtensor.cuda.device_count(), 2))
    for device in devices:
        with cp.cuda.Device(device):
            made = [cp.cuda.Event(), cp.cuda.Event(interprocess=True, disable_timing=True),
                    cp.cuda.Stream().record(), ch.in_fresh_thread(ch.event_on, device)]
            assert [e._shmtensor_device for e in made] == [device] * 4


def test_current_context_costs_one_call_when_current(cp):
    """The mechanism behind every driver call on an array's behalf: pushed only where the
    thread has no (or another) context, and popped after; a no-op where current."""
    from shmtensor.ipc import cuda_ipc
    assert ch.has_current_context()
    with cuda_ipc.Current(0) as lib:
        assert lib is not None
    c = cuda_ipc.Current(0)
    with c:
        assert not c.pushed  # the main thread's context is device 0's primary one

    def fresh():
        c = cuda_ipc.Current(0)
        with c:
            inside = ch.has_current_context(), c.pushed
        return inside, ch.has_current_context()

    assert ch.in_fresh_thread(fresh) == ((True, True), False)
    a = cp.arange(3)
    here = cuda_ipc.address_range(a.data.ptr)
    assert ch.in_fresh_thread(lambda: _range_under_current(cuda_ipc, a)) == here


def _range_under_current(cuda_ipc, a):
    with cuda_ipc.Current(a.device.id):
        return cuda_ipc.address_range(a.data.ptr)
