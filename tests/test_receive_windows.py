"""An exception (a signal handler's) raised just after a load took something over from its
message (issue 26 item 7): what the segment or the holding kept leaves the message's fd
list in the same step, so nothing is closed twice, the abandoned anchor releases its hold,
and the new mapping idles in the receive cache (evicted by ``empty_cache``)."""

from __future__ import annotations

import gc
import os
from queue import Empty

import pytest

import shmtensor
import shmtensor.multiprocessing as smp
from shmtensor import _segments
from shmtensor.ipc import ofd_lease

from conftest import JOIN, join_all
from helpers import send_array_twice


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


@pytest.mark.parametrize("sole", [False, True], ids=["with-fds", "without-fds"])
@pytest.mark.parametrize("where", [(ofd_lease, "hold"), (_segments, "_attached")],
                         ids=["after-the-hold", "after-the-map"])
def test_an_exception_after_a_load_took_its_fds_leaks_nothing(lc, monkeypatch, where, sole):
    # with-fds: the queue has several readers (as far as its writers know), so each array
    # comes with its fds, which the load takes over; without-fds: this process is its sole
    # reader, the second array comes with no fds but its first one's, and its memory is
    # attached as it is taken off the queue
    ctx = smp.get_context("spawn")
    q, took, done = ctx.Queue(), ctx.Event(), ctx.Event()
    if not sole:
        q._chan.ring.user[3] = 1 << 48  # the reader word: several readers
    p = ctx.Process(target=send_array_twice, args=(q, took, done))  # ones((5, 5)), twice
    p.start()
    try:
        b = q.get(timeout=JOIN)  # the producer's table known here: the baseline is steady
        table = _segments.segment_of(b).table_id
        del b
        fds = _fds()
        monkeypatch.setattr(*where, _then_raise(getattr(*where)))
        took.set()
        with pytest.raises(Interrupt):
            q.get(timeout=JOIN)
        monkeypatch.undo()
        kept = set()
        if sole:  # the exception left the message in the queue, for the next get
            b = q.get(timeout=JOIN)
            assert b.shape == (5, 5) and (b == 1).all()
            del b
            kept = {str(fd) for fd in q._chan._keep.values()}  # the memfd, sent once
            assert len(kept) == 1
        else:  # the message was taken off the queue: the exception lost it
            with pytest.raises(Empty):
                q.get(timeout=0.2)
        assert _fds() == fds | kept  # nothing open twice, nothing left open
        holding = ofd_lease._holdings.get(table)
        assert holding is None or not holding.counts, "a hold outlived its anchor"
        assert not [s for s in _segments._by_key.values() if not s.own and s.mm is not None]
    finally:
        done.set()
        join_all(p)
    assert p.exitcode == 0
