"""An exception (a signal handler's) raised just after a load took something over from its
message (issue 26 item 7): what the segment or the holding kept leaves the message's fd
list in the same step, so nothing is closed twice, the abandoned anchor releases its hold,
and the new mapping idles in the receive cache (evicted by ``empty_cache``)."""

from __future__ import annotations

import gc
import os

import pytest

import shmtensor
import shmtensor.multiprocessing as smp
from shmtensor import _segments
from shmtensor.ipc import ofd_lease

from conftest import JOIN, join_all
from helpers import send_array


class Interrupt(Exception):
    """Stands in for what a signal handler raises."""


def _then_raise(real):
    """``real``, then an exception as it returns: where a handler runs after a call."""
    def call(*args, **kwargs):
        real(*args, **kwargs)
        raise Interrupt
    return call


def _fds() -> set[str]:
    gc.collect()
    shmtensor.empty_cache()
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("where", [(ofd_lease, "hold"), (_segments, "_attached")],
                         ids=["after-the-hold", "after-the-map"])
def test_an_exception_after_a_load_took_its_fds_leaks_nothing(lc, monkeypatch, where):
    ctx = smp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=send_array, args=(q, done))  # ones((5, 5)), sent twice
    p.start()
    try:
        b = q.get(timeout=JOIN)  # the producer's table known here: the baseline is steady
        table = _segments.segment_of(b).table_id
        del b
        fds = _fds()
        monkeypatch.setattr(*where, _then_raise(getattr(*where)))
        with pytest.raises(Interrupt):
            q.get(timeout=JOIN)
        monkeypatch.undo()
        assert _fds() == fds  # nothing open twice, nothing left open
        holding = ofd_lease._holdings.get(table)
        assert holding is None or not holding.counts, "a hold outlived its anchor"
        assert not [s for s in _segments._by_key.values() if not s.own and s.mm is not None]
    finally:
        done.set()
        join_all(p)
    assert p.exitcode == 0
