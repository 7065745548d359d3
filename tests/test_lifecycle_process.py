"""Processes: a Process subclass's state crosses through shmtensor under every start method,
one message may carry one fd several times (a BatchPool's slots share one file), and
``spawn`` stops hung ranks after its timeout."""

import os
import time

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp

from conftest import JOIN, START_METHODS, join_all


class _Writer:
    """Writes 7 into every array it keeps as an attribute, then reports what it saw."""

    def __init__(self, shared, plain, views, out):
        super().__init__()
        self.shared, self.plain, self.views, self.out = shared, plain, views, out
        self.me = self  # a cycle through the process itself

    def run(self):
        for a in (self.shared, self.plain, *self.views):
            a[...] = 7
        self.out.put((self.me is self, shmtensor.is_shared(self.shared)))


class ForkWriter(_Writer, smp.ForkContext.Process):
    pass


class SpawnWriter(_Writer, smp.SpawnContext.Process):
    pass


class ForkServerWriter(_Writer, smp.ForkServerContext.Process):
    pass


WRITERS = {"fork": ForkWriter, "spawn": SpawnWriter, "forkserver": ForkServerWriter}


@pytest.mark.parametrize("method", START_METHODS)
def test_a_process_subclass_keeps_its_shared_arrays(method, strategy, lc):
    ctx = smp.get_context(method)
    shared = shmtensor.zeros(100_000)
    plain = np.zeros(100_000)  # not shared: a copy in a spawned child, as with the stdlib
    with shmtensor.BatchPool((10,), np.int64, slots=2) as pool:
        views = [pool.acquire(timeout=JOIN), pool.acquire(timeout=JOIN)]  # one file: one fd
        out = ctx.SimpleQueue()
        p = WRITERS[method](shared, plain, views, out)
        p.start()
        lc.check_pid(p.pid)
        got = out.get()
        join_all(p)
        assert p.exitcode == 0
        assert got == (True, True)
        assert (shared == 7).all()
        assert all((v == 7).all() for v in views)
        assert (plain == 0).all()
        del views
        out.close()


def _report_acquire(pool, out):
    try:
        pool.acquire(timeout=5)
        out.put("acquired")
    except Exception as e:
        out.put(f"{type(e).__name__}: {e}")


@pytest.mark.parametrize("method", START_METHODS)
def test_a_batch_pool_sent_to_a_worker_says_where_to_make_it(method, strategy, lc):
    ctx = smp.get_context(method)
    with shmtensor.BatchPool((4, 4), slots=3) as pool:
        out = ctx.SimpleQueue()
        p = ctx.Process(target=_report_acquire, args=(pool, out))
        p.start()
        lc.check_pid(p.pid)
        msg = out.get()
        join_all(p)
        out.close()
    assert p.exitcode == 0
    assert msg.startswith(f"RuntimeError: this BatchPool was made in another process (pid "
                          f"{os.getpid()}): create the BatchPool inside the worker"), msg


def _rank_sleeps(rank, hung):
    if rank in hung:
        time.sleep(JOIN)


def _rank_ignores_sigterm(rank):
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(JOIN)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("fn, args, hung", [(_rank_sleeps, ({1, 2},), [1, 2]),
                                            (_rank_ignores_sigterm, (), [0, 1, 2])])
def test_spawn_stops_hung_ranks_after_its_timeout(fn, args, hung, lc):
    with pytest.raises(smp.ProcessTimeoutError) as info:
        smp.spawn(fn, args, nprocs=3, timeout=3)
    e = info.value
    assert isinstance(e, TimeoutError) and isinstance(e, smp.ProcessException)
    assert e.ranks == hung and e.error_index == hung[0] and e.pid == e.pids[0]
    assert "timed out after 3s" in str(e)
    for rank, pid in zip(hung, e.pids):
        assert f"{rank} (pid {pid})" in str(e)
        assert _gone(pid)


def test_spawn_timeout_is_checked_and_does_not_hide_a_failure(lc):
    with pytest.raises(ValueError, match="timeout is a number of seconds"):
        smp.spawn(_rank_sleeps, ((),), nprocs=1, timeout=0)
    with pytest.raises(ValueError, match="join=False"):
        smp.spawn(_rank_sleeps, ((),), nprocs=1, join=False, timeout=1)
    smp.spawn(_rank_sleeps, ((),), nprocs=2, timeout=JOIN)  # done well before: returns
    with pytest.raises(smp.ProcessRaisedException, match="ZeroDivisionError"):
        smp.spawn(_rank_divides, (), nprocs=2, timeout=JOIN)


def _rank_divides(rank):
    if rank == 1:
        1 / 0
    time.sleep(JOIN)
