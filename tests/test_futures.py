"""ProcessPoolExecutor on shmtensor's queues: arguments and results cross through shared
memory, and everything else behaves as the stdlib's executor."""

import concurrent.futures as cf
import multiprocessing
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp
from shmtensor import futures
from shmtensor.multiprocessing._context import _ShmContext

from conftest import JOIN


def identity(x):
    return x


def fill(a, v):
    a[:] = v
    return float(a.sum())


def square(x):
    return x * x


def fail(x):
    raise ValueError(f"bad {x}")


def die(_):
    os.kill(os.getpid(), signal.SIGKILL)


def wait_for_file(path, then):
    deadline = time.monotonic() + JOIN
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    return then


def _executor(kind, method, workers=2):
    ctx = smp.get_context(method)
    if kind == "shmtensor.futures":
        return futures.ProcessPoolExecutor(workers, mp_context=ctx)
    return cf.ProcessPoolExecutor(workers, mp_context=ctx)


KINDS = ["shmtensor.futures", "stdlib executor"]


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_shared_array_goes_out_and_back_as_the_same_memory(kind, method, lc):
    with _executor(kind, method) as ex:
        a = shmtensor.zeros(1000)
        b = ex.submit(identity, a).result(timeout=JOIN)
        assert np.shares_memory(a, b)
        assert ex.submit(fill, a, 3.0).result(timeout=JOIN) == 3000.0
        assert (a == 3.0).all()  # the worker wrote into the parent's memory
        assert type(ex._call_queue) is futures._CallQueue
        plain = np.arange(100_000.0)  # a large plain array: one copy, then handles
        np.testing.assert_array_equal(ex.submit(identity, plain).result(timeout=JOIN), plain)
        del a, b


@pytest.mark.parametrize("kind", KINDS + ["stdlib"])
def test_exceptions_map_and_unpicklable_arguments_as_the_stdlibs(kind, lc):
    if kind == "stdlib":
        ex = cf.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork"))
    else:
        ex = _executor(kind, "fork")
    with ex:
        f = ex.submit(fail, 7)
        with pytest.raises(ValueError, match="bad 7") as info:
            f.result(timeout=JOIN)
        assert "raise ValueError" in str(info.value.__cause__)  # the worker's traceback
        assert list(ex.map(square, range(20), chunksize=3)) == [i * i for i in range(20)]
        assert list(ex.map(square, range(5), timeout=JOIN)) == [0, 1, 4, 9, 16]
        bad = ex.submit(identity, threading.Lock())  # fails its own future, as in the stdlib
        with pytest.raises(TypeError, match="cannot pickle"):
            bad.result(timeout=JOIN)
        assert ex.submit(square, 3).result(timeout=JOIN) == 9  # and the executor goes on


def test_shutdown_with_cancel_futures(tmp_path, lc):
    gate = str(tmp_path / "go")
    ex = futures.ProcessPoolExecutor(1, mp_context=smp.get_context("fork"))
    running = ex.submit(wait_for_file, gate, "done")
    queued = [ex.submit(square, i) for i in range(10)]
    threading.Timer(0.5, lambda: open(gate, "w").close()).start()
    ex.shutdown(wait=True, cancel_futures=True)
    assert running.result(timeout=JOIN) == "done"
    assert all(f.done() for f in queued)
    assert any(f.cancelled() for f in queued)
    for f in queued:
        if not f.cancelled():
            assert f.result() == queued.index(f) ** 2
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(square, 1)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_killed_worker_breaks_the_pool_as_in_the_stdlib(method, lc):
    ex = futures.ProcessPoolExecutor(2, mp_context=smp.get_context(method))
    try:
        assert ex.submit(square, 2).result(timeout=JOIN) == 4
        f = ex.submit(die, None)
        with pytest.raises(cf.process.BrokenProcessPool):
            f.result(timeout=JOIN)
        with pytest.raises(cf.process.BrokenProcessPool):
            ex.submit(square, 2)
    finally:
        ex.shutdown(wait=True)


def test_defaults_follow_the_stdlibs():
    ex = futures.ProcessPoolExecutor(1)
    assert isinstance(ex._mp_context, _ShmContext)
    assert ex._mp_context.get_start_method() == multiprocessing.get_start_method()
    ex.shutdown()
    if sys.version_info >= (3, 11):
        ex = futures.ProcessPoolExecutor(1, max_tasks_per_child=2)
        assert ex._mp_context.get_start_method() == "spawn"
        ex.shutdown()
    else:
        with pytest.raises(TypeError):
            futures.ProcessPoolExecutor(1, max_tasks_per_child=2)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="max_tasks_per_child is 3.11's")
def test_max_tasks_per_child(lc):
    with futures.ProcessPoolExecutor(1, max_tasks_per_child=2) as ex:
        pids = [ex.submit(os.getpid).result(timeout=JOIN) for _ in range(4)]
    assert len(set(pids)) == 2


def test_a_stdlib_queue_already_in_use_is_left_alone():
    q = cf.process._SafeQueue(ctx=multiprocessing.get_context("fork"), pending_work_items={},
                              shutdown_lock=threading.Lock(), thread_wakeup=None)
    q.put(1)
    assert not futures.adopt_call_queue(q)
    assert type(q) is cf.process._SafeQueue
    assert q.get(timeout=JOIN) == 1
    q.close()
    q.join_thread()
    assert not futures.adopt_call_queue(object())
