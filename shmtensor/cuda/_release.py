"""Releasing received device memory once this process's own work on it is done.

When the last array on a received allocation dies, its finalizer only *enqueues* the
release (:func:`enqueue`: a ``queue.SimpleQueue.put``, which takes no lock and is safe in
``__del__`` and weakref callbacks).  A *drain*, run by the next shmtensor CUDA call that
sends, receives or allocates (once ``BATCH`` releases have gathered) or by the releaser
thread (``DRAIN_S`` after the first release it sees), records one event per (device, stream)
on the streams the arrays died on and releases each lease once its event is done, oldest
first.  The releaser sleeps on the queue itself, so it costs nothing while nothing dies.

Locks: the drain holds ``_Releases.lock`` and, while releasing, takes the lease table's lock
(:mod:`shmtensor.ipc.ofd_lease`) and the ``done`` callbacks' locks (``_vmm``'s mapping lock).
Nothing holding those ever drains, and no finalizer takes any lock.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque

from shmtensor.ipc import ofd_lease

from . import _device

DRAIN_S = 0.002  # how long the releaser lets releases gather before draining them
BATCH = 64       # releases that make a sending or receiving call drain first
# Streams that are the same stream in every thread (the legacy default stream): one event
# recorded on them later covers every release noted on them.
_SHARED_STREAMS = (0, 1)


class _Releases:
    """Owner of every release not yet carried out (one per process; reset in a fork)."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # (device, stream, lease)
        self.lock = threading.Lock()   # held by the draining thread
        self.pending: deque = deque()  # (event, device, [lease]): oldest first
        self.idle_events: dict[int, list] = {}  # device -> events done, to record again
        self.started = False           # the releaser thread (under lock)


_r = _Releases()


def enqueue(device: int, table_id: str, slot: int, done=None) -> None:
    """From a finalizer: release ``(table_id, slot)`` (then call ``done``) once the work this
    thread queued on ``device``'s current stream is done.  Takes no lock."""
    try:
        cp = _device._cp
        stream = cp.cuda.get_current_stream(device)  # kept alive until the drain records
    except Exception:  # interpreter shutting down, or a CuPy without the argument
        stream = None
    _r.inbox.put((device, stream, (table_id, slot, done)))


def poll() -> None:
    """From a sending or receiving call: drain when ``BATCH`` releases have gathered."""
    if _r.inbox.qsize() >= BATCH:
        drain(block=False)


def ensure_releaser() -> None:
    """Start the releaser thread (from a receiving call: never from a finalizer)."""
    if not _r.started:
        with _r.lock:
            if not _r.started:
                threading.Thread(target=_releaser, args=(_r,), daemon=True,
                                 name="shmtensor-cuda-release").start()
                _r.started = True


def drain(block: bool) -> None:
    """Record events for the releases enqueued so far, then release what the done events
    cover (``block``: wait for every one of them)."""
    r = _r
    if r.inbox.empty() and not r.pending:
        return
    if not r.lock.acquire(blocking=block):
        return  # another thread is draining
    try:
        _flush(r)
        while r.pending:
            ev, device, leases = r.pending[0]
            if block:
                try:
                    ev.synchronize()
                except Exception:  # the driver is going away with the process
                    pass
            elif not ev.done:
                break
            r.pending.popleft()
            r.idle_events.setdefault(device, []).append(ev)
            _release_now(None, leases)
    finally:
        r.lock.release()


def _flush(r: _Releases) -> None:
    """One event per (device, stream) for the releases enqueued so far (caller holds lock)."""
    groups: dict[tuple, tuple] = {}
    while True:
        try:
            device, stream, lease = r.inbox.get_nowait()
        except queue.Empty:
            break
        if stream is None:
            _release_now(device, [lease])
            continue
        ptr = stream.ptr
        group = groups.get((device, ptr))
        if group is None:
            group = groups[(device, ptr)] = (stream, [])
        group[1].append(lease)
    cp = _device._cp
    for (device, _), (stream, leases) in groups.items():
        try:
            r.pending.append((_record(cp, r, device, stream.ptr), device, leases))
        except Exception:  # no event to be had: wait here instead
            _release_now(device, leases)


def _record(cp, r: _Releases, device: int, stream: int):
    with cp.cuda.Device(device):
        idle = r.idle_events.get(device)
        ev = idle.pop() if idle else cp.cuda.Event(block=False, disable_timing=True)
        cp.cuda.runtime.eventRecord(ev.ptr, stream)
    return ev


def _release_now(device: int | None, leases: list) -> None:
    """Release ``leases`` without an event: after ``device``'s work, if it can still say."""
    if device is not None:
        try:
            cp = _device._cp
            with cp.cuda.Device(device):
                cp.cuda.Device(device).synchronize()
        except Exception:  # the driver is going away: dying releases anyway
            pass
    for table_id, slot, done in leases:
        ofd_lease.release(table_id, slot)
        if done is not None:
            try:
                done()
            except Exception:  # shutting down
                pass


def _releaser(r: _Releases) -> None:
    """Wait for a release, let more gather for DRAIN_S, drain; until nothing is pending."""
    while r is _r:
        item = r.inbox.get()
        r.inbox.put(item)  # the drain takes it with the rest, in order of arrival
        time.sleep(DRAIN_S)
        drain(block=False)
        while r.pending and r is _r:
            time.sleep(DRAIN_S)
            drain(block=False)


def _after_fork_in_child() -> None:
    global _r
    _r = _Releases()  # the parent's releases and thread stay the parent's


os.register_at_fork(after_in_child=_after_fork_in_child)
