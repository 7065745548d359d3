"""SIGKILL of producers and consumers: nothing outlives the processes that use it."""

import os
import signal
import time
from queue import Empty

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp
from shmtensor.ipc import ofd_lease, procfs

import helpers
from conftest import JOIN, join_all

BOUND = 10.0  # seconds the janitor may take to unlink a dead producer's named segments


def _left_by(pid):
    prefix = f"shmtensor_{pid}_"
    named = [n for n in procfs.named_segments() if n.startswith(prefix)]
    mapped = [k for k, u in procfs.scan().items() if k.startswith(prefix) and not k.endswith("lease")]
    return named, mapped


def _wait_clean(pid, bound=BOUND):
    deadline = time.monotonic() + bound
    while True:
        named, mapped = _left_by(pid)
        if not named and not mapped or time.monotonic() > deadline:
            return named, mapped
        time.sleep(0.1)


def test_sigkill_producer_leaves_nothing(strategy, lc):
    ctx = smp.get_context("spawn")
    q = ctx.Queue(maxsize=4)
    p = ctx.Process(target=helpers.send_forever, args=(q, 50_000))
    p.start()
    got = [q.get(timeout=JOIN) for _ in range(3)]
    assert [int(g[0]) for g in got] == [0, 1, 2]
    os.kill(p.pid, signal.SIGKILL)
    p.join(JOIN)
    assert p.exitcode == -signal.SIGKILL
    # the arrays a survivor holds stay intact after the producer's death
    assert all((g == i).all() for i, g in enumerate(got))
    del got
    while True:  # drain what was in flight: it is still readable
        try:
            q.get(timeout=0.5)
        except Exception:
            break
    q.close()
    q.join_thread()
    shmtensor.empty_cache()
    named, mapped = _wait_clean(p.pid)
    assert not named and not mapped


def test_a_producer_killed_between_datagram_and_record_holds_nothing_after_a_get(
        strategy, lc):
    # its datagram has no record, and none comes after it: a get that finds the queue
    # empty closes it, so the segment it names is not held while the queue lives on
    ctx = smp.get_context("spawn")
    q, ready = ctx.Queue(maxsize=4), ctx.Event()
    p = ctx.Process(target=helpers.put_and_die_between_datagram_and_record,
                    args=(q, ready, 50_000))
    p.start()
    lc.check_pid(p.pid)
    assert ready.wait(JOIN)
    os.kill(p.pid, signal.SIGKILL)
    p.join(JOIN)
    assert p.exitcode == -signal.SIGKILL
    with pytest.raises(Empty):
        q.get(timeout=0.2)
    named, mapped = _wait_clean(p.pid)
    assert not named and not mapped
    q.put("after")  # the queue goes on
    assert q.get(timeout=JOIN) == "after"
    q.close()
    q.join_thread()


def test_sigkill_consumer_releases_by_dying(strategy, lc):
    ctx = smp.get_context("spawn")
    q, out, e = ctx.Queue(), ctx.Queue(), ctx.Event()
    c = ctx.Process(target=helpers.hold_and_wait, args=(q, out, e))
    c.start()
    a = shmtensor.full(200_000, 2, dtype=np.int64)  # past SLAB_ITEM_MAX: its own segment
    seg = shmtensor._segments.segment_of(a)
    q.put(a)
    assert out.get(timeout=JOIN) == 400_000
    del a
    table = ofd_lease.own_table()
    assert table.is_held(seg.slot)  # the consumer holds it: no reuse yet
    os.kill(c.pid, signal.SIGKILL)
    c.join(JOIN)
    deadline = time.monotonic() + 5
    while table.is_held(seg.slot) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not table.is_held(seg.slot)
    b = shmtensor.empty(200_000, dtype=np.int64)  # the dead consumer's segment is reused
    assert shmtensor._segments.segment_of(b) is seg
    del b
    shmtensor.empty_cache()
    named, _ = _left_by(os.getpid())
    assert not named


def test_consumer_killed_holding_many_then_producer_reclaims(lc):
    ctx = smp.get_context("spawn")
    q = ctx.Queue()
    c = ctx.Process(target=helpers.suicide_after_get, args=(q,))
    c.start()
    q.put([np.ones(200_000) for _ in range(3)])  # past SLAB_ITEM_MAX: a segment each
    c.join(JOIN)
    assert c.exitcode == -signal.SIGKILL
    before = shmtensor.debug_info()["segments_created"]
    for _ in range(3):
        x = shmtensor.empty(200_000)
        del x
    assert shmtensor.debug_info()["segments_created"] == before
