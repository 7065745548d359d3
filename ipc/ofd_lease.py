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

Each process that creates segments has one *lease table*: ``SHARDS`` empty memfds, byte
``i`` of file ``i % SHARDS`` standing for its segment ``i``.  A process holds segment ``i``
by read-locking byte ``i`` through its *holding* description of that file (at most one fd
per peer and file, never one per array; a process that has heard from more than
:func:`holdings_kept` peers closes the descriptions of those it holds nothing from).
A message that carries segments carries an *in-flight* description with the same bytes
locked, so nothing is reusable between the sender letting go and the receiver taking hold.
The creator may reuse segment ``i`` once nobody holds byte ``i``: every array view in every
process is gone, no message carrying it is in flight, or the holders are dead.

A receiver may also keep a message's in-flight description as its hold, when that
description covers exactly the one slot it needs (:func:`hold`, or :func:`establish` at the
end of a load): then no lock is taken or dropped on receipt, and letting go is one
``close``.  The number of descriptions kept
this way is bounded (:func:`kept_budget`).

Linux keeps one list of record locks per file, and every lock change and every close of a
description of that file walks it; each message in flight is one lock on its sender's
table.  With a few hundred messages queued, one file made each lock operation cost 5-20 us
(and the three processes of a relay contended for the list's spinlock): hence the shards,
and the kept descriptions, each of which saves a walk.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import gc
import os
import resource
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import chain, starmap
from typing import TYPE_CHECKING, TypeVar

from .posix_shm import PREFIX, fd_limit_error, process_tag
from .scm_rights import close_fds

_consume = deque[object](maxlen=0).extend  # runs an iterator out, in C

__all__ = ["HAVE_OFD_LOCKS", "LeaseTable", "own_table", "SHARDS", "hold", "lock_shared",
           "establish", "release", "release_many", "inflight_fd", "sendable", "kept_budget",
           "holdings_kept", "probe_held", "forget_idle", "shed_kept", "retry_after_shedding",
           "own_fds", "table_count", "file_of", "held_files", "before_fork", "after_fork_in_parent",
           "after_fork_in_child"]

HAVE_OFD_LOCKS = hasattr(fcntl, "F_OFD_SETLK")
_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_FLOCK = struct.Struct("hhqqi4x")  # struct flock on Linux x86-64 and aarch64

if TYPE_CHECKING:
    from typing import TypeAlias

    # hold's ``deferred``: (table id, slot, in-flight fd) per hold to make real once loaded
    # (shmtensor._wire.Deferred, which this package must not import)
    Deferred: TypeAlias = list[tuple[str, int, int]]

_T = TypeVar("_T")


_REOPEN = os.O_RDWR | os.O_CLOEXEC
_names: dict[int, str] = {}
# A new description of a file is opened by its fd's name in this process's /proc/self/fd,
# kept open (openat: a shorter path walk than /proc/self/fd/N's, about a microsecond per
# message that carries a lease): ``_fd_dir`` is that directory's fd and ``_open_in`` the
# open through it (os.open with dir_fd, or os.open of full paths where there is none).
# Opened at import, so that it is no test's new fd; a forked child opens its own (the
# inherited one names the parent's fds).
_fd_dir = [-1]
_open_in: list[Callable[[str, int], int]] = []


def _open_fd_dir() -> None:
    try:
        _fd_dir[0:1] = map(os.open, ("/proc/self/fd",), (os.O_RDONLY | os.O_DIRECTORY
                                                          | os.O_CLOEXEC,))
    except OSError:  # no procfs: every reopen below fails too, and says so
        _fd_dir[0] = -1
    _names.clear()
    _open_in[:] = [functools.partial(os.open, dir_fd=_fd_dir[0]) if _fd_dir[0] >= 0
                   else os.open]


def _reopen_into(out: list[int], k: int, fd: int) -> None:
    """``out[k]`` = a new description of ``fd``'s file.  The description is stored by the
    statement that opens it (a slice assigned from a ``map``: C from the open to the
    store), so an exception a signal handler raises never finds it opened and unowned."""
    name = _names.get(fd)
    if name is None:
        name = _names[fd] = str(fd) if _fd_dir[0] >= 0 else f"/proc/self/fd/{fd}"
    opener = _open_in[0]
    try:
        out[k:k + 1] = map(opener, (name,), (_REOPEN,))
    except OSError as e:
        try:
            retry_after_shedding(e, out.__setitem__, slice(k, k + 1),
                                 map(opener, (name,), (_REOPEN,)))
        except OSError as again:
            raise fd_limit_error(again, "a lease description") from None


_open_fd_dir()


def _setlk(fd: int, kind: int, slot: int) -> None:
    fcntl.fcntl(fd, _SETLK, _FLOCK.pack(kind, 0, slot, 1, 0))  # 0: SEEK_SET


def lock_shared(fd: int, slot: int) -> None:
    """Read-lock byte ``slot`` through ``fd``'s description (until it is closed)."""
    _setlk(fd, fcntl.F_RDLCK, slot)


def probe_held(fd: int, slot: int, count: int = 1) -> bool:
    """True while any description but ``fd``'s own holds ``slot`` (or any of the ``count``
    bytes from it) of the table ``fd`` is of."""
    res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK,
                      _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, slot, count, 0))
    kind: int = _FLOCK.unpack(res)[0]
    return kind != fcntl.F_UNLCK


