"""Process-wide counters behind :func:`shmtensor.debug_info` (fixed, disjoint keys), and
the grouped dict it returns."""

from __future__ import annotations

import threading
from typing import Any

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


# The flat names of the core counters (the keys of ``snapshot()`` and of the live counts
# ``debug_info`` adds), by group and name in it.  Adapters' counters are named
# ``<group>_<name>`` already ("cuda_opened", "torch_storages_shared").
FLAT = {
    "segments_created": ("segments", "created"),
    "bytes_created": ("segments", "bytes_created"),
    "segments_recycled": ("segments", "recycled"),
    "segments_destroyed": ("segments", "destroyed"),
    "slabs_started": ("segments", "slabs_started"),
    "segments_attached": ("segments", "attached"),
    "bytes_attached": ("segments", "bytes_attached"),
    "segments_evicted": ("segments", "evicted"),
    "segments_own_live": ("segments", "own_live"),
    "segments_own_idle": ("segments", "own_idle"),
    "segments_attached_live": ("segments", "attached_live"),
    "segments_attached_idle": ("segments", "attached_idle"),
    "bytes_mapped": ("segments", "bytes_mapped"),
    "arrays_sent_shared": ("arrays", "sent_shared"),
    "arrays_sent_copied": ("arrays", "sent_copied"),
    "arrays_sent_inline": ("arrays", "sent_inline"),
    "arrays_received": ("arrays", "received"),
    "lease_tables": ("leases", "tables"),
}


class DebugInfo(dict[str, Any]):
    """:func:`shmtensor.debug_info`'s dict: one dict per subsystem (``info["segments"]
    ["created"]``).  The flat names of earlier versions still read the same numbers
    (``info["segments_created"]``, ``info.get("cuda_opened", 0)``, ``"lease_tables" in
    info``), without being listed among the keys."""

    def _where(self, key: object) -> tuple[str, str] | None:
        if not isinstance(key, str):
            return None
        if key in FLAT:
            return FLAT[key]
        group, _, name = key.partition("_")
        return (group, name) if name and isinstance(dict.get(self, group), dict) else None

    def __missing__(self, key: str) -> Any:
        where = self._where(key)
        if where is None or where[1] not in self[where[0]]:
            raise KeyError(key)
        return self[where[0]][where[1]]

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        if dict.__contains__(self, key):
            return True
        where = self._where(key)
        return where is not None and where[1] in dict.get(self, where[0], {})


def grouped(flat: dict[str, int], more: dict[str, Any]) -> DebugInfo:
    """A :class:`DebugInfo` of the flat counters, grouped (see ``FLAT``), and ``more``."""
    info = DebugInfo()
    for key, value in flat.items():
        group, name = FLAT.get(key) or key.split("_", 1)
        info.setdefault(group, {})[name] = value
    info.update(more)
    return info


def after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()
