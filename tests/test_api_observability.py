"""What shmtensor says about itself: the ``shmtensor`` logger reports each fallback once,
``debug_info()`` groups its counters per subsystem (the flat names still read), and a
``BatchPool.acquire()`` that waits says who holds the slots."""

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp
from shmtensor import _log

from conftest import JOIN, join_all


@pytest.fixture
def fresh_log(caplog):
    """Fallbacks not yet reported in this process, and every shmtensor record captured."""
    saved = set(_log._reported)
    _log._reported.clear()
    caplog.set_level(logging.DEBUG, logger="shmtensor")
    yield caplog
    _log._reported.clear()
    _log._reported.update(saved)


def roundtrip(obj, times=2):
    q = smp.SimpleQueue()
    try:
        for _ in range(times):
            q.put(obj)
            out = q.get()
    finally:
        q.close()
    return out


def records(caplog, kind_words):
    return [r for r in caplog.records if r.name == "shmtensor" and kind_words in r.getMessage()]


def test_an_object_array_pickled_by_value_is_reported_once(fresh_log):
    a = np.array([1, "two", None], dtype=object)
    assert list(roundtrip(a)) == [1, "two", None]
    got = records(fresh_log, "pickled by value")
    assert len(got) == 1 and got[0].levelno == logging.INFO, fresh_log.text
    assert "dtype object" in got[0].getMessage()
    assert "numpy-object" in shmtensor.debug_info()["fallbacks"]


def test_a_plain_array_copied_into_a_segment_is_reported_once_at_debug(fresh_log):
    a = np.ones(1 << 16)  # 512 KiB: over the inline threshold, not shared
    assert roundtrip(a, times=3).sum() == 1 << 16
    got = records(fresh_log, "copied into shared memory")
    assert len(got) == 1 and got[0].levelno == logging.DEBUG, fresh_log.text
    # an array made in shared memory is no fallback
    fresh_log.clear()
    roundtrip(shmtensor.ones(1 << 16))
    assert not records(fresh_log, "copied"), fresh_log.text


def test_a_function_sent_with_cloudpickle_is_reported_once(fresh_log):
    k = 3
    out = roundtrip(lambda x: x * k)
    assert out(2) == 6
    got = records(fresh_log, "cloudpickle")
    assert len(got) == 1 and got[0].levelno == logging.INFO, fresh_log.text
    # a module-level function goes by name: nothing to report
    fresh_log.clear()
    assert roundtrip(os.getpid) is os.getpid
    assert not fresh_log.records


def test_import_does_not_import_logging_and_a_report_does():
    code = ("import sys, shmtensor, numpy as np, shmtensor.multiprocessing as smp\n"
            "before = 'logging' in sys.modules\n"
            "q = smp.SimpleQueue(); q.put(np.array([None])); q.get(); q.close()\n"
            "print(before, 'logging' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True"]


def test_debug_info_is_grouped_and_keeps_the_flat_names():
    a = shmtensor.zeros(1000)
    info = shmtensor.debug_info()
    assert {"segments", "arrays", "leases", "cuda", "settings", "fallbacks"} <= set(info)
    assert info["segments"]["own_live"] >= 1
    assert info["segments_own_live"] == info["segments"]["own_live"]
    assert info["cuda_opened"] == info["cuda"]["opened"] == 0
    assert info.get("lease_tables") == info["leases"]["tables"]
    assert "arrays_received" in info and "no_such_counter" not in info
    assert info.get("no_such_counter", -1) == -1
    with pytest.raises(KeyError):
        info["segments_no_such"]
    assert info["settings"] == {"sharing_strategy": shmtensor.get_sharing_strategy(),
                                "inline_threshold": shmtensor.get_inline_threshold(),
                                "receive_spin_us": shmtensor.get_receive_spin()}
    json.dumps(info)  # plain data: it can be logged or sent anywhere
    del a


def test_debug_info_never_raises_on_a_bad_variable():
    full = {k: v for k, v in os.environ.items() if not k.startswith("SHMTENSOR_")}
    full["SHMTENSOR_RECEIVE_SPIN_US"] = "abc"
    r = subprocess.run([sys.executable, "-c", "import shmtensor; "
                        "print(shmtensor.debug_info()['settings']['receive_spin_us'])"],
                       env=full, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("invalid: SHMTENSOR_RECEIVE_SPIN_US='abc'")


def keep_batches(q, n, got, release):
    kept = [q.get() for _ in range(n)]
    got.set()
    release.wait(JOIN)
    del kept


def test_acquire_warns_once_naming_the_processes_that_hold_the_slots(caplog, lc):
    caplog.set_level(logging.WARNING, logger="shmtensor")
    ctx = smp.get_context("fork")
    q, got, release = ctx.SimpleQueue(), ctx.Event(), ctx.Event()
    p = ctx.Process(target=keep_batches, args=(q, 2, got, release))
    p.start()
    try:
        with shmtensor.BatchPool((16,), slots=2) as pool:
            for _ in range(2):
                q.put(pool.acquire())
            assert got.wait(JOIN)
            with pytest.raises(TimeoutError, match="2 by other processes"):
                pool.acquire(timeout=0.5, warn_after=0)
            warned = [r for r in caplog.records if "has waited" in r.getMessage()]
            assert len(warned) == 1 and warned[0].levelno == logging.WARNING
            message = warned[0].getMessage()
            assert "all 2 slots are out" in message and "2 by other processes" in message
            assert str(p.pid) in message, message
            with pytest.raises(TimeoutError):  # once per pool
                pool.acquire(timeout=0.2, warn_after=0)
            assert len([r for r in caplog.records if "has waited" in r.getMessage()]) == 1
            release.set()
            join_all(p)
            assert p.exitcode == 0
            pool.acquire(timeout=JOIN)  # the child let go: a slot is free again
    finally:
        release.set()
        join_all(p)
        q.close()


def test_acquire_names_views_held_in_this_process(caplog):
    caplog.set_level(logging.WARNING, logger="shmtensor")
    with shmtensor.BatchPool((16,), slots=2) as pool:
        held = [pool.acquire(), pool.acquire()]
        with pytest.raises(TimeoutError, match="2 held by views in this process"):
            pool.acquire(timeout=0.3, warn_after=0)
        assert "2 held by views in this process" in caplog.text
        pool_never = shmtensor.BatchPool((16,), slots=1)
        kept = pool_never.acquire()
        caplog.clear()
        with pytest.raises(TimeoutError):
            pool_never.acquire(timeout=0.2, warn_after=None)
        assert "has waited" not in caplog.text
        pool_never.close()
        del held, kept
