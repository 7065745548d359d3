"""Leases: who still uses a segment, told by open-file-description locks.

Facts this module is built on (Linux >= 3.15):

* An OFD lock (``F_OFD_SETLK``) belongs to an *open file description*, not to a process.
  It goes away when the last fd of that description is closed, and only then; the kernel
  closes every fd of a process that dies, SIGKILL included.
* An fd in flight in a Unix socket (SCM_RIGHTS) keeps its description, and so its locks,
  alive until it is received or the socket is destroyed.
* Reopening ``/proc/self/fd/N`` gives a *new* description of the same file.  Read locks of
  different descriptions coexist; ``F_OFD_GETLK`` for a write lock reports any of them.
* Locks may cover bytes past the end of a file: the lock file below stays empty.

Each process that creates segments has one *lease table*: an empty memfd whose byte ``i``
stands for its segment ``i``.  A process holds segment ``i`` by read-locking byte ``i``
through its one *holding* description of that table (one fd per peer, never one per array).
A message that carries segments carries an *in-flight* description with the same bytes
locked, so nothing is reusable between the sender letting go and the receiver taking hold.
The creator may reuse segment ``i`` once nobody holds byte ``i``: every array view in every
process is gone, no message carrying it is in flight, or the holders are dead.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading

from .posix_shm import PREFIX, process_tag

__all__ = ["HAVE_OFD_LOCKS", "LeaseTable", "own_table", "holdings", "hold", "release",
           "inflight_fd", "forget_idle", "adopt_table", "table_count", "after_fork_in_child"]

HAVE_OFD_LOCKS = hasattr(fcntl, "F_OFD_SETLK")
_FLOCK = struct.Struct("hhqqi4x")  # struct flock on Linux x86-64 and aarch64


def _reopen(fd: int) -> int:
    return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


def _setlk(fd: int, kind: int, slot: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, slot, 1, 0))


class LeaseTable:
    """This process's lease table: allocates slots and tells whether anyone holds one."""

    def __init__(self) -> None:
        self.id = process_tag()
        self.fd = os.memfd_create(f"{PREFIX}_{self.id}_lease", os.MFD_CLOEXEC)
        self._probe = _reopen(self.fd)
        self._next = 0
        self._lock = threading.Lock()

    def new_slot(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def is_held(self, slot: int) -> bool:
        """True while any process, this one included, holds ``slot`` or a message carries it."""
        res = fcntl.fcntl(self._probe, fcntl.F_OFD_GETLK,
                          _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, slot, 1, 0))
        return _FLOCK.unpack(res)[0] != fcntl.F_UNLCK

    def close(self) -> None:
        for fd in (self._probe, self.fd):
            try:
                os.close(fd)
            except OSError:
                pass


class _Holding:
    """This process's one description of a table, and how many holds it has on each slot."""

    __slots__ = ("table_id", "fd", "counts", "lock")

    def __init__(self, table_id: str, fd: int) -> None:
        self.table_id = table_id
        self.fd = fd
        self.counts: dict[int, int] = {}
        self.lock = threading.Lock()


_own: LeaseTable | None = None
_holdings: dict[str, _Holding] = {}
_registry_lock = threading.Lock()


def own_table() -> LeaseTable:
    """The lease table of this process, made on first use."""
    global _own
    if _own is None:
        with _registry_lock:
            if _own is None:
                _own = LeaseTable()
                _holdings[_own.id] = _Holding(_own.id, _reopen(_own.fd))
    return _own


def holdings(table_id: str) -> _Holding | None:
    return _holdings.get(table_id)


def adopt_table(table_id: str, fd: int) -> _Holding:
    """Make sure this process has its own holding description of ``table_id`` (from ``fd``)."""
    h = _holdings.get(table_id)
    if h is None:
        with _registry_lock:
            h = _holdings.get(table_id)
            if h is None:
                h = _holdings[table_id] = _Holding(table_id, _reopen(fd))
    return h


def hold(table_id: str, slot: int) -> None:
    h = _holdings[table_id]
    with h.lock:
        n = h.counts.get(slot, 0)
        if n == 0:
            _setlk(h.fd, fcntl.F_RDLCK, slot)
        h.counts[slot] = n + 1


def release(table_id: str, slot: int) -> None:
    h = _holdings.get(table_id)
    if h is None:
        return
    with h.lock:
        n = h.counts.get(slot, 0)
        if n <= 1:
            h.counts.pop(slot, None)
            if n == 1:
                try:
                    _setlk(h.fd, fcntl.F_UNLCK, slot)
                except OSError:  # fd closed at interpreter shutdown: dying releases anyway
                    pass
        else:
            h.counts[slot] = n - 1


def inflight_fd(table_id: str, slots) -> int:
    """A new description of ``table_id`` with ``slots`` read-locked, to travel with a message."""
    fd = _reopen(_holdings[table_id].fd)
    try:
        for slot in slots:
            _setlk(fd, fcntl.F_RDLCK, slot)
    except BaseException:
        os.close(fd)
        raise
    return fd


def forget_idle() -> int:
    """Close the holding descriptions of peer tables through which nothing is held."""
    closed = 0
    with _registry_lock:
        for tid, h in list(_holdings.items()):
            if _own is not None and tid == _own.id:
                continue
            with h.lock:
                if h.counts:
                    continue
                del _holdings[tid]
                try:
                    os.close(h.fd)
                except OSError:
                    pass
                closed += 1
    return closed


def own_fds() -> set[int]:
    """The fds of this process's own table: one set per process, open for its lifetime."""
    if _own is None:
        return set()
    h = _holdings.get(_own.id)
    return {_own.fd, _own._probe} | ({h.fd} if h is not None else set())


def table_count() -> int:
    return len(_holdings)


def after_fork_in_child() -> None:
    """Give the child descriptions of its own: the parent's locks must not move with ours."""
    global _own, _registry_lock
    _registry_lock = threading.Lock()
    if _own is not None:
        _own.close()
        _own = None  # the parent's table: the child allocates slots in a table of its own
    for h in list(_holdings.values()):
        old = h.fd
        h.lock = threading.Lock()
        try:
            h.fd = _reopen(old)
            for slot in h.counts:
                _setlk(h.fd, fcntl.F_RDLCK, slot)
        except OSError:
            h.counts.clear()
        try:
            os.close(old)
        except OSError:
            pass
