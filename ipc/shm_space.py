"""Room for shared memory: the memory cgroup's limit and usage, the machine's, and /dev/shm's.

Facts this module is built on (Linux):

* The pages of a memfd or of a file in /dev/shm (tmpfs) are charged to the memory cgroup of
  the process that first touches them (``posix_fallocate`` at creation, here), and stay
  charged while the file lives: while any fd or mapping of it exists, in any process.
  Without swap nothing can reclaim them.
* At its limit a cgroup reclaims page cache, then its OOM killer SIGKILLs a process in it:
  ``posix_fallocate`` does not fail first.  So the room is checked before reserving, and
  shared memory kept idle for reuse is given back as the cgroup nears its limit.
* cgroup v1: ``/proc/self/cgroup`` has ``N:memory:/PATH``; the hierarchy is mounted where
  ``/proc/self/mountinfo`` says (type ``cgroup``, super option ``memory``), and that mount's
  root (field 4) is ``/`` on a host, or ``PATH`` itself in a container that sees only its
  own cgroup.  Files: ``memory.limit_in_bytes`` (a number near 2**63: no limit),
  ``memory.usage_in_bytes``, ``memory.stat`` (``total_inactive_file``).
* cgroup v2: ``0::/PATH``, type ``cgroup2``; ``memory.max`` (``max``: no limit),
  ``memory.current``, ``memory.stat`` (``inactive_file``).  Where both are mounted, the
  memory controller is in the v1 hierarchy if ``/proc/self/cgroup`` names it there.
* Every ancestor's limit applies too: the room is the least over the levels up to the
  mount's root that have a limit.  Inactive page cache counts as free: the kernel drops it
  before it kills anything.
* The machine: ``MemAvailable`` in /proc/meminfo.  /dev/shm: ``statvfs``; its ``size=``
  caps named segments apart from any memory limit.

Reading the cgroup costs a few file reads per level (tens of microseconds), so readings are
kept briefly (:func:`memory_room`'s ``max_age``), less what this process reserved since.
"""

from __future__ import annotations

import os
import time

from .scm_rights import close_fds

__all__ = ["Room", "memory_room", "shm_free", "shortfall", "note_reserved", "forget",
           "cgroup_margin"]

_NO_LIMIT = 1 << 60  # v1 writes "no limit" as PAGE_COUNTER_MAX pages: about 2**63
_MOUNTINFO = "/proc/self/mountinfo"
_PROC_CGROUP = "/proc/self/cgroup"
FRESH_SECONDS = 0.1  # how long a reading stands in for a fresh one


class Room:
    """Free bytes for shared memory, what limits them (words for a message), and the
    memory cgroup's limit (None: no cgroup limit applies)."""

    __slots__ = ("free", "where", "limit")

    def __init__(self, free: int, where: str, limit: int | None) -> None:
        self.free, self.where, self.limit = free, where, limit

    def __repr__(self) -> str:
        return f"Room(free={self.free}, where={self.where!r}, limit={self.limit})"


def _read(path: str) -> bytes:
    made: list[int] = []  # stored by the C calls that open it (see posix_shm.create_memfd)
    try:
        made.extend(map(os.open, (path,), (os.O_RDONLY | os.O_CLOEXEC,)))
        return os.read(made[0], 1 << 16)
    finally:
        close_fds(made)


def _stat_value(text: bytes, key: bytes) -> int:
    """The number after ``key`` on its line of a memory.stat or /proc/meminfo text."""
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0].rstrip(b":") == key:
            return int(words[1])
    return 0


_mounts: dict[str, tuple[str, str]] | None = None  # "v1"/"v2" -> (mount root, mount point)


def _cgroup_mounts() -> dict[str, tuple[str, str]]:
    global _mounts
    if _mounts is None:
        found: dict[str, tuple[str, str]] = {}
        try:
            lines = _read(_MOUNTINFO).decode(errors="replace").splitlines()
        except OSError:
            lines = []
        for line in lines:
            head, sep, tail = line.partition(" - ")
            fields, rest = head.split(), tail.split()
            if not sep or len(fields) < 5 or len(rest) < 3:
                continue
            if rest[0] == "cgroup" and "memory" in rest[2].split(","):
                found.setdefault("v1", (fields[3], fields[4]))
            elif rest[0] == "cgroup2":
                found.setdefault("v2", (fields[3], fields[4]))
        _mounts = found
    return _mounts