SHARDS = 8  # lock files per table: slot ``s`` is byte ``s`` of file ``s % SHARDS``


class LeaseTable:
    """This process's lease table: allocates slots and tells whether anyone holds one.

    It is ``SHARDS`` empty memfds, slot ``s`` in file ``s % SHARDS``: the kernel keeps one
    list of locks per file and walks it on every lock change and every close, so spreading
    the messages in flight over several files keeps each walk short.  The memfds' own
    descriptions never take a lock, so they are also the probes for :meth:`is_held`."""

    def __init__(self) -> None:
        self.id = process_tag()
        self.fds: list[int] = []
        try:
            for _ in range(SHARDS):
                self.fds.append(os.memfd_create(f"{PREFIX}_{self.id}_lease", os.MFD_CLOEXEC))
        except OSError as e:
            self.close()
            raise fd_limit_error(e, f"this process's lease table ({SHARDS} files)") from None
        except BaseException:
            self.close()
            raise
        self._next = 0
        self._lock = threading.Lock()
        self._inos: list[int] = []

    def shard(self, slot: int) -> tuple[int, int]:
        """The fd of ``slot``'s lease file and its inode number: what a reader that was
        sent that fd once knows the file by."""
        if not self._inos:
            self._inos = [os.fstat(fd).st_ino for fd in self.fds]
        k = slot % SHARDS
        return self.fds[k], self._inos[k]

    def new_slot(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def is_held(self, slot: int) -> bool:
        """True while any process, this one included, holds ``slot`` or a message carries it."""
        return probe_held(self.fds[slot % SHARDS], slot)

    def unheld(self, slots: Iterable[int], probes: int) -> set[int]:
        """Those of ``slots`` that nobody holds, found with one probe per lease file over
        the range its slots span; where that range is held somewhere, up to ``probes``
        more, one per slot (the rest count as held).  Reusing the oldest of many freed
        segments this way costs a fraction of a syscall each."""
        files: dict[int, list[int]] = {}
        for slot in slots:
            group = files.get(slot % SHARDS)
            if group is None:
                files[slot % SHARDS] = [slot]
            else:
                group.append(slot)
        free: set[int] = set()
        for k, group in files.items():
            fd = self.fds[k]
            if len(group) > 1:
                lo = min(group)
                if not probe_held(fd, lo, max(group) - lo + 1):
                    free.update(group)
                    continue
            for slot in group:
                if probes <= 0:
                    break
                probes -= 1
                if not probe_held(fd, slot):
                    free.add(slot)
        return free

    def close(self) -> None:
        close_fds(self.fds)
        self.fds = []


class _Holding:
    """This process's descriptions of a table (one per file, made on first need), and how
    many holds it has on each slot."""

    __slots__ = ("table_id", "fds", "inos", "counts", "by", "lock", "fork_fds", "gone")

    def __init__(self, table_id: str) -> None:
        self.table_id = table_id
        self.fds = [-1] * SHARDS
        self.inos = [0] * SHARDS  # the files' inodes, once asked (holder)
        self.gone = False  # forgotten (forget_idle): hold() then adopts anew
        self.counts: dict[int, int] = {}
        # What holds each counted slot: -1 a lock through ``fds``, else a kept in-flight
        # description (closed on release).  A counted slot missing here is still covered
        # by the in-flight description of a message being loaded (see hold's ``deferred``).
        self.by: dict[int, int] = {}
        # Re-entrant: a finalizer releasing a hold may run inside hold() (a GC pass).
        self.lock = threading.RLock()
        self.fork_fds: list[int] = []

    def fd_for(self, slot: int, source: int | None) -> int:
        """This process's description of ``slot``'s file, reopened from ``source`` (a
        description of that file) the first time (caller holds ``lock``)."""
        k = slot % SHARDS
        fd = self.fds[k]
        if fd < 0:
            if source is None:
                own = _own
                if own is None or own.id != self.table_id:
                    raise KeyError(f"no description of lease table {self.table_id} in this "
                                   "process")
                source = own.fds[k]
            _reopen_into(self.fds, k, source)
            fd = self.fds[k]
        return fd


_own: LeaseTable | None = None
_gc_was_enabled = True  # across a fork (see before_fork)
_holdings: dict[str, _Holding] = {}
_registry_lock = threading.Lock()


def own_table() -> LeaseTable:
    """The lease table of this process, made on first use."""
    global _own
    if _own is None:
        with _registry_lock:
            if _own is None:
                _own = LeaseTable()
                _holdings[_own.id] = _Holding(_own.id)
    return _own


def holdings_kept() -> int:
    """Peer tables whose descriptions stay open while nothing is held through them: a
    process that hears from more peers than this (a Pool replacing its workers, executors
    made again and again) closes the idle ones' descriptions when a new peer comes, instead
    of keeping up to ``SHARDS`` fds for every peer it ever heard from, dead ones included.
    As many as fit ``SHARDS`` fds each in the kept budget (16 at 1024 fds), at least 2."""
    return max(2, kept_budget() // SHARDS)


def _holding(table_id: str) -> _Holding:
    h = _holdings.get(table_id)
    if h is None:
        if len(_holdings) > holdings_kept():
            forget_idle(blocking=False)
        new = _Holding(table_id)  # made before the lock: no GC pass (finalizers) inside it
        with _registry_lock:
            h = _holdings.setdefault(table_id, new)
    return h


def hold(table_id: str, slot: int, source: int | list[int] | None = None,
         deferred: Deferred | None = None, token: list[int] | None = None) -> bool:
    """Hold ``slot`` of ``table_id``; ``source`` says how a new hold is taken:

    * None: through this process's description of the table's file (its own table's, or
      a peer's it holds from already), by a read lock;
    * a description of that file (an int): the same, the description made from it if this
      process has none yet.  With ``deferred``: the caller is loading a message whose
      in-flight description ``source`` covers the slot until the load ends; a new hold is
      then only counted, and ``(table_id, slot, source)`` appended, for :func:`establish`
      at the end of the load;
    * a loaded message's fd list, its in-flight description last, covering ``slot``
      alone: that description itself becomes the hold, within :func:`kept_budget`
      (returns True; it leaves the list, -1, in the same step as the holding takes it, so
      an exception raised anywhere, a signal handler's, never leaves it owned twice), else
      a lock as above.

    ``token``: an empty list, which gets an entry in the step that counts the hold, for
    :func:`release` to let go of it exactly once."""
    entry = (table_id, slot, source)  # made outside h.lock: no GC pass in there for it
    if token is None:
        token = []
    sole = type(source) is list
    while True:
        h = _holdings.get(table_id)
        if h is None:
            if source is None and (_own is None or _own.id != table_id):
                raise KeyError(f"no description of lease table {table_id} in this process")
            h = _holding(table_id)
        with h.lock:
            if h.gone:  # forgotten meanwhile: adopt again
                continue
            # (source is the list when sole, else an int or None: mypy narrows by
            # isinstance only, and type() is faster)
            fd = -1 if sole else h.fd_for(slot, source)  # type: ignore[arg-type]
            counts = h.counts
            n = counts.get(slot, 0)
            # first, counted and recorded in one step: a release finds the hold, however
            # far it got
            counts[slot] = n + 1; token.append(slot)  # noqa: E702
            if n:
                return False
            try:
                if sole:  # the message's list (see above)
                    return _make_real(h, slot, source, True,  # type: ignore[arg-type]
                                      _budget[0] if _budget else kept_budget())
                if deferred is None or source is None:
                    _setlk(fd, fcntl.F_RDLCK, slot)
                    h.by[slot] = -1
                else:
                    # source is an int here: ``entry`` was made before the test
                    deferred.append(entry)  # type: ignore[arg-type]
                return False
            except OSError:  # no fd or lock to be had: nothing held
                _uncount(counts, slot, token)
                raise


def _uncount(counts: dict[int, int], slot: int, token: list[int]) -> None:
    """Take back a hold counted on ``slot`` that came to nothing (caller holds the
    holding's lock): its count and ``token`` go in one step (C from the first to the last:
    no signal handler runs in between)."""
    _consume(chain(map(counts.pop, (slot,), (None,)), starmap(token.clear, ((),))))


def _own_sole(source: int, slot: int) -> int:
    """A description of its own holding ``slot`` alone, for an own hold that a message is
    about to carry (see :func:`sendable`), or -1 past the budget or the fd limit.  Made at
    the first send, not with the hold: a segment never sent costs no fd for it."""
    global _kept
    budget = _budget[0] if _budget else kept_budget()
    with _kept_lock:
        if _kept >= budget:
            return -1
        _kept += 1
    try:
        return _locked_copy(source, (slot,))
    except OSError:  # out of fds: the message makes its in-flight description (and says so)
        with _kept_lock:
            _kept -= 1
        return -1


def sendable(table_id: str, slot: int) -> int:
    """A new fd of the description by which this process holds ``slot`` of ``table_id``
    alone (a kept in-flight description, or one made for an own hold here, on the slot's
    first send, within the kept budget), or -1.  Sent with a message, it is that message's
    in-flight lock: the kernel keeps the description, and so the lock, while any fd of it
    is open anywhere, in flight included.  The fd is the caller's, to close once the
    message is sent: the hold that made the description may be let go before the send (a
    CUDA block's hold belongs to a received use, not to the memory a message keeps), and
    its own fd closed with it.  A ``dup`` costs no open and no lock; it is made under the
    holding's lock, which every release takes first."""
    h = _holdings.get(table_id)
    if h is None or slot not in h.by:  # unlocked look first: a miss costs a new description
        return -1                       # at worst, never a wrong one
    with h.lock:
        fd = h.by.get(slot)
        if fd is None:
            return -1  # not held, or held by a message still being loaded
        if fd < 0:
            if _own is None or table_id != _own.id:
                return -1  # a lock through this process's description of another's table
            # an own hold by a lock, sent for the first time: from now on held by a
            # description of its own, which this message and the next ones carry
            k = slot % SHARDS
            fd = _own_sole(h.fds[k], slot)
            if fd < 0:
                return -1
            h.by[slot] = fd
            _setlk(h.fds[k], fcntl.F_UNLCK, slot)  # the new description holds it now
        try:
            return os.dup(fd)
        except OSError:  # out of fds: the caller's in-flight description says so
            return -1


def holder(table_id: str, slot: int) -> tuple[int, int]:
    """This process's fd of a description of ``slot``'s file while it holds the slot
    through one (its description of the table's file, or a kept in-flight one), and that
    file's inode, else (-1, 0): what another process may open through
    ``/proc/<pid>/fd`` (checking the inode) to hold the slot itself."""
    h = _holdings.get(table_id)
    if h is None:
        return -1, 0
    k = slot % SHARDS
    fd = h.by.get(slot, -2)
    if fd == -1:
        fd = h.fds[k]
    if fd < 0:
        return -1, 0
    if not h.inos[k]:
        try:
            h.inos[k] = os.fstat(fd).st_ino
        except OSError:  # let go of meanwhile
            return -1, 0
    return fd, h.inos[k]


def held_files() -> list[tuple[int, int]]:
    """(inode, fd) of each description of a peer table file through which this process
    holds slots (its description of the file, or a kept in-flight one): a new
    description opened through one (``/proc/self/fd``) holds nothing."""
    out = []
    for h in list(_holdings.values()):
        with h.lock:
            for k, fd in chain(enumerate(h.fds), ((s % SHARDS, d) for s, d in h.by.items())):
                if fd < 0:
                    continue
                if not h.inos[k]:
                    try:
                        h.inos[k] = os.fstat(fd).st_ino
                    except OSError:
                        continue
                out.append((h.inos[k], fd))
    return out


def file_of(ino: int) -> int:
    """An fd of :func:`held_files` of the file of inode ``ino``, or -1."""
    return next((fd for i, fd in held_files() if i == ino), -1)


_kept = 0  # in-flight descriptions kept as holds, in all tables (under _kept_lock)
_kept_lock = threading.Lock()
_budget: list[int] = []


def kept_budget() -> int:
    """How many fds of one kind this process keeps for later (received segment memfds, to
    forward; in-flight descriptions, as holds): an eighth of its fd limit when first asked,
    at most 256.  Past it, segments are re-sent by copy and holds are locks through this
    process's description of the table file (at most one per peer and file)."""
    if not _budget:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 16
        _budget.append(max(0, min(256, soft // 8)))
    return _budget[0]


def shed_kept() -> int:
    """For a process out of fds: close the descriptions it keeps as holds (its own, and
    received in-flight ones) wherever it has a description of the same table file to hold
    those slots by a lock instead, and keep no more from now on (the budget drops to what
    is left).  Closing this process's fd takes no lock away from anyone: a copy of such a
    description in flight or in another process still holds it.  Returns the fds closed.
    A holding whose lock another thread has is skipped (no lock order to keep)."""
    global _kept
    closed = 0
    # No GC pass in here: a finalizer it ran in this thread would get the holding's
    # (re-entrant) lock and could let go of a hold while it is being moved.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for h in list(_holdings.values()):
            took: list[bool] = []
            try:
                took.extend(starmap(h.lock.acquire, ((False,),)))  # see forget_idle
                if not took[0]:
                    continue
                for slot, by in list(h.by.items()):
                    fd = h.fds[slot % SHARDS]
                    if by < 0 or fd < 0:
                        continue
                    try:
                        _setlk(fd, fcntl.F_RDLCK, slot)  # held by the lock before the close
                    except OSError:  # no lock to be had: it keeps its description
                        continue
                    try:
                        # one line: out of ``by``, counted and closed with no point in
                        # between where a signal handler runs (os.close is C)
                        h.by[slot] = -1; closed += 1; os.close(by)  # noqa: E702
                    except OSError:
                        pass
            finally:
                if took and took[0]:
                    h.lock.release()
    finally:
        if was_enabled:
            gc.enable()
        with _kept_lock:
            _kept -= closed
            _budget[:] = [_kept]
    return closed


def retry_after_shedding(err: OSError, make: Callable[..., _T], *args: object) -> _T:
    """``make(*args)`` once more, when ``err`` (what it raised) says this process has no
    fd left and :func:`shed_kept` freed some; else ``err`` is raised."""
    if err.errno != errno.EMFILE or not shed_kept():
        raise err
    return make(*args)


def establish(table_id: str, slot: int, inflight: int | list[int], sole: bool,
              i: int = -1) -> bool:
    """End of a load: turn a deferred hold into a real one before ``inflight`` (the
    message's description, covering ``slot``) is closed.  ``sole``: ``inflight`` covers no
    other slot, so it may itself become the hold.  Returns True when it did (the caller
    must then not close ``inflight``)."""
    global _kept
    h = _holdings.get(table_id)
    if h is None:  # let go during the load, and the table forgotten since
        return False
    budget = kept_budget()
    with h.lock:
        if h.counts.get(slot, 0) == 0 or slot in h.by:
            return False  # let go during the load, or held some other way meanwhile
        keep = _make_real(h, slot, inflight, sole, budget, i)
        if h.counts.get(slot, 0) == 0:  # released by a finalizer that ran meanwhile: undo
            fd = h.by.get(slot)
            if fd is None:
                # that release let go of it already (closing ``inflight`` if it was kept)
                return keep
            if keep and type(inflight) is list:  # the caller closes ``inflight``
                # back in the list it came from, in the step that takes it out (C)
                inflight[i:i + 1 or None] = map(h.by.pop, (slot,))
                fd = inflight[i]
            else:
                fd = h.by.pop(slot)
            if keep:
                with _kept_lock:
                    _kept -= 1
            else:
                _setlk(h.fds[slot % SHARDS], fcntl.F_UNLCK, slot)
            return False
        return keep


def _make_real(h: _Holding, slot: int, inflight: int | list[int], sole: bool, budget: int,
               i: int = -1) -> bool:
    """Hold ``slot`` by ``inflight`` itself (when ``sole`` and within the budget: True) or
    by a lock through this process's description of its file (caller holds ``h.lock``).
    ``inflight`` may be a message's fd list, the description at index ``i``: kept, it
    leaves the list with no point in between where a signal handler runs."""
    global _kept
    # (type() is list, so the other branch has the int: mypy narrows isinstance only)
    fds: list[int] = inflight if type(inflight) is list else [inflight]  # type: ignore[list-item]
    fd = h.fd_for(slot, fds[i])  # made on first need: forwarding reopens it
    if sole:
        with _kept_lock:
            if _kept < budget:
                # one line of stores, no call: counted, held by it, and out of the list
                _kept += 1; h.by[slot] = fds[i]; fds[i] = -1  # noqa: E702
                return True
    _setlk(fd, fcntl.F_RDLCK, slot)
    h.by[slot] = -1
    return False


def release(table_id: str, slot: int, token: list[int] | None = None) -> None:
    """Let go of one hold on ``slot`` of ``table_id`` (the last one drops the lock).

    ``token``: the list :func:`hold` recorded the hold in.  The hold is then let go of
    once, however often this is called: only while ``token`` has its entry, and the entry
    goes in the step that lets go (C from the first change to the last, so no signal
    handler runs in between).  A caller cut short by an exception (a signal handler's, in
    a finalizer) may call again: it finishes the release, or finds it done, and never
    takes a later hold on the slot for this one."""
    global _kept
    if token is None:
        release_many(table_id, (slot,))
        return
    h = _holdings.get(table_id)
    if h is None:  # nothing was held through it (forgotten only once nothing is)
        return
    with h.lock:
        if not token:
            return
        counts, by = h.counts, h.by
        n = counts.get(slot, 0)
        if n > 1:
            counts[slot] = n - 1; token.clear()  # noqa: E702 (one step: counted down once)
            return
        # What physically holds it (a lock through the holding's description, a kept
        # description, or nothing while a load defers it) goes with the count and the
        # token, in one run of C (the steps are made first: building them runs nothing).
        done = chain(map(counts.pop, (slot,), (None,)), starmap(token.clear, ((),)))
        fd = by.get(slot)
        try:
            if fd == -1:
                unlock = _FLOCK.pack(fcntl.F_UNLCK, 0, slot, 1, 0)
                _consume(chain(starmap(fcntl.fcntl, ((h.fds[slot % SHARDS], _SETLK, unlock),)),
                               map(by.pop, (slot,)), done))
            elif fd is not None:
                steps = chain(map(os.close, map(by.pop, (slot,))), done)
                # one line: the kept count goes down with the close, and no handler runs
                # in between (nor does another thread: it is the GIL's)
                _kept -= 1; _consume(steps)  # noqa: E702
            else:
                _consume(done)
        except OSError:  # fd closed at interpreter shutdown: dying releases anyway
            pass


def release_many(table_id: str, slots: Iterable[int]) -> None:
    """:func:`release` of each of ``slots`` (repeats count) under one take of the
    holding's lock: a drain lets go of many holds on one table at once."""
    global _kept
    h = _holdings.get(table_id)
    if h is None:
        return
    closed = 0
    with h.lock:
        counts, by, fds = h.counts, h.by, h.fds
        for slot in slots:
            n = counts.get(slot, 0)
            if n > 1:
                counts[slot] = n - 1
                continue
            counts.pop(slot, None)
            # drop what physically holds it: a lock through ``fds``, or a kept description
            fd = by.get(slot)
            try:
                if fd == -1:
                    del by[slot]  # a lock left by an exception here goes with the holding
                    _setlk(fds[slot % SHARDS], fcntl.F_UNLCK, slot)
                elif fd is not None:
                    closed += 1
                    # taken out and closed in one step (C from the pop to the close), so an
                    # exception (a signal handler's) never finds it out and open
                    _consume(map(os.close, map(by.pop, (slot,))))
            except OSError:  # fd closed at interpreter shutdown: dying releases anyway
                pass
    if closed:
        with _kept_lock:
            _kept -= closed


def inflight_fd(table_id: str, slots: Sequence[int]) -> int:
    """A new description of ``table_id``'s file of ``slots`` (all in one file: see
    :data:`SHARDS`) with them read-locked, to travel with a message."""
    k = slots[0] % SHARDS
    own = _own
    source = own.fds[k] if own is not None and own.id == table_id else _holdings[table_id].fds[k]
    return _locked_copy(source, slots)


def _locked_copy(source: int, slots: Iterable[int]) -> int:
    made = [-1]
    _reopen_into(made, 0, source)
    fd = made[0]
    try:
        for slot in slots:
            _setlk(fd, fcntl.F_RDLCK, slot)
    except BaseException:
        os.close(fd)
        raise
    return fd


def forget_idle(blocking: bool = True) -> int:
    """Close the holding descriptions of peer tables through which nothing is held (with
    ``blocking`` False, skipping any whose lock another thread has: it is in use)."""
    closed = 0
    for tid, h in list(_holdings.items()):  # listed before the locks: nothing made inside
        if (_own is not None and tid == _own.id) or h.counts:
            continue
        took: list[bool] = []  # made before the locks, as is ``take``: nothing made inside
        take = starmap(h.lock.acquire, ((blocking,),))
        with _registry_lock:
            try:
                # recorded as it is taken (starmap and extend are C): an exception (a
                # signal handler's) never finds the lock taken and not let go of below
                took.extend(take)
                if not took[0] or h.counts or _holdings.get(tid) is not h:
                    continue
                # closed while it is listed, each entry -1 as it closes: an exception cut
                # short here leaves the rest to the next call, never open and unlisted
                close_fds(h.fds)
                del _holdings[tid]; h.gone = True  # noqa: E702 (one step: no call between)
                closed += 1
            finally:
                if took and took[0]:
                    h.lock.release()
    return closed


def own_fds() -> set[int]:
    """The fds of this process's own table and its /proc/self/fd: one set per process,
    open for its lifetime."""
    fds = {_fd_dir[0]} - {-1}
    if _own is None:
        return fds
    h = _holdings.get(_own.id)
    return fds | set(_own.fds) | ({fd for fd in h.fds if fd >= 0} if h is not None else set())


def table_count() -> int:
    return len(_holdings)


def before_fork() -> None:
    """Lock, in fresh descriptions, every slot held now: the child gets them at once, so
    no moment passes in which its inherited views are unprotected."""
    global _gc_was_enabled
    # No GC pass while these locks are held: a finalizer it ran could wait for a lock that
    # another thread holds while waiting for one of these.
    _gc_was_enabled = gc.isenabled()
    gc.disable()
    _registry_lock.acquire()
    for h in _holdings.values():
        h.lock.acquire()
        h.fork_fds = [-1] * SHARDS
        for k, fd in enumerate(h.fds):
            slots = [s for s in h.counts if s % SHARDS == k]
            if fd >= 0 and slots:  # a file with nothing held needs no description
                try:
                    h.fork_fds[k] = _locked_copy(fd, slots)
                except OSError:
                    pass


def after_fork_in_parent() -> None:
    for h in _holdings.values():
        fds, h.fork_fds = h.fork_fds, []
        close_fds(fds)
        h.lock.release()
    _registry_lock.release()
    if _gc_was_enabled:
        gc.enable()


def after_fork_in_child() -> None:
    """Adopt the descriptions made before the fork: the parent's locks stay the parent's."""
    global _own, _registry_lock, _kept, _kept_lock
    _registry_lock = threading.Lock()
    _kept_lock = threading.Lock()
    inherited, _fd_dir[0] = _fd_dir[0], -1
    close_fds([inherited])
    _open_fd_dir()
    if _gc_was_enabled:
        gc.enable()
    if _own is not None:
        _own.close()
        _own = None  # the parent's table: the child allocates slots in a table of its own
    _kept = 0
    for tid, h in list(_holdings.items()):
        old, h.fds, h.fork_fds = h.fds, h.fork_fds or [-1] * SHARDS, []
        h.lock = threading.RLock()
        close_fds(old)
        # the parent's kept descriptions: the parent lets go of them
        close_fds(by for by in h.by.values() if by >= 0)
        h.by = dict.fromkeys(h.counts, -1)  # all held through the descriptions made before fork
        if any(h.fds[s % SHARDS] < 0 for s in h.counts):
            import warnings
            warnings.warn(f"shmtensor: could not keep this child's holds on lease table "
                          f"{tid} across fork; its inherited shared arrays may be reused "
                          "by their creator", RuntimeWarning)
        if all(fd < 0 for fd in h.fds):
            del _holdings[tid]
