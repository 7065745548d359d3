"""Fault injection: SIGKILL producers and consumers at random points under both strategies.

Afterwards nothing of theirs is left in /dev/shm (within test_crash.BOUND for
file_system), no survivor hangs, and what a survivor still holds is intact."""

import gc
import os
import random
import signal
import time

import pytest

import shmtensor
import shmtensor.multiprocessing as smp

import helpers
from conftest import JOIN, join_all
from test_crash import _wait_clean


@pytest.mark.parametrize("victim", ["producer", "consumer"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_sigkill(strategy, victim, seed, lc):
    rnd = random.Random(seed)
    ctx = smp.get_context("spawn")
    # the stop flag is a shared byte, not an Event: an Event's lock could die with the producer
    q, out, stop = ctx.Queue(maxsize=8), ctx.Queue(), shmtensor.zeros(2, dtype="int8")
    size = rnd.choice([8, 20_000, 300_000])  # inline, and through segments
    prod = ctx.Process(target=helpers.fault_producer, args=(q, stop, size))
    cons = ctx.Process(target=helpers.fault_consumer, args=(q, out, 4))
    prod.start()
    cons.start()
    deadline = time.monotonic() + JOIN  # both started (a loaded machine spawns slowly)
    while stop[1] == 0 and time.monotonic() < deadline and prod.exitcode is None:
        time.sleep(0.005)
    time.sleep(rnd.uniform(0.1, 1.0))  # in put, in get, holding, recycling: wherever it is
    dead, survivor = (prod, cons) if victim == "producer" else (cons, prod)
    os.kill(dead.pid, signal.SIGKILL)
    dead.join(JOIN)
    assert dead.exitcode == -signal.SIGKILL
    if victim == "producer":
        status, n = out.get(timeout=JOIN)  # the consumer notices the stream dried up
        assert status == "ok" and n > 0
    stop[0] = 1
    join_all(survivor)
    assert survivor.exitcode == 0
    # Messages still in the queue stay readable (and their segments alive) while anyone
    # holds its reading end: let go of both queues, as a program does when it ends.
    for chan in (q, out):
        chan.close()
        chan.join_thread()
    del q, out, chan
    gc.collect()
    for p in (prod, cons):
        named, mapped = _wait_clean(p.pid)
        assert not named and not mapped, (named, mapped)


@pytest.mark.parametrize("seed", [1, 2])
def test_random_sigkill_of_a_pool_worker(strategy, seed, lc):
    rnd = random.Random(seed)
    ctx = smp.get_context("spawn")
    import numpy as np
    import shmtensor
    inputs = [shmtensor.full(50_000, i, dtype=np.float64) if i % 2 else
              np.full(300_000, i, dtype=np.float64) for i in range(40)]
    pool = ctx.Pool(2)
    pids = [w.pid for w in pool._pool]
    for pid in pids:
        lc.check_pid(pid)
    result = pool.map_async(helpers.slow_scale, inputs, chunksize=1)
    time.sleep(rnd.uniform(0.2, 1.0))  # mid-task, in get, in put, holding arrays: wherever
    os.kill(rnd.choice(pids), signal.SIGKILL)
    try:
        outs = result.get(timeout=JOIN)  # finished before the kill landed: all correct
        assert all((o == 2 * i).all() for i, o in enumerate(outs))
        del outs
    except smp.WorkerLostError as e:
        assert "SIGKILL" in str(e)
    pool.terminate()
    pool.join()
    assert all((a == i).all() for i, a in enumerate(inputs))  # the survivor's data is intact
    # tasks never taken stay in the pool's queue (holding their segments) until the pool
    # object goes: let it go, as a program does
    del inputs, pool, result
    gc.collect()
    shmtensor.empty_cache()  # this process's idle mappings of the workers' segments
    for pid in pids:
        named, mapped = _wait_clean(pid)
        assert not named and not mapped, (named, mapped)
