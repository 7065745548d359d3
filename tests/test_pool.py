"""Pools, spawn(), batch pools and data loaders (the pool issue)."""

import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp

import helpers
from conftest import JOIN, START_METHODS, join_all


@pytest.mark.parametrize("method", START_METHODS)
def test_pool_semantics_match_stdlib(method, lc):
    ours, theirs = smp.get_context(method), multiprocessing.get_context(method)
    results = []
    for ctx in (ours, theirs):
        with ctx.Pool(2, initializer=helpers.set_init, initargs=(7,)) as pool:
            r = {
                "map": pool.map(helpers.square, range(10)),
                "imap": list(pool.imap(helpers.square, range(10), chunksize=3)),
                "unordered": sorted(pool.imap_unordered(helpers.square, range(10))),
                "starmap": pool.starmap(helpers.add, [(1, 2), (3, 4)]),
                "apply": pool.apply_async(helpers.add, (5, 6)).get(JOIN),
                "init": {v for v, _ in pool.map(helpers.get_init, range(4))},
            }
            with pytest.raises(ValueError, match="bad 3"):
                pool.apply(helpers.raise_value_error, (3,))
            results.append(r)
        pool.join()
    assert results[0] == results[1]


def test_maxtasksperchild_replaces_workers(lc):
    with smp.get_context("spawn").Pool(1, maxtasksperchild=2) as pool:
        pids = {pid for _, pid in pool.map(helpers.get_init, range(6), chunksize=1)}
    pool.join()
    assert len(pids) == 3


def lease_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").endswith("_lease (deleted)")
        except OSError:  # the listing's own fd, gone
            pass
    return n


def test_workers_replaced_again_and_again_leave_a_bounded_number_of_lease_fds(lc):
    # Each worker is a new peer with its own lease table; the caller must not keep
    # descriptions of every table it ever heard from (a fork Pool that replaced its workers
    # ran out of fds and hung at 1024)
    from shmtensor.ipc import ofd_lease
    with smp.get_context("fork").Pool(2, maxtasksperchild=1) as pool:
        for i, a in enumerate(pool.imap(helpers.array_of, range(150), chunksize=1)):
            assert a[0] == i
            del a
        assert ofd_lease.table_count() <= ofd_lease.holdings_kept() + 2
        bound = ofd_lease.SHARDS * (ofd_lease.holdings_kept() + 2) + ofd_lease.kept_budget()
        assert lease_fds() <= bound, (lease_fds(), bound)
    pool.join()


def test_lambdas_and_closures_under_spawn(lc):
    k = 3
    with smp.get_context("spawn").Pool(2) as pool:
        assert pool.map(lambda x: x * k, range(4)) == [0, 3, 6, 9]
        a = shmtensor.ones(1000)
        sums = pool.map(lambda arr: float(arr.sum()), [a, a])

        def mark(arr):  # a closure's task: pickled by value, its arrays still shared
            arr[0] = k
            return arr

        back = pool.apply(mark, (a,))
    pool.join()
    assert sums == [1000.0, 1000.0]
    assert a[0] == 3 and back.base is a.base
    ctx = smp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=lambda: q.put(k * 2))
    p.start()
    assert q.get(timeout=JOIN) == 6
    join_all(p)


def test_remote_exception_type_and_traceback(lc):
    with smp.get_context("spawn").Pool(1) as pool:
        try:
            pool.map(helpers.raise_value_error, [1])
        except ValueError as e:
            cause = str(e.__cause__)
        assert "raise_value_error" in cause  # the worker's traceback
        try:
            pool.apply(helpers.raise_weird, (1,))
        except smp.RemoteError as e:
            text, type_name = str(e), e.type_name
        assert "NotRebuildable" in text and type_name.endswith("NotRebuildable")
    pool.join()


