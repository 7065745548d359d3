"""Process-wide counters behind :func:`shmtensor.debug_info` (fixed, disjoint keys)."""

from __future__ import annotations

import threading

_KEYS = (
    "segments_created",    # own segments made (memfd or /dev/shm)
    "bytes_created",       # their total capacity
    "segments_recycled",   # own segments handed out again after every holder let go
    "segments_destroyed",  # own segments unmapped and closed (or unlinked)
    "slabs_started",       # own segments (new or recycled) that small arrays are carved from
    "segments_attached",   # other processes' segments mapped here
    "bytes_attached",
    "segments_evicted",    # idle attached mappings dropped from the receive cache
    "arrays_sent_shared",  # arrays that crossed as a handle to a segment
    "arrays_sent_copied",  # not-shared arrays copied once into a segment to cross
    "arrays_sent_inline",  # small arrays pickled into the message
    "arrays_received",     # arrays rebuilt on a segment here
)
_counts = dict.fromkeys(_KEYS, 0)
_lock = threading.RLock()


def bump(key: str, n: int = 1) -> None:
    with _lock:
        _counts[key] += n


def snapshot() -> dict[str, int]:
    with _lock:
        return dict(_counts)


def after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()
