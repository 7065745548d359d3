"""Who maps or holds which shmtensor segment, read from /proc (Linux).

``/proc/PID/maps`` lists every mapping with its file (``/dev/shm/NAME`` or
``/memfd:NAME (deleted)``), and ``/proc/PID/fd/*`` links name every open file.  Processes
this user may not inspect are skipped silently: run as their owner (or root) to see them.

/dev/shm is writable by every local user, so a name that looks like shmtensor's may be
anything: a FIFO (whose open for reading waits for a writer, forever), a symlink to a file
elsewhere (or to a device, or to a FIFO its planter watches), a directory.  shmtensor
makes regular files only.  Everything that looks into /dev/shm by name (``clean``, ``ls``,
``leak-check``, the janitor) goes through :func:`shm_entries` (``lstat``, never following)
and :func:`open_segment_file` (a regular file, opened with ``O_NOFOLLOW | O_NONBLOCK``),
and leaves anything else alone.
"""

from __future__ import annotations

import errno
import os
import stat

from . import posix_shm

__all__ = ["SegmentUse", "scan", "named_segments", "shm_entries", "file_kind",
           "open_segment_file"]


class SegmentUse:
    """Who maps (``mapped_by``) and who has open (``fd_held_by``) segment ``name``, and the
    uid owning the file as seen through an open fd of it (``uid``; None when no readable
    process has one open).  A plain class, not a dataclass: the CLI imports this module,
    and dataclasses would cost each ``shmtensor leak-check`` run ~7 ms of imports."""

    __slots__ = ("name", "mapped_by", "fd_held_by", "size", "uid")

    def __init__(self, name: str, mapped_by: set[int] | None = None,
                 fd_held_by: set[int] | None = None, size: int = 0,
                 uid: int | None = None) -> None:
        self.name = name
        self.mapped_by = set() if mapped_by is None else mapped_by
        self.fd_held_by = set() if fd_held_by is None else fd_held_by
        self.size = size
        self.uid = uid

    def __repr__(self) -> str:
        return (f"SegmentUse({self.name!r}, mapped_by={self.mapped_by}, "
                f"fd_held_by={self.fd_held_by}, size={self.size}, uid={self.uid})")


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
                        u = uses.setdefault(key, SegmentUse(key))
                        u.fd_held_by.add(pid)
                        if u.uid is None:  # a memfd's owner: its inode, through the fd
                            try:
                                u.uid = os.stat(f"{fddir}/{fd}").st_uid
                            except OSError:
                                pass
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return uses


def shm_entries() -> dict[str, os.stat_result]:
    """Every shmtensor-like name in /dev/shm and its ``lstat`` (a symlink's own, never what
    it points to): segments, and whatever else was put there under such a name."""
    out: dict[str, os.stat_result] = {}
    try:
        names = os.listdir(posix_shm.SHM_DIR)
    except FileNotFoundError:
        return out
    for name in names:
        if posix_shm.parse_name(name) is not None:
            try:
                out[name] = os.lstat(os.path.join(posix_shm.SHM_DIR, name))
            except FileNotFoundError:
                continue
    return out


def named_segments() -> dict[str, int]:
    """Every shmtensor segment in /dev/shm (a regular file) and its size."""
    return {name: st.st_size for name, st in shm_entries().items() if stat.S_ISREG(st.st_mode)}


_KINDS = ((stat.S_ISREG, "file"), (stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "fifo"),
          (stat.S_ISDIR, "directory"), (stat.S_ISSOCK, "socket"),
          (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))


def file_kind(st: os.stat_result) -> str:
    """What ``st`` (an ``lstat``) is, in a word: file, symlink, fifo, directory, ..."""
    return next((word for test, word in _KINDS if test(st.st_mode)), "unknown")


_SAFE_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def open_segment_file(name: str, uid: int | None = None) -> int | None:
    """A read-only fd of the regular file /dev/shm/NAME (owned by ``uid`` when given), or
    None when NAME is anything else, which is left unopened (or closed at once when it was
    swapped in between the look and the open: ``O_NONBLOCK`` keeps that open from
    waiting on a FIFO, ``O_NOFOLLOW`` from following a symlink).  Raises FileNotFoundError
    when NAME is gone, OSError when it cannot be opened (permission, no fds left)."""
    path = os.path.join(posix_shm.SHM_DIR, name)
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or (uid is not None and st.st_uid != uid):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | _SAFE_OPEN)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink now
            return None
        raise
    st2 = os.fstat(fd)
    if (st2.st_ino, st2.st_dev) != (st.st_ino, st.st_dev) or not stat.S_ISREG(st2.st_mode):
        os.close(fd)  # replaced between the look and the open: look again later
        return None
    return fd