def test_array_arguments_and_results_zero_copy(lc):
    bufs = [shmtensor.zeros((2, 2)) for _ in range(4)]
    with smp.get_context("spawn").Pool(2) as pool:
        outs = pool.map(helpers.pool_fill, bufs, 1)
    pool.join()
    assert all((b == 4).all() for b in bufs) and all((o == 5).all() for o in outs)
    assert all(shmtensor.is_shared(o) or o.nbytes < shmtensor.get_inline_threshold() for o in outs)


@pytest.mark.parametrize("how", ["sigkill", "exit", "segfault", "sys.exit"])
def test_worker_crash_fails_fast_and_pool_says_broken(how, lc):
    pool = smp.get_context("spawn").Pool(2)
    t0 = time.monotonic()
    with pytest.raises(smp.WorkerLostError) as err:
        pool.map(helpers.crash, [how, "ok", "ok"], chunksize=1)
    assert time.monotonic() - t0 < 10
    msg = str(err.value)
    assert "pid" in msg and ("SIGKILL" in msg or "exit code 3" in msg or "SIGSEGV" in msg
                             or "sys.exit()" in msg)
    with pytest.raises(smp.WorkerLostError, match="broken"):
        pool.apply(helpers.square, (2,))
    pool.terminate()
    pool.join()


def test_spawn_runs_every_rank(lc):
    ctx = smp.get_context("spawn")
    out = ctx.SimpleQueue()
    smp.spawn(helpers.spawn_ok, args=(out,), nprocs=3)
    assert sorted(out.get() for _ in range(3)) == [0, 1, 2]
    out.close()


def test_spawn_failure_raises_with_rank_and_traceback_and_stops_siblings(lc):
    t0 = time.monotonic()
    with pytest.raises(smp.ProcessRaisedException) as err:
        smp.spawn(helpers.spawn_fail_rank1, nprocs=3)
    assert err.value.error_index == 1 and "KeyError" in str(err.value)
    assert "spawn_fail_rank1" in str(err.value)
    assert time.monotonic() - t0 < 30  # siblings (sleeping 60 s) were stopped


def test_spawn_exit_code_and_join_false(lc):
    ctx = smp.spawn(helpers.spawn_exit_rank0, nprocs=2, join=False)
    with pytest.raises(smp.ProcessExitedException) as err:
        deadline = time.monotonic() + JOIN
        while not ctx.join(timeout=0.5) and time.monotonic() < deadline:
            pass
    assert err.value.exit_code == 4 and err.value.error_index == 0
    assert all(not p.is_alive() for p in ctx.processes)


def test_spawn_children_die_with_parent(tmp_path):
    import subprocess
    import sys
    import psutil
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time, shmtensor.multiprocessing as smp\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "import helpers\n"
        "if __name__ == '__main__':\n"
        "    ctx = smp.spawn(helpers.spawn_fail_rank1, nprocs=1, join=False)\n"
        "    print(ctx.pids()[0], flush=True)\n"
        "    time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait(JOIN)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child) and time.monotonic() < deadline:
        try:
            if psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_batch_pool_back_pressure_and_recycling(lc):
    pool = shmtensor.BatchPool((10,), np.int64, slots=2)
    a, b = pool.acquire(), pool.acquire()
    assert pool.try_acquire() is None
    with pytest.raises(TimeoutError, match="slots"):
        pool.acquire(timeout=0.05)
    a[:] = 1
    del a
    c = pool.acquire(timeout=1)
    assert (c == 1).all()  # the same slot came back
    del b, c
    pool.close()


def test_batch_pool_across_processes_no_new_segments(lc):
    ctx = smp.get_context("spawn")
    out = ctx.Queue()
    n = 20
    p = ctx.Process(target=helpers.batch_worker, args=(out, n))
    p.start()
    for i in range(n):
        b = out.get(timeout=JOIN)
        assert (b == i).all()
        del b  # hands the slot back to the worker
    assert out.get(timeout=JOIN) == 2  # two slots made, reused for all 20 batches
    join_all(p)


