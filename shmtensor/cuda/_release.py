"""Releasing received device memory once this process's own work on it is done.

When the last array on a received allocation dies, its finalizer only *enqueues* the
release (:func:`enqueue`: a ``queue.SimpleQueue.put``, which takes no lock and is safe in
``__del__`` and weakref callbacks).  A *drain*, run by the next shmtensor CUDA call that
sends or receives (once ``BATCH`` releases or ``DRAIN_S`` have gathered) or by the releaser
thread (when nobody else drained for ``DRAIN_S``), records one event per (device, stream)
on the streams the arrays died on and releases each lease once its event is done, oldest
first.  (A per-thread default stream can only be named by its own thread: there the
finalizer records the event itself, a driver call that takes no lock.)  The releaser
sleeps on the queue itself, so it costs nothing while nothing dies.

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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

_monotonic = time.monotonic

from shmtensor.ipc import ofd_lease

from . import _device

if TYPE_CHECKING:
    from typing import TypeAlias

    # one release: (lease table id, slot, done), done(n) told of n releases at once
    Release: TypeAlias = tuple[str, int, Callable[[int], None] | None]

DRAIN_S = 0.002  # how long the releaser lets releases gather before draining them
BATCH = 64       # releases that make a sending or receiving call drain first
_PER_THREAD = 2  # cudaStreamPerThread: another thread recording on it records on its own


class _Releases:
    """Owner of every release not yet carried out (one per process; reset in a fork)."""

    def __init__(self) -> None:
        # (device, stream, lease)
        self.inbox: queue.SimpleQueue[tuple[int, Any, Release]] = queue.SimpleQueue()
        self.lock = threading.Lock()   # held by the draining thread
        # (event, device, [lease]): oldest first
        self.pending: deque[tuple[Any, int, list[Release]]] = deque()
        self.idle_events: dict[int, list[Any]] = {}  # device -> events done, to record again
        self.started = False           # the releaser thread (under lock)
        self.last = 0.0                # time.monotonic() of the last drain


_r = _Releases()


def enqueue(device: int, table_id: str, slot: int,
            done: Callable[[int], None] | None = None) -> None:
    """From a finalizer: release ``(table_id, slot)`` once the work this thread queued on
    ``device``'s current stream is done, then call ``done(n)``: ``n`` releases that
    gave the same ``done`` object are reported in one call.  Takes no lock."""
    try:
        cp = _device._cp
        stream = cp.cuda.get_current_stream(device)  # kept alive until the drain records
        if stream.ptr == _PER_THREAD:  # names this thread's stream in this thread only:
            with cp.cuda.Device(device):  # record now (driver calls, no lock)
                stream = cp.cuda.Event(block=False, disable_timing=True)
                stream.record(cp.cuda.get_current_stream())
    except Exception:  # interpreter shutting down, or a CuPy without the argument
        stream = None
    _r.inbox.put((device, stream, (table_id, slot, done)))


def poll() -> None:
    """From a sending or receiving call: drain (without waiting) once ``BATCH`` releases or
    ``DRAIN_S`` have gathered.  A busy process drains here, in its own thread: the releaser
    only drains what nobody drained for ``DRAIN_S``, so it does not contend for the GIL and
    the locks a drain takes with a thread that is sending or receiving."""
    r = _r
    n = r.inbox.qsize()
    if n >= BATCH or ((n or r.pending) and _monotonic() - r.last >= DRAIN_S):
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
        r.last = _monotonic()
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
    cp = _device._cp
    groups: dict[tuple[int, int], tuple[Any, list[Release]]] = {}
    while True:
        try:
            device, stream, lease = r.inbox.get_nowait()
        except queue.Empty:
            break
        if stream is None:
            _release_now(device, [lease])
            continue
        if isinstance(stream, cp.cuda.Event):  # recorded by the finalizer
            r.pending.append((stream, device, [lease]))
            continue
        ptr = stream.ptr
        group = groups.get((device, ptr))
        if group is None:
            group = groups[(device, ptr)] = (stream, [])
        group[1].append(lease)
    for (device, _), (stream, leases) in groups.items():
        try:
            r.pending.append((_record(cp, r, device, stream.ptr), device, leases))
        except Exception:  # no event to be had: wait here instead
            _release_now(device, leases)


def _record(cp: Any, r: _Releases, device: int, stream: int) -> Any:
    with cp.cuda.Device(device):
        idle = r.idle_events.get(device)
        ev = idle.pop() if idle else cp.cuda.Event(block=False, disable_timing=True)
        cp.cuda.runtime.eventRecord(ev.ptr, stream)
    return ev


def _release_now(device: int | None, leases: list[Release]) -> None:
    """Release ``leases`` without an event: after ``device``'s work, if it can still say."""
    if device is not None:
        try:
            cp = _device._cp
            with cp.cuda.Device(device):
                cp.cuda.Device(device).synchronize()
        except Exception:  # the driver is going away: dying releases anyway
            pass
    # grouped: one take of each holding's lock, one call of each ``done`` with its count
    slots: dict[str, list[int]] = {}
    dones: dict[Callable[[int], None], int] = {}
    for table_id, slot, done in leases:
        group = slots.get(table_id)
        if group is None:
            slots[table_id] = [slot]
        else:
            group.append(slot)
        if done is not None:
            dones[done] = dones.get(done, 0) + 1
    for table_id, group in slots.items():
        ofd_lease.release_many(table_id, group)
    for done, n in dones.items():
        try:
            done(n)
        except Exception:  # shutting down
            pass


def _releaser(r: _Releases) -> None:
    """Wait for a release; then, while any is queued or pending, drain what nobody else has
    drained for ``DRAIN_S``."""
    while r is _r:
        item = r.inbox.get()
        r.inbox.put(item)  # the drain takes it with the rest
        while (r.pending or not r.inbox.empty()) and r is _r:
            time.sleep(DRAIN_S)
            if _monotonic() - r.last >= DRAIN_S:
                drain(block=False)


def _after_fork_in_child() -> None:
    global _r
    _r = _Releases()  # the parent's releases and thread stay the parent's


os.register_at_fork(after_in_child=_after_fork_in_child)