def _levels() -> tuple[str, list[str]]:
    """The cgroup version ("v1"/"v2", "" for none) and this process's memory cgroup
    directories, innermost first, up to the mount's root."""
    try:
        lines = _read(_PROC_CGROUP).decode(errors="replace").splitlines()
    except OSError:
        return "", []
    mounts = _cgroup_mounts()
    v1 = v2 = None
    path: str | None  # each line's, then the chosen version's (None: not found)
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1 = path
        elif controllers == "" and line.startswith("0::"):
            v2 = path
    version, path = ("v1", v1) if v1 is not None and "v1" in mounts else ("v2", v2)
    if path is None or version not in mounts:
        return "", []
    root, point = mounts[version]
    if root != "/" and (path == root or path.startswith(root.rstrip("/") + "/")):
        path = path[len(root.rstrip("/")):]
    elif root != "/":
        path = "/"  # a namespaced view: the mount shows this process's own cgroup
    here = os.path.normpath(point + "/" + path.strip("/"))
    out = [here]
    while here != point and here.startswith(point + "/"):
        here = os.path.dirname(here)
        out.append(here)
    return version, out


def _cgroup_room() -> tuple[int, int, str] | None:
    """(free, limit, directory) of the tightest memory cgroup level, or None."""
    version, levels = _levels()
    best = None
    for d in levels:
        try:
            if version == "v1":
                limit = int(_read(d + "/memory.limit_in_bytes"))
            else:
                raw = _read(d + "/memory.max").strip()
                limit = _NO_LIMIT if raw == b"max" else int(raw)
            if limit >= _NO_LIMIT:
                continue
            usage = int(_read(d + ("/memory.usage_in_bytes" if version == "v1"
                                   else "/memory.current")))
            stat = _read(d + "/memory.stat")
        except (OSError, ValueError):
            continue  # not there (root of v2), or unreadable: no limit known here
        key = b"total_inactive_file" if version == "v1" else b"inactive_file"
        free = max(0, limit - usage + _stat_value(stat, key))
        if best is None or free < best[0]:
            best = (free, limit, d)
    return best


def _host_available() -> int:
    try:
        return _stat_value(_read("/proc/meminfo"), b"MemAvailable") * 1024
    except (OSError, ValueError):
        return 1 << 62  # unknown: let the reservation itself decide


_reading: tuple[float, Room] | None = None
_reserved_since = 0


def memory_room(max_age: float = FRESH_SECONDS) -> Room:
    """Memory free for new shared memory: the tightest memory cgroup's room, or the
    machine's available memory when that is less.  A reading up to ``max_age`` seconds
    old stands, less what this process reserved since (:func:`note_reserved`)."""
    global _reading, _reserved_since
    now = time.monotonic()
    if _reading is not None and now - _reading[0] <= max_age:
        room = _reading[1]
        return Room(max(0, room.free - _reserved_since), room.where, room.limit)
    host = _host_available()
    cg = _cgroup_room()
    if cg is not None and cg[0] <= host:
        room = Room(cg[0], f"the memory cgroup {cg[2]} (limit {_size(cg[1])})", cg[1])
    else:
        room = Room(host, "this machine's available memory", cg[1] if cg else None)
    _reading, _reserved_since = (now, room), 0
    return room


def note_reserved(nbytes: int) -> None:
    """This process just reserved ``nbytes``: a kept reading counts them as used."""
    global _reserved_since
    _reserved_since += nbytes


def forget() -> None:
    """Drop the kept reading (memory was given back): the next one is fresh."""
    global _reading
    _reading = None


def shm_free(shm_dir: str) -> int:
    st = os.statvfs(shm_dir)  # shutil.disk_usage's free, without importing shutil
    return st.f_bavail * st.f_frsize


def cgroup_margin(limit: int) -> int:
    """Room a reservation must leave under a cgroup limit: the processes in it need memory
    of their own, and going over is a SIGKILL, not an error."""
    return min(64 << 20, limit // 16)


def shortfall(nbytes: int, named: bool, shm_dir: str) -> tuple[int, str] | None:
    """None when ``nbytes`` more of shared memory fit; else (free bytes, what limits
    them).  A kept reading decides when it says yes; a no is read again fresh."""
    for max_age in (FRESH_SECONDS, -1.0):
        room = memory_room(max_age)
        free, where = room.free, room.where
        if room.limit is not None:
            free = max(0, free - cgroup_margin(room.limit))
        if named:
            fs = shm_free(shm_dir)
            if fs < free:
                free, where = fs, f"{shm_dir} (its size= mount option)"
        if nbytes <= free:
            return None
    return free, where


def _size(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 1024:,.1f} KiB"


def _after_fork_in_child() -> None:
    global _reading, _reserved_since
    _reading, _reserved_since = None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
