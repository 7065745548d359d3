"""Who maps or holds which shmtensor segment, read from /proc (Linux).

``/proc/PID/maps`` lists every mapping with its file (``/dev/shm/NAME`` or
``/memfd:NAME (deleted)``), and ``/proc/PID/fd/*`` links name every open file.  Processes
this user may not inspect are skipped silently: run as their owner (or root) to see them.
"""

from __future__ import annotations

import os

from . import posix_shm

__all__ = ["SegmentUse", "scan", "named_segments"]


class SegmentUse:
    """Who maps (``mapped_by``) and who has open (``fd_held_by``) segment ``name``.
    A plain class, not a dataclass: the CLI imports this module, and dataclasses would
    cost each ``shmtensor leak-check`` run ~7 ms of imports."""

    __slots__ = ("name", "mapped_by", "fd_held_by", "size")

    def __init__(self, name: str, mapped_by: set[int] | None = None,
                 fd_held_by: set[int] | None = None, size: int = 0) -> None:
        self.name = name
        self.mapped_by = set() if mapped_by is None else mapped_by
        self.fd_held_by = set() if fd_held_by is None else fd_held_by
        self.size = size

    def __repr__(self) -> str:
        return (f"SegmentUse({self.name!r}, mapped_by={self.mapped_by}, "
                f"fd_held_by={self.fd_held_by}, size={self.size})")


def _segment_key(path: str) -> str | None:
    key = posix_shm.segment_key(path)
    return key if posix_shm.parse_name(key) is not None else None


def scan() -> dict[str, SegmentUse]:
    """Every shmtensor segment some readable process maps or has open, and who does."""
    uses: dict[str, SegmentUse] = {}
    marker = posix_shm.PREFIX + "_"
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                for line in f:
                    if marker.encode() not in line:
                        continue
                    parts = line.decode(errors="replace").split(None, 5)
                    if len(parts) < 6:
                        continue
                    key = _segment_key(parts[5].strip())
                    if key is None:
                        continue
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    u = uses.setdefault(key, SegmentUse(key))
                    u.mapped_by.add(pid)
                    u.size = max(u.size, hi - lo)
            fddir = f"/proc/{pid}/fd"
            for fd in os.listdir(fddir):
                try:
                    target = os.readlink(f"{fddir}/{fd}")
                except OSError:
                    continue
                if marker in target:
                    key = _segment_key(target)
                    if key is not None:
                        uses.setdefault(key, SegmentUse(key)).fd_held_by.add(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return uses


def named_segments() -> dict[str, int]:
    """Every shmtensor file in /dev/shm and its size."""
    out = {}
    try:
        names = os.listdir(posix_shm.SHM_DIR)
    except FileNotFoundError:
        return out
    for name in names:
        if posix_shm.parse_name(name) is not None:
            try:
                out[name] = os.stat(os.path.join(posix_shm.SHM_DIR, name)).st_size
            except FileNotFoundError:
                continue
    return out
