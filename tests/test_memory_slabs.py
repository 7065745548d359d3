"""Slabs keep reserved memory within about twice what is live or in flight (issue 26,
item 6), and the sweeper survives its errors and never runs across a fork (item 9)."""

import gc
import logging
import os
import random
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp
from shmtensor import _segments

from conftest import JOIN, join_all

KiB, MiB = 1 << 10, 1 << 20
MAXSIZE = 8


def _reserved() -> int:
    """Bytes of this process's own segments in existence (live, in flight or idle)."""
    with _segments._lock:
        return sum(s.size for s in _segments._by_key.values() if s.own)


def _drop_each(q):
    while q.get(timeout=JOIN) is not None:
        pass


def test_a_stream_of_dropped_small_arrays_reserves_about_twice_what_is_in_flight(strategy, lc):
    """256 KiB-1 MiB arrays through Queue(maxsize=8), each dropped on receipt: slabs kept
    doubling while an earlier one still had an array out (128 MiB for <= 10 MiB in flight)."""
    shmtensor.empty_cache()
    ctx = smp.get_context("fork")
    q = ctx.Queue(maxsize=MAXSIZE)
    p = ctx.Process(target=_drop_each, args=(q,))
    p.start()
    rng = random.Random(0)
    sizes: list[int] = []
    peak_reserved = peak_inflight = one_slab = 0
    base = _reserved()
    try:
        for i in range(1500):
            sizes.append(rng.randint(256 * KiB, 1024 * KiB))
            q.put(np.full(sizes[-1], i % 251, np.uint8))
            # at most MAXSIZE queued, one in the feeder, one being received
            peak_inflight = max(peak_inflight, sum(sizes[-(MAXSIZE + 2):]))
            peak_reserved = max(peak_reserved, _reserved() - base)
            one_slab = max([one_slab] + [s.size for s in _segments.mapped() if s.slab])
    finally:
        q.put(None)
        join_all(p)
        q.close()
        q.join_thread()
        shmtensor.empty_cache()
    assert p.exitcode == 0
    assert peak_reserved <= 2 * peak_inflight + one_slab, (peak_reserved / MiB,
                                                           peak_inflight / MiB, one_slab / MiB)


def test_kept_small_arrays_still_take_few_slabs():
    """Slabs grow while earlier ones stay held: 50 MB of kept 1 KB arrays in a handful."""
    shmtensor.empty_cache()
    before = shmtensor.debug_info()["segments_created"]
    kept = [shmtensor.zeros(128) for _ in range(50_000)]
    made = shmtensor.debug_info()["segments_created"] - before
    reserved = sum(s.size for s in _segments.mapped() if s.slab)
    live = 50_000 * 1024
    assert made <= 12 and reserved <= 2 * live + _segments.SLAB_MIN, (made, reserved / MiB)
    del kept
    shmtensor.empty_cache()


# The sweeper -----------------------------------------------------------------------------

def test_the_sweeper_survives_an_error_and_trims_on(monkeypatch, caplog):
    monkeypatch.setattr(_segments, "SWEEP_SECONDS", 0.02)
    monkeypatch.setitem(_segments.IDLE_SECONDS, _segments.FD, 0.05)
    monkeypatch.setattr(_segments, "_sweep_error_logged", False, raising=False)
    real, failures = _segments.trim, []

    def trim_failing_twice(force=False):
        if len(failures) < 2:
            failures.append(1)
            raise RuntimeError("injected")
        return real(force)

    monkeypatch.setattr(_segments, "trim", trim_failing_twice)
    keep = shmtensor.zeros(1)  # something mapped: the sweeper runs
    a = shmtensor.empty(2 * MiB, np.uint8)  # a segment of its own
    seg = _segments.segment_of(a)
    with caplog.at_level(logging.WARNING, logger="shmtensor"):
        _segments._ensure_sweeper()
        del a
        gc.collect()
        deadline = time.monotonic() + JOIN
        while seg.mm is not None and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(failures) == 2, "the injected errors never ran"
    assert seg.mm is None, "the idle segment was never trimmed after the sweeper's error"
    logged = [r for r in caplog.records if r.name == "shmtensor"]
    assert len(logged) == 1 and "injected" in (logged[0].exc_text or ""), logged
    del keep