def test_torch_dataloader_with_context(lc):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader
    ctx = smp.get_context("spawn")
    loader = DataLoader(helpers.NumpyDataset(), batch_size=4, num_workers=2,
                        multiprocessing_context=ctx)
    batches = list(loader)
    assert len(batches) == 4 and batches[1].shape == (4, 3, 4)
    assert float(batches[3][3, 0, 0]) == 15.0
    del loader, batches


def test_fast_crash_of_replacement_worker_is_seen(lc):
    pool = smp.get_context("spawn").Pool(1, maxtasksperchild=1)
    assert pool.apply(helpers.square, (3,)) == 9  # the first worker retires; a new one starts
    with pytest.raises(smp.WorkerLostError, match="exit code 9"):
        pool.apply(helpers.exit_in_task, (1,))
    pool.terminate()
    pool.join()


def test_spawn_under_forkserver(lc):
    ctx = smp.get_context("forkserver")
    out = ctx.SimpleQueue()
    smp.spawn(helpers.spawn_ok, args=(out,), nprocs=2, start_method="forkserver")
    assert sorted(out.get() for _ in range(2)) == [0, 1]
    out.close()


def test_batch_pool_refuses_another_process():
    pool = shmtensor.BatchPool((4,), slots=1)
    ctx = smp.get_context("fork")
    q = ctx.SimpleQueue()

    def child():
        try:
            pool.acquire(timeout=1)
            q.put("acquired")
        except RuntimeError as e:
            q.put(str(e))

    p = ctx.Process(target=child)
    p.start()
    msg = q.get()
    join_all(p)
    assert "create the BatchPool inside the worker" in msg
    pool.close()


def test_terminate_after_idle_workers_were_killed(lc):
    # an idle worker waits for tasks holding the task queue's lock; killed there, the lock
    # is never released, and the stdlib's terminate() would wait on it for ever
    ctx = smp.get_context("spawn")
    pool = ctx.Pool(2)
    assert pool.map(helpers.square, range(4)) == [0, 1, 4, 9]
    time.sleep(0.3)  # both idle: one in recv holding the lock, one waiting for it
    for w in list(pool._pool):
        lc.check_pid(w.pid)
        os.kill(w.pid, signal.SIGKILL)
    t = time.monotonic()
    pool.terminate()
    pool.join()
    assert time.monotonic() - t < 30


def test_a_lost_worker_fails_a_map_while_its_results_arrive():
    # The watcher fails a pending map while the result handler may be inside its _set,
    # between decrementing the chunks left and testing for 0: failing it through _set
    # (setting the count to 1 first) could leave the call never completed (seen as a
    # hang of a random SIGKILL test).  The failure must not go through _set, and a result
    # that arrives afterwards must leave the call failed.
    from multiprocessing import pool as mpp
    from shmtensor.multiprocessing import _pool

    class Notifier:
        told = 0

        def put(self, _):
            Notifier.told += 1

    class FakePool:
        _cache = mpp._PoolCache(notifier=Notifier())

    job = mpp.MapResult(FakePool(), chunksize=1, length=4, callback=None,
                        error_callback=None)
    job._set(0, (True, [10]))
    job._number_left -= 1  # the handler, delivering chunk 1, has decremented; it tests next

    def no_set(*args):
        raise AssertionError("failed through _set")

    job._set = no_set
    err = smp.WorkerLostError("pool worker pid 1 died")
    _pool._fail(job, err)
    assert job.ready() and not job.successful()
    assert job._job not in FakePool._cache and Notifier.told == 1  # the pool hears of it
    with pytest.raises(smp.WorkerLostError):
        job.get(0)
    del job._set  # the handler goes on: chunk 1 arrives, then chunk 2
    job._set(1, (True, [11]))
    job._set(2, (True, [12]))
    with pytest.raises(smp.WorkerLostError):
        job.get(0)
