"""Segments mapped in this process, the anchors that arrays hang from, and the receive cache.

Every array whose memory is a segment is a view of that segment's *anchor*: a uint8 array
over the whole mapping.  While any view lives, the anchor lives, and the anchor holds the
segment's lease (see :mod:`ipc.ofd_lease`).  When the last view dies the anchor dies, the
lease is released, and the mapping stays cached (idle): a segment that comes back, because
its creator recycled it or because it is sent again, costs no new mapping.  Idle mappings
of other processes' segments are evicted by age and by total size.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import OrderedDict

import numpy as np

from shmtensor.ipc import ofd_lease, posix_shm

from . import _stats

FD, FS = "file_descriptor", "file_system"

# Idle mappings of other processes' segments kept for reuse (see module docstring).
CACHE_IDLE_SECONDS = 30.0
CACHE_IDLE_BYTES = 2 << 30
CACHE_IDLE_COUNT = 512


class Segment:
    """One segment mapped in this process, made here (``own``) or attached from elsewhere."""

    __slots__ = ("key", "kind", "size", "table_id", "slot", "own", "mm", "fd", "address",
                 "_anchor", "idle_since", "pinned", "__weakref__")

    def anchor(self, lease_fd: int | None = None, deferred: list | None = None) -> np.ndarray:
        """The live anchor (made, and the lease held, if none is alive).  ``lease_fd``: a
        description of the segment's lease table, for a process that has none yet (and,
        with ``deferred``, the message's in-flight lock: see ``ofd_lease.hold``)."""
        ref = self._anchor
        a = ref() if ref is not None else None
        if a is None:
            with _lock:
                a = self._anchor() if self._anchor is not None else None
                if a is None:
                    if self.mm is None:
                        raise LookupError(f"segment {self.key} was unmapped here")
                    a = np.frombuffer(self.mm.buffer, np.uint8, count=self.size)
                    ofd_lease.hold(self.table_id, self.slot, lease_fd, deferred)
                    self._anchor = weakref.ref(a)
                    f = weakref.finalize(a, _anchor_died, self)
                    f.atexit = False
                    _idle_drop(self)
                    if self.own:
                        _own_busy_hook(self)
        return a

    def alive(self) -> bool:
        return self._anchor is not None and self._anchor() is not None

    def close(self) -> None:
        """Unmap and close; only when no anchor is alive (views would dangle)."""
        if self.mm is not None:
            if self.alive():
                return
            _by_buffer.pop(id(self.mm.buffer), None)
            self.mm.close()
            self.mm = None
        if self.fd is not None:
            _close_fd(self)
        if _by_key.get(self.key) is self:
            del _by_key[self.key]
        _idle_drop(self)


def _close_fd(seg: Segment) -> None:
    global _kept_fds
    try:
        os.close(seg.fd)
    except OSError:
        pass
    if not seg.own:
        _kept_fds -= 1
    seg.fd = None


_lock = threading.RLock()
_by_key: dict[str, Segment] = {}
_by_buffer: dict[int, Segment] = {}  # id(mapping buffer) -> segment: ends every base chain
_idle: "OrderedDict[str, Segment]" = OrderedDict()  # attached segments with no live anchor
_idle_bytes = 0  # their total size, kept as they come and go (evict_idle runs per release)


def _idle_put(seg: Segment) -> None:
    global _idle_bytes
    if _idle.get(seg.key) is not seg:
        _idle_bytes += seg.size
    _idle[seg.key] = seg
    _idle.move_to_end(seg.key)


def _idle_drop(seg: Segment) -> None:
    global _idle_bytes
    if _idle.get(seg.key) is seg:
        del _idle[seg.key]
        _idle_bytes -= seg.size
_kept_fds = 0
_own_busy_hook = lambda seg: None  # noqa: E731 - set by _recycler
_own_idle_hook = lambda seg: None  # noqa: E731 - set by _recycler
_attached_idle_hook = lambda: None  # noqa: E731 - set by _recycler


def _anchor_died(seg: Segment) -> None:
    ofd_lease.release(seg.table_id, seg.slot)
    seg.idle_since = time.monotonic()
    if seg.own:
        if not seg.pinned:
            _own_idle_hook(seg)
    else:
        with _lock:
            if _by_key.get(seg.key) is seg and not seg.alive():
                _idle_put(seg)
        evict_idle()
        _attached_idle_hook()


def segment_of(a) -> Segment | None:
    """The segment holding ``a``'s memory, or None when ``a`` is not shared."""
    b = a.base
    while b is not None:
        if isinstance(b, np.ndarray):
            b = b.base
        elif isinstance(b, memoryview):
            b = b.obj
        else:
            return _by_buffer.get(id(b))
    return None


def receive(key: str, kind: str, size: int, table_id: str, slot: int, fd: int | None,
            lease_fd: int, deferred: list | None = None) -> tuple[np.ndarray, bool]:
    """The anchor of segment ``key`` here, mapping the segment if this process has not
    (from ``fd``, or by name); ``lease_fd`` came with the message (its in-flight lock;
    ``deferred`` as for ``ofd_lease.hold``).  Returns (anchor, whether ``fd`` was kept)."""
    global _kept_fds
    with _lock:  # lookup, map and anchor as one step: eviction cannot slip in between
        seg = _by_key.get(key)
        if seg is not None and seg.mm is not None:
            return seg.anchor(lease_fd, deferred), False
        mapfd = fd if kind == FD else posix_shm.open_named(key)
        try:
            seg = new_segment(key, kind, size, table_id, slot, own=False, fd=mapfd)
        except BaseException:
            if kind == FS:
                os.close(mapfd)
            raise
        took = kind == FD and _kept_fds < ofd_lease.kept_budget()
        if took:
            _kept_fds += 1  # kept: this process can forward the segment without a copy
        else:
            seg.fd = None
            if kind == FS:
                os.close(mapfd)
        _by_key[key] = seg
        anchor = seg.anchor(lease_fd, deferred)
    _stats.bump("segments_attached")
    _stats.bump("bytes_attached", size)
    return anchor, took


def new_segment(key, kind, size, table_id, slot, own, fd, populate=False) -> Segment:
    seg = Segment.__new__(Segment)
    seg.key, seg.kind, seg.size = key, kind, size
    seg.table_id, seg.slot, seg.own = table_id, slot, own
    seg.fd = fd
    seg.address = 0
    seg._anchor = None
    seg.idle_since = time.monotonic()
    seg.pinned = False  # reserved by a BatchPool: never handed to the recycler
    seg.mm = posix_shm.map_fd(fd, size, populate)
    seg.address = seg.mm.address
    _by_buffer[id(seg.mm.buffer)] = seg
    return seg


def evict_idle(force: bool = False) -> int:
    """Unmap idle attached segments past the cache limits (all of them with ``force``).
    Oldest first, and it stops at the first one within every limit."""
    now = time.monotonic()
    freed = 0
    with _lock:
        while _idle:
            seg = next(iter(_idle.values()))
            if not (force or len(_idle) > CACHE_IDLE_COUNT or _idle_bytes > CACHE_IDLE_BYTES
                    or now - seg.idle_since > CACHE_IDLE_SECONDS):
                break
            _idle_drop(seg)
            if seg.alive():
                continue
            freed += seg.size
            seg.close()
            _stats.bump("segments_evicted")
    return freed


def mapped() -> list[Segment]:
    with _lock:
        return list(_by_key.values())


def after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()
