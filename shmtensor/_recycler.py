"""Own segments: made here, handed out, and reused once every holder everywhere let go.

Setting up a fresh segment's pages costs several times the copy into it, so a segment
whose last local view died goes into an idle list instead of being unmapped.  ``acquire``
reuses an idle segment of a fitting size as soon as its lease says that no process holds
it and no message carries it (``LeaseTable.is_held``); otherwise it makes a new one.  Idle
segments past an age or a byte budget are destroyed, but only once unheld: a named
segment must keep its name while a message in flight may still attach to it.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections import OrderedDict
from itertools import islice

from shmtensor.ipc import janitor, ofd_lease, posix_shm

from . import _segments, _stats
from ._segments import FD, FS

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
IDLE_SECONDS = {FD: 30.0, FS: 5.0}  # named segments are visible in /dev/shm: keep them briefly
IDLE_BYTES = 4 << 30
_PROBE_LIMIT = 16

_lock = threading.RLock()
# Idle own segments by capacity class (bit length), each oldest-first; plus all of them in
# idle order for trimming.  Sizes are page multiples, so a class holds sizes within 2x.
_buckets: dict[int, "OrderedDict[str, _segments.Segment]"] = {}
_idle: "OrderedDict[str, _segments.Segment]" = OrderedDict()
_idle_bytes = 0
_SCAN_LIMIT = 64


def _capacity(nbytes: int) -> int:
    return -(-max(nbytes, 1) // PAGE) * PAGE


def _fits(cap: int, need: int) -> bool:
    return need <= cap <= max(2 * need, need + (64 << 10))


def _take(seg: _segments.Segment) -> None:
    global _idle_bytes
    del _idle[seg.key]
    del _buckets[seg.size.bit_length()][seg.key]
    _idle_bytes -= seg.size


def acquire(nbytes: int, kind: str) -> _segments.Segment:
    """A segment of at least ``nbytes`` that nobody holds: recycled if possible, else new."""
    need = _capacity(nbytes)
    table = ofd_lease.own_table()
    with _lock:
        probed = scanned = 0
        for cls in (need.bit_length(), need.bit_length() + 1):
            bucket = _buckets.get(cls)
            if not bucket:
                continue
            for seg in list(islice(bucket.values(), _SCAN_LIMIT)):  # a snapshot: finalizers may edit
                scanned += 1
                if scanned > _SCAN_LIMIT or probed >= _PROBE_LIMIT:
                    break
                if seg.kind != kind or not _fits(seg.size, need) or bucket.get(seg.key) is not seg:
                    continue
                probed += 1
                if not table.is_held(seg.slot):
                    _take(seg)
                    _stats.bump("segments_recycled")
                    return seg
                bucket.move_to_end(seg.key)  # held for long: look at the others first next time
    trim()
    return _create(need, kind, table)


def _create(size: int, kind: str, table: ofd_lease.LeaseTable) -> _segments.Segment:
    slot = table.new_slot()
    name = posix_shm.segment_name(slot)
    if kind == FD:
        fd = posix_shm.create_memfd(name, size)
    else:
        # The janitor hears of the name before the file exists: a SIGKILL in between
        # leaves nothing it does not know about.
        janitor.track(name, slot, table.fds)
        try:
            fd = posix_shm.create_named(name, size)
        except BaseException:
            janitor.untrack(name)
            raise
    try:
        seg = _segments.new_segment(name, kind, size, table.id, slot, own=True, fd=fd,
                                    populate=True)
    except BaseException:
        os.close(fd)
        if kind == FS:
            posix_shm.unlink_named(name)
        raise
    if kind == FS:
        os.close(fd)  # attached by name: no fd needed
        seg.fd = None
    with _segments._lock:
        _segments._by_key[name] = seg
    _stats.bump("segments_created")
    _stats.bump("bytes_created", size)
    return seg


def _on_idle(seg: _segments.Segment) -> None:
    global _idle_bytes
    with _lock:
        if seg.key in _segments._by_key and not seg.alive() and seg.key not in _idle:
            _idle[seg.key] = seg
            _buckets.setdefault(seg.size.bit_length(), OrderedDict())[seg.key] = seg
            _idle_bytes += seg.size
    trim()
    _ensure_sweeper()


def _on_busy(seg: _segments.Segment) -> None:
    with _lock:
        if seg.key in _idle:
            _take(seg)


_sweeper: threading.Thread | None = None
SWEEP_SECONDS = 1.0


def _sweep() -> None:
    """Apply the idle limits while the process is otherwise quiet; stop when nothing idles."""
    global _sweeper
    while True:
        time.sleep(SWEEP_SECONDS)
        try:
            trim()
            _segments.evict_idle()
        except Exception:  # interpreter shutting down: nothing left to sweep for
            return
        with _lock:
            if not _idle and not _segments._idle:
                _sweeper = None
                return


def _ensure_sweeper() -> None:
    global _sweeper
    if _sweeper is None:
        with _lock:
            if _sweeper is None:
                _sweeper = threading.Thread(target=_sweep, daemon=True, name="shmtensor-sweeper")
                _sweeper.start()


_segments._own_idle_hook = _on_idle
_segments._own_busy_hook = _on_busy
_segments._attached_idle_hook = _ensure_sweeper


def _destroy(seg: _segments.Segment) -> None:
    seg.close()
    if seg.kind == FS:
        posix_shm.unlink_named(seg.key)
        janitor.untrack(seg.key)
    _stats.bump("segments_destroyed")


def trim(force: bool = False) -> int:
    """Destroy idle, unheld own segments past the age or byte budget (all with ``force``).

    Cheap when there is nothing to do: it looks at the oldest entries only."""
    if not _idle:
        return 0
    now = time.monotonic()
    if not force and _idle_bytes <= IDLE_BYTES:
        with _lock:
            oldest = next(iter(_idle.values()), None)
        if oldest is None or now - oldest.idle_since <= IDLE_SECONDS[oldest.kind]:
            return 0  # the common case on every release: nothing is due
    freed = 0
    table = ofd_lease.own_table()
    with _lock:
        oldest = list(_idle.values()) if force else list(islice(_idle.values(), _SCAN_LIMIT))
        for seg in oldest:
            old = now - seg.idle_since > IDLE_SECONDS[seg.kind]
            if not (force or old or _idle_bytes > IDLE_BYTES):
                break  # oldest first: the rest are younger
            if seg.alive() or _idle.get(seg.key) is not seg:
                continue
            if table.is_held(seg.slot):
                _idle.move_to_end(seg.key)  # still held elsewhere: let the scan reach others
                continue
            _take(seg)
            freed += seg.size
            _destroy(seg)
    return freed


def idle_segments() -> list[_segments.Segment]:
    with _lock:
        return list(_idle.values())


def after_fork_in_child() -> None:
    """The parent's segments are not the child's to reuse: forget them (views stay valid)."""
    global _lock, _sweeper, _idle_bytes
    _lock = threading.RLock()
    _sweeper = None
    for seg in list(_idle.values()):
        if not seg.alive():
            seg.close()
    _idle.clear()
    _buckets.clear()
    _idle_bytes = 0
    for seg in _segments.mapped():
        if seg.own:
            seg.own = False
            if seg.fd is not None:
                _segments._kept_fds += 1


@atexit.register
def _at_exit() -> None:
    try:
        trim(force=True)
    except Exception:  # never fail interpreter shutdown over a cache
        pass