FORK_CHECK = """
    import gc, os, sys, warnings
    import numpy as np
    import shmtensor
    from shmtensor import _segments
    _segments.SWEEP_SECONDS = 0.01
    for i in range(3):
        kept = shmtensor.zeros(100)
        shmtensor.empty(2 << 20, np.uint8)  # made and dropped: idle, the sweeper busy
        gc.collect()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # 'error' would not do: fork swallows it
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
        # Python >= 3.13 counts the threads after-fork hooks start too: the sweeper's
        # restart (which a reader that stopped calling get needs, to let go) warns there
        if sys.version_info < (3, 13):
            assert not caught, [str(w.message) for w in caught]
        assert _segments._sweeper is not None or not _segments._by_key  # restarted
    print("ok")
"""


def _pythons() -> list[str]:
    """This interpreter, and the Pythons >= 3.12 at hand (they warn about forks in threaded
    processes); $SHMTENSOR_TEST_PYTHONS adds more (paths, separated by ':')."""
    found = [sys.executable] + [p for p in os.environ.get("SHMTENSOR_TEST_PYTHONS",
                                                          "").split(":") if p]
    for v in sorted(os.listdir("/root/.pyenv/versions")) if os.path.isdir(
            "/root/.pyenv/versions") else []:
        exe = f"/root/.pyenv/versions/{v}/bin/python"
        if v.startswith(("3.12", "3.13")) and os.path.exists(exe):
            found.append(exe)
    return found


@pytest.mark.parametrize("python", _pythons())
def test_a_fork_after_arrays_were_made_and_dropped_warns_nothing(python, tmp_path):
    if python != sys.executable:
        r = subprocess.run([python, "-c", "import numpy, psutil, cloudpickle"],
                           capture_output=True, timeout=60)
        if r.returncode != 0:
            pytest.skip(f"{python} lacks numpy, psutil or cloudpickle")
    root = os.path.dirname(os.path.dirname(os.path.abspath(shmtensor.__file__)))
    # numpy's BLAS starts threads of its own on import unless told not to, and Python
    # >= 3.12 would warn about those: only shmtensor's threads are the check's business
    env = dict(os.environ, PYTHONPATH=root, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    r = subprocess.run([python, "-c", textwrap.dedent(FORK_CHECK)], capture_output=True,
                       text=True, timeout=JOIN, env=env)
    assert r.returncode == 0 and r.stdout.split() == ["ok"], (r.stdout, r.stderr)
    assert "DeprecationWarning" not in r.stderr, r.stderr


def test_an_exception_while_a_segment_goes_idle_leaves_the_idle_tables_in_step(monkeypatch):
    """A segment of this process that goes idle is listed in the idle table and in its
    size bucket as one step: an exception (a signal handler's) at the call before it
    leaves it in neither, so a later reuse or trim finds the two tables in step."""
    big = shmtensor.empty(_segments.SLAB_ITEM_MAX * 2, dtype=np.uint8)
    seg = _segments.segment_of(big)
    del big
    gc.collect()
    _segments.settle()  # the segment went idle: listed in both tables
    idle = _segments._own_idle[seg.kind]
    assert idle.get(seg.key) is seg
    with _segments._lock:
        _segments._own_idle_drop(seg)
        bytes_before = _segments._own_idle_bytes

        class Interrupted(Exception):
            pass

        class Cut(dict):
            def setdefault(self, *args):
                raise Interrupted
        real = _segments._buckets
        monkeypatch.setattr(_segments, "_buckets", Cut(real))
        with pytest.raises(Interrupted):
            _segments._own_idle_put(seg)
        monkeypatch.setattr(_segments, "_buckets", real)
        assert seg.key not in idle and _segments._own_idle_bytes == bytes_before
        _segments._own_idle_put(seg)  # as the next settle does
        assert idle.get(seg.key) is seg
        assert seg.key in real[(seg.kind, seg.size.bit_length())]
    shmtensor.empty_cache()  # drops it from both: a KeyError had they been out of step
    assert seg.key not in idle
