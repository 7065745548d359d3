"""Segments mapped in this process: the ones it made and the ones it attached.

This module owns every piece of segment state, under one lock (``_lock``):

* **Anchors.**  Every array whose memory is a segment is a view of that segment's anchor:
  a uint8 array over the whole mapping.  While any view lives the anchor lives, and the
  anchor holds the segment's lease (see :mod:`shmtensor.ipc.ofd_lease`).  When the last
  view dies the anchor dies and the lease is released.
* **Own segments** (made here) are reused once nobody anywhere holds them: a segment whose
  anchor died goes into an idle list per strategy, and :func:`acquire` hands out an idle
  one of a fitting size whose lease is free, or makes a new one.  Idle segments past an
  age or a byte budget are destroyed, once unheld.
* **Slabs.**  Arrays up to :data:`SLAB_ITEM_MAX` bytes are carved from the current slab of
  their strategy (:func:`carve`): one segment holds many arrays, so fds, mappings and lease
  slots scale with slabs, not arrays, in producer and consumer alike.  A slab is one
  segment with one lease: it is reused when every array in it is released everywhere.
  The next slab is a free one, else a new one of half the slab bytes still held (2 MiB
  up to 64 MiB): 100,000 live small arrays take a dozen slabs, and a stream of dropped
  ones a few small ones (:func:`_next_slab`).
* **Room.**  A reservation that does not fit (:mod:`shmtensor.ipc.shm_space`: the memory
  cgroup, the machine, /dev/shm) first gives back everything idle (:func:`give_back`);
  under a cgroup limit, idle memory is kept only while the cgroup is under half its limit
  (:func:`_idle_budget`).
* **The receive cache**: segments attached from other processes stay mapped while idle,
  so one that comes back (recycled by its creator, or sent again) costs no new mapping;
  idle ones are evicted by age, count and total size.

Nothing here scans all segments on a release: the idle lists are looked at from their
oldest end, a bounded number at a time, and not again before something can be due.

**A dying anchor takes no module lock.**  It is queued on ``_died``, a
``queue.SimpleQueue`` (safe in finalizers), by its weak reference's callback, the queue's
C ``put``: no Python code runs, so no signal handler's exception can lose it.  A second
weak reference's finalizer releases the lease at once (the lease table's lock is held
only inside :mod:`shmtensor.ipc.ofd_lease`, which waits on no other lock); the hold's
token says whether that release is done, so one an exception cut short is finished later.
The next call that takes ``_lock`` moves what died into the idle lists (:func:`_settle`);
the sweeper thread does it too while anything is mapped, so a quiet process still gets
its idle segments trimmed; it is stopped before a fork and started again after it in the
parent, so no thread of ours runs across a fork.  (Taking ``_lock`` in the finalizer could deadlock: a GC pass
inside the lease table's lock on one thread, ``_lock`` held by another that waits for the
lease table.)
"""

from __future__ import annotations

import atexit
import bisect
import itertools
import os
import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from itertools import islice, starmap
from typing import TYPE_CHECKING, Any

import numpy as np

from shmtensor.ipc import janitor, ofd_lease, posix_shm, shm_space
from shmtensor.ipc.scm_rights import close_fds

from . import _stats

if TYPE_CHECKING:
    from ._wire import Deferred

FD, FS = "file_descriptor", "file_system"
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

# Own idle segments kept for reuse: named ones are visible in /dev/shm, so kept briefly.
IDLE_SECONDS = {FD: 30.0, FS: 5.0}
IDLE_BYTES = 4 << 30
# Idle mappings of other processes' segments kept for reuse.
CACHE_IDLE_SECONDS = 30.0
CACHE_IDLE_BYTES = 2 << 30
CACHE_IDLE_COUNT = 512
# Slabs (see the module docstring and docs/architecture.md for how these were chosen).
SLAB_ITEM_MAX = 1 << 20
SLAB_MIN = 2 << 20
SLAB_MAX = 64 << 20
SLAB_ALIGN = 64

_SCAN_LIMIT = 64   # idle segments looked at per trim pass, per strategy
_PROBE_LIMIT = 16  # leases probed per acquire
_RETRIM_SECONDS = 0.5  # after a trim pass that found due segments still held


class Segment:
    """One segment mapped in this process, made here (``own``) or attached from elsewhere."""

    __slots__ = ("key", "kind", "size", "table_id", "slot", "own", "mm", "fd", "address",
                 "_anchor", "idle_since", "pinned", "slab", "file", "ino", "__weakref__")

    key: str  # NAME, or NAME@OFFSET: one of several segments of one file (file_of)
    kind: str  # FD or FS
    size: int
    table_id: str  # the creator's lease table, and the segment's slot in it
    slot: int
    own: bool  # made by this process
    mm: posix_shm.Mapping | None  # None once unmapped
    fd: int | None  # the segment's fd, when kept (a memfd, to forward or reuse)
    address: int  # where it is mapped
    _anchor: _AnchorRef | None
    idle_since: float  # time.monotonic() when its anchor last died
    pinned: bool
    slab: bool
    file: _SharedFile | None  # the file it shares with other segments, if any
    ino: int  # its file's inode number, once asked (handle); 0 until then

    def anchor(self, lease: int | list[int] | None = None,
               deferred: Deferred | None = None) -> np.ndarray:
        """The live anchor (made, and the lease held, if none is alive).  ``lease`` and
        ``deferred`` say how a new hold is taken: ``ofd_lease.hold``'s ``source`` and
        ``deferred`` (a received segment's: its message's in-flight description, or the
        message's fd list when that description covers this slot alone)."""
        ref = self._anchor
        a = ref() if ref is not None else None
        if a is None:
            with _lock:
                a = self._anchor() if self._anchor is not None else None
                if a is None:
                    # watched before the hold is taken: an anchor dropped on the way (an
                    # exception, a signal handler's) releases however much of it was taken
                    a = self._buffer()
                    token = self._watch(a)
                    try:
                        ofd_lease.hold(self.table_id, self.slot, lease, deferred, token)
                    # no lock or fd, or no description of the lease file (KeyError):
                    # nothing held, and nothing to release
                    except (OSError, KeyError):
                        self._anchor = None
                        raise
        return a

    def _buffer(self) -> np.ndarray:
        if self.mm is None:
            raise LookupError(f"segment {self.key} was unmapped here")
        # a ctypes array (a buffer, which numpy's stubs do not list): an ndarray
        return np.frombuffer(self.mm.buffer, np.uint8,  # type: ignore[call-overload, no-any-return, unused-ignore]
                             count=self.size)

    def _watch(self, a: np.ndarray) -> list[int]:
        """Make ``a`` the anchor (caller holds ``_lock``); returns the token its hold is to
        be recorded in (``ofd_lease.hold``'s), by which its death releases it once."""
        token: list[int] = []
        prompt = _PromptRelease(a, _anchor_ref_died)
        prompt.seg, prompt.token = self, token  # one step: no handler runs in between
        # made last, so its callback (C: queued, whatever a signal handler raises) runs
        # first; either order is correct
        ref = _AnchorRef(a, _died.put)
        ref.seg, ref.token, ref.prompt = self, token, prompt
        self._anchor = ref
        if self.own:
            _own_idle_drop(self)
        else:
            _cache_drop(self)
        return token

    def alive(self) -> bool:
        return self._anchor is not None and self._anchor() is not None

    def close(self) -> None:
        """Unmap and close; only when no anchor is alive (views would dangle)."""
        global _kept_fds
        with _lock:
            if self.mm is not None:
                if self.alive():
                    return
                _by_buffer.pop(id(self.mm.buffer), None)
                _unindex(self)
                self.mm.close()
                self.mm = None
            if self.file is not None:  # one of several segments of one file
                self.file.release()
                self.file = None
            elif self.fd is not None:
                fd = self.fd
                if not self.own:
                    _kept_fds -= 1
                self.fd = None  # before the close: a close cut short never closes it twice
                try:
                    os.close(fd)
                except OSError:
                    pass
            self.fd = None
            if _by_key.get(self.key) is self:
                del _by_key[self.key]
            _cache_drop(self)
            _own_idle_drop(self)


class _SharedFile:
    """A file that holds several own segments, each with its own lease (a BatchPool's
    slots): its fd is closed, and its name unlinked, when the last of them is destroyed."""

    __slots__ = ("fd", "name", "users")

    def __init__(self, fd: int | None, name: str | None, users: int) -> None:
        self.fd, self.name, self.users = fd, name, users

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
            if self.name is not None:
                posix_shm.unlink_named(self.name)
                janitor.untrack(self.name)


def file_of(key: str) -> tuple[str, int]:
    """The file name and offset of segment ``key``: ``NAME`` or ``NAME@OFFSET`` (one of
    several segments of one file)."""
    name, _, offset = key.partition("@")
    if not offset:
        return name, 0
    if not offset.isdigit():
        raise ValueError(f"segment {key!r}: {offset!r} is not an offset: a corrupt message")
    return name, int(offset)


_lock = threading.RLock()  # everything below; re-entrant: a GC pass may run a finalizer here
_by_key: dict[str, Segment] = {}
_by_buffer: dict[int, Segment] = {}  # id(mapping buffer) -> segment: ends every base chain
# (mapping address, serial, segment) of the mapped segments, sorted: segment_at.  One list
# changed by one C call each way, so an exception (a signal handler's) never leaves an
# index half made.
_starts: list[tuple[int, int, Segment]] = []
_serials = itertools.count()
_kept_fds = 0  # received memfds kept (to forward without a copy); bounded by kept_budget

# The receive cache: attached segments with no live anchor, oldest first.
_cache: "OrderedDict[str, Segment]" = OrderedDict()
_cache_bytes = 0

# Own idle segments: per strategy in idle order (trimmed oldest first), and by capacity
# class (bit length of the size) for acquire.
_own_idle: dict[str, "OrderedDict[str, Segment]"] = {FD: OrderedDict(), FS: OrderedDict()}
_buckets: dict[tuple[str, int], "OrderedDict[str, Segment]"] = {}
_own_idle_bytes = 0
_next_trim = 0.0  # no trim pass before this (monotonic) unless forced or over budget

# Slabs, per strategy: every own slab in existence (live or idle), and the one being carved.
_slabs: dict[str, dict[str, Segment]] = {FD: {}, FS: {}}
_current: dict[str, list[Any]] = {}  # kind -> [segment, anchor, next free offset]


_budget = [0.0, IDLE_BYTES]  # [until (monotonic), bytes]: see _idle_budget
_BUDGET_UNLIMITED_SECONDS = 5.0  # no memory cgroup limit: looked for again after this


def _idle_budget() -> float:
    """Idle bytes this process keeps (own idle segments, and the receive cache, each):
    :data:`IDLE_BYTES`, less under a memory cgroup limit.  There idle memory is kept only
    while the cgroup's usage stays under half its limit: idle segments are charged to it,
    and at the limit its processes are OOM-killed, not told.  Re-read every
    ``shm_space.FRESH_SECONDS`` (a few file reads): cheap on the per-message path."""
    now = time.monotonic()
    if now < _budget[0]:
        return _budget[1]
    room = shm_space.memory_room()
    if room.limit is None:
        _budget[:] = [now + _BUDGET_UNLIMITED_SECONDS, IDLE_BYTES]
    else:
        idle = _own_idle_bytes + _cache_bytes
        budget = max(0, min(IDLE_BYTES, idle + room.free - room.limit // 2))
        _budget[:] = [now + shm_space.FRESH_SECONDS, budget]
    return _budget[1]


def _cache_put(seg: Segment) -> None:
    global _cache_bytes
    if _cache.get(seg.key) is not seg:
        # one line of stores, no call: cached and counted together, whatever a signal
        # handler raises
        _cache[seg.key] = seg; _cache_bytes += seg.size  # noqa: E702
    _cache.move_to_end(seg.key)


def _cache_drop(seg: Segment) -> None:
    global _cache_bytes
    if _cache.get(seg.key) is seg:
        del _cache[seg.key]
        _cache_bytes -= seg.size


def _own_idle_put(seg: Segment) -> None:
    global _own_idle_bytes, _next_trim
    idle = _own_idle[seg.kind]
    if seg.key not in idle:
        _next_trim = min(_next_trim, seg.idle_since + IDLE_SECONDS[seg.kind])
        bucket = _buckets.setdefault((seg.kind, seg.size.bit_length()), OrderedDict())
        # one line of stores and no call (where a signal handler runs): its exception
        # never finds the idle table and the size buckets out of step
        idle[seg.key] = seg; bucket[seg.key] = seg; _own_idle_bytes += seg.size  # noqa: E702


def _own_idle_drop(seg: Segment) -> None:
    global _own_idle_bytes
    idle = _own_idle.get(seg.kind)
    if idle is not None and idle.get(seg.key) is seg:
        bucket = _buckets[(seg.kind, seg.size.bit_length())]
        del idle[seg.key]; del bucket[seg.key]; _own_idle_bytes -= seg.size  # noqa: E702 (as above)


class _AnchorRef(weakref.ref[np.ndarray]):
    """How a segment knows its live anchor.  Its callback is ``_died.put``, a C function:
    the anchor's death queues it for :func:`_settle` with no Python code run, so no signal
    handler's exception can lose it (one raised in a Python finalizer is reported as
    unraisable and cuts the finalizer short, even before its first line).  ``prompt``
    releases the hold at once (:func:`_anchor_ref_died`); ``token`` says whether that is
    done (see ``ofd_lease.release``), so :func:`_settle` finishes one cut short.  Lighter
    than ``weakref.finalize`` on a path taken once per received message; the segment keeps
    it (so the callbacks run), and it the segment."""

    __slots__ = ("seg", "token", "prompt")
    seg: Segment
    token: list[int]  # the hold's, from ofd_lease.hold: emptied as it is released
    prompt: _PromptRelease
    # Set at exit: anchors dying after that release nothing (the kernel drops the locks
    # with the process).  A class attribute, as everything the callback reaches is bound
    # to it: module globals are None by the time a module's dict is cleared at shutdown,
    # and an anchor kept by such a module dies then.
    exiting = False


class _PromptRelease(_AnchorRef):
    """The second weak reference to an anchor: its callback releases the hold as the
    anchor dies (:func:`_anchor_ref_died`)."""

    __slots__ = ()


_died: queue.SimpleQueue[_AnchorRef] = queue.SimpleQueue()  # anchors that died, to settle
_settling: list[_AnchorRef] = []  # one taken off _died and not yet settled (see _settle)


def _anchor_ref_died(ref: _PromptRelease,
                     release: Callable[[str, int, list[int]], None] = ofd_lease.release,
                     now: Callable[[], float] = time.monotonic) -> None:
    """A finalizer: release the lease now (other processes may be waiting to reuse the
    segment); the idle bookkeeping is left to the next call that takes ``_lock`` (the
    anchor was queued on ``_died`` from C).  An exception a signal handler raises in here
    (CPython reports it as unraisable) cuts the release short, anywhere: the hold's token
    is then still there, and :func:`_settle` releases it."""
    if type(ref).exiting:
        return
    # unset only if an exception cut _watch short: then nothing was held through it
    token = getattr(ref, "token", None)
    if token:
        seg = ref.seg
        seg.idle_since = now()
        release(seg.table_id, seg.slot, token)


def _settle() -> bool:
    """Move the segments whose anchor died since into the idle lists, releasing any hold
    a finalizer cut short left (caller holds ``_lock``); True when any went idle."""
    went = False
    settling = _settling
    while settling or not _died.empty():  # only callers holding _lock take from it
        if not settling:
            # recorded as it is taken (starmap and extend are C): an exception (a signal
            # handler's) never drops a segment between the queue and the idle lists, and
            # the next call settles what one left here
            settling.extend(starmap(_died.get_nowait, ((),)))
        ref = settling[-1]
        # unset only if an exception cut _watch short: then nothing was held through it
        if not hasattr(ref, "seg"):
            settling.pop()
            continue
        seg = ref.seg
        if ref.token:  # its prompt release was cut short, or has yet to run: done here, once
            seg.idle_since = time.monotonic()
            ofd_lease.release(seg.table_id, seg.slot, ref.token)
        if _by_key.get(seg.key) is not seg or seg.alive() or seg.mm is None:
            settling.pop()
            continue
        if seg.own:
            if seg.pinned:  # a BatchPool's slot: free again, never reused by acquire
                settling.pop()
                continue
            _own_idle_put(seg)
        else:
            _cache_put(seg)
        settling.pop()
        went = True
    return went


def settle() -> None:
    """Settle what died (see :func:`_settle`), then apply the idle limits if anything went
    idle: what a call that hands out or maps segments does first."""
    if _died.empty():
        return
    with _lock:
        went = _settle()
    if went:
        trim()
        evict_idle()
        _ensure_sweeper()


def segment_of(a: np.ndarray) -> Segment | None:
    """The segment holding ``a``'s memory, or None when ``a`` is not shared."""
    b: object = a.base
    while b is not None:
        if isinstance(b, np.ndarray):
            b = b.base
        elif isinstance(b, memoryview):
            b = b.obj
        else:
            return _by_buffer.get(id(b))
    return None


def segment_at(address: int) -> Segment | None:
    """The mapped segment whose memory holds ``address``, or None: for memory known only
    by its address (a torch storage made over a view of a segment)."""
    with _lock:
        i = bisect.bisect_right(_starts, (address, _AFTER_ALL))
        seg = _starts[i - 1][2] if i else None
    return seg if seg is not None and address < seg.address + seg.size else None


_AFTER_ALL = float("inf")  # sorts after every serial: bisects past a start's entries


def _index(seg: Segment) -> None:
    with _lock:
        bisect.insort(_starts, (seg.address, next(_serials), seg))


def _unindex(seg: Segment) -> None:
    with _lock:
        i = bisect.bisect_left(_starts, (seg.address, -1))
        while i < len(_starts) and _starts[i][0] == seg.address:
            if _starts[i][2] is seg:
                del _starts[i]
                return
            i += 1


# --- own segments ----------------------------------------------------------------------

def _capacity(nbytes: int) -> int:
    return -(-max(nbytes, 1) // PAGE) * PAGE


def _fits(cap: int, need: int) -> bool:
    return need <= cap <= max(2 * need, need + (64 << 10))


# what lets go of holds on this process's segments on demand (a channel's anchors of
# messages taken since its last put): run before a segment is chosen, so that one of
# them can be, and before idle memory is given back, so that they are
releasers: list[Callable[[], None]] = []
# what the sweeper thread runs on each pass (see _sweep): True while it has work left, which
# keeps the thread going when nothing is mapped (a queue's reader keeping memfds of memory
# it no longer maps)
sweepers: list[Callable[[], bool]] = []
# what tells whether a message not yet taken names a slot of this process's lease table
# that nothing else then holds (a received array a channel sends back to its maker without
# fds): True, False, or None where no message can (see held_anywhere)
namers: list[Callable[[str, int], bool | None]] = []


def held_anywhere(table: ofd_lease.LeaseTable, slot: int) -> bool:
    """Whether an own segment's ``slot`` is held by any process, or named by a message not
    yet taken (:data:`namers`): then it is neither reused nor destroyed.  The locks are
    probed again after the namers looked: a message taken meanwhile was held by its reader
    before it left its channel (and the first probe saw any writer's hold of a message
    that was not yet written)."""
    if table.is_held(slot):
        return True
    looked = False
    for named in namers:
        found = named(table.id, slot)
        if found:
            return True
        looked = looked or found is not None
    return looked and table.is_held(slot)


def _release_held() -> None:
    for hook in releasers:
        hook()


def acquire(nbytes: int, kind: str) -> tuple[Segment, np.ndarray]:
    """A segment of at least ``nbytes`` that nobody holds (recycled if possible, else new)
    and its anchor: held from the moment it is chosen, so no other thread can take it."""
    need = _capacity(nbytes)
    table = ofd_lease.own_table()
    _release_held()
    settle()
    with _lock:
        seg = _reuse(need, kind, table)
        if seg is None:
            seg = _create(need, kind, table)
        _mark_slab(seg, False)
        return seg, seg.anchor()


def _reuse(need: int, kind: str, table: ofd_lease.LeaseTable) -> Segment | None:
    probed = scanned = 0
    for cls in (need.bit_length(), need.bit_length() + 1):
        bucket = _buckets.get((kind, cls))
        if not bucket:
            continue
        for seg in list(islice(bucket.values(), _SCAN_LIMIT)):  # a snapshot: finalizers may edit
            scanned += 1
            if scanned > _SCAN_LIMIT or probed >= _PROBE_LIMIT:
                return None
            if not _fits(seg.size, need) or bucket.get(seg.key) is not seg:
                continue
            probed += 1
            if not held_anywhere(table, seg.slot):
                _own_idle_drop(seg)
                _stats.bump("segments_recycled")
                return seg
            bucket.move_to_end(seg.key)  # held for long: look at the others first next time
    return None


def _mark_slab(seg: Segment, slab: bool) -> None:
    if seg.slab != slab:
        seg.slab = slab
        if slab:
            _slabs[seg.kind][seg.key] = seg
        else:
            _slabs[seg.kind].pop(seg.key, None)


def _create_file(name: str, size: int, kind: str, slots: list[int],
                 table: ofd_lease.LeaseTable) -> int:
    """A new memfd, or /dev/shm/NAME, of ``size`` bytes for the segments of ``slots``."""
    create = posix_shm.create_memfd if kind == FD else posix_shm.create_named
    if kind != FD:
        # The janitor hears of the name before the file exists: a SIGKILL in between
        # leaves nothing it does not know about.
        for slot in slots:
            janitor.track(name, slot, table.fds)
    try:
        try:
            return create(name, size)
        except posix_shm.ShmSpaceError:
            if not give_back():  # nothing idle to give back: the error stands
                raise
            if kind == FS:
                _await_unlinked_space(size)
            return create(name, size)
        except OSError as e:  # out of fds: again once kept descriptions are given up
            return ofd_lease.retry_after_shedding(e, create, name, size)
    except BaseException:
        if kind != FD:
            janitor.untrack(name)
        raise


def _create(size: int, kind: str, table: ofd_lease.LeaseTable) -> Segment:
    slot = table.new_slot()
    name = posix_shm.segment_name(slot, unguessable=kind == FS)
    fd = _create_file(name, size, kind, [slot], table)
    try:
        seg = new_segment(name, kind, size, table.id, slot, own=True, fd=fd, populate=True)
    except BaseException:
        os.close(fd)
        if kind == FS:
            posix_shm.unlink_named(name)
            janitor.untrack(name)
        raise
    if kind == FS:
        os.close(fd)  # attached by name: no fd needed
        seg.fd = None
    _by_key[name] = seg
    _stats.bump("segments_created")
    _stats.bump("bytes_created", size)
    return seg


def carve(nbytes: int, kind: str) -> tuple[np.ndarray, int]:
    """Room for ``nbytes`` (at most :data:`SLAB_ITEM_MAX`) in the current slab of ``kind``:
    the slab's anchor and the offset, aligned to :data:`SLAB_ALIGN` bytes.  A full slab is
    let go (reused once every array in it is released everywhere); :func:`_next_slab`
    picks the next."""
    with _lock:
        cur = _current.get(kind)
        if cur is not None:
            off = cur[2]
            end = off + nbytes
            if end <= cur[0].size:
                cur[2] = (end + SLAB_ALIGN - 1) & -SLAB_ALIGN
                return cur[1], off
            del _current[kind]
            del cur  # the full slab's anchor now lives only as long as arrays in it
        _settle()  # a slab whose arrays all died may be reusable now
        seg = _next_slab(nbytes, kind)
        anchor = seg.anchor()
        _current[kind] = [seg, anchor, (nbytes + SLAB_ALIGN - 1) & -SLAB_ALIGN]
        _stats.bump("slabs_started")
        return anchor, 0


def _slab_target(held: int) -> int:
    """The size of a new slab while ``held`` bytes of slabs are held: the largest power of
    two up to half of that, within [SLAB_MIN, SLAB_MAX].  Slabs grow only while earlier
    ones stay held, so their count grows with the logarithm of what is kept, and what is
    reserved stays within about twice what is held."""
    size = SLAB_MIN
    while size * 4 <= held and size < SLAB_MAX:
        size *= 2
    return size


def _next_slab(nbytes: int, kind: str) -> Segment:
    """The slab to carve from next (caller holds ``_lock``): a free one (every array in it
    released everywhere) near the target size, else a new one of that size.  Free slabs
    past one spare, or far larger than the target, are destroyed: after a burst of kept
    arrays, a stream of dropped ones cycles through small slabs again."""
    table = ofd_lease.own_table()
    idle = _own_idle[kind]
    held, free = 0, []
    probes = 0
    for seg in list(_slabs[kind].values()):
        if seg.alive() or idle.get(seg.key) is not seg or probes >= _SCAN_LIMIT:
            held += seg.size
            continue
        probes += 1
        if held_anywhere(table, seg.slot):
            held += seg.size
        else:
            free.append(seg)
    target = _slab_target(held)
    # nearest the target first, the larger of two as near
    free.sort(key=lambda seg: (abs(seg.size.bit_length() - target.bit_length()), -seg.size))
    chosen = free.pop(0) if free and free[0].size <= 2 * target else None
    spare = 0
    for seg in free:
        if seg.size <= 2 * target and spare + seg.size <= target:
            spare += seg.size
        else:
            _destroy(seg)
    if chosen is not None:
        _own_idle_drop(chosen)
        _stats.bump("segments_recycled")
        return chosen
    try:
        seg = _create(target, kind, table)
    except posix_shm.ShmSpaceError as e:
        if target > SLAB_MIN:  # a smaller slab may still fit
            try:
                seg = _create(SLAB_MIN, kind, table)
            except posix_shm.ShmSpaceError:
                pass
            else:
                _mark_slab(seg, True)
                return seg
        raise posix_shm.space_error(nbytes, e.named, e.free, e.where, slab=SLAB_MIN) from None
    _mark_slab(seg, True)
    return seg


def pin(seg: Segment) -> None:
    """Keep ``seg`` out of reuse (a BatchPool's slot) until :func:`unpin`."""
    with _lock:
        seg.pinned = True
        _own_idle_drop(seg)


def unpin(seg: Segment) -> None:
    with _lock:
        seg.pinned = False
        if seg.own and not seg.alive() and _by_key.get(seg.key) is seg:
            seg.idle_since = time.monotonic()
            _own_idle_put(seg)
    _ensure_sweeper()


def _destroy(seg: Segment) -> None:
    _own_idle_drop(seg)
    _mark_slab(seg, False)
    shared = seg.file is not None
    seg.close()  # a segment of a shared file: the file goes with the last of them
    if seg.kind == FS and not shared:
        posix_shm.unlink_named(seg.key)
        janitor.untrack(seg.key)
    _stats.bump("segments_destroyed")


def acquire_many(nbytes: int, kind: str, count: int) -> list[Segment]:
    """``count`` pinned own segments of ``nbytes`` each, carved from one file (one fd, one
    name), each with its own lease, so each is free again on its own (a BatchPool's
    slots).  Unpinned, they are reused like any other segment."""
    cap = _capacity(nbytes)
    table = ofd_lease.own_table()
    slots = [table.new_slot() for _ in range(count)]
    name = posix_shm.segment_name(slots[0], unguessable=kind == FS)
    size = cap * count
    with _lock:
        fd = _create_file(name, size, kind, slots, table)
        shared = _SharedFile(fd if kind == FD else None, name if kind == FS else None, 0)
        segs: list[Segment] = []
        try:
            for i, slot in enumerate(slots):
                key = f"{name}@{i * cap}"
                seg = new_segment(key, kind, cap, table.id, slot, own=True, fd=fd,
                                  populate=True)
                seg.pinned = True
                seg.file = shared
                shared.users += 1
                _by_key[key] = seg
                segs.append(seg)
        except BaseException:
            for seg in segs:
                seg.close()
            if not segs:
                shared.users = 1
                shared.release()
            raise
        finally:
            if kind == FS:
                os.close(fd)  # attached by name
        if kind == FS:
            for seg in segs:
                seg.fd = None
    _stats.bump("segments_created", count)
    _stats.bump("bytes_created", size)
    return segs


def trim(force: bool = False) -> int:
    """Destroy idle, unheld own segments past the age or byte budget (all with ``force``).

    Cheap when there is nothing to do: nothing is looked at before the oldest idle segment
    can be due, and a pass looks at most at the oldest few of each strategy."""
    global _next_trim
    if not _died.empty():
        with _lock:
            _settle()
    now = time.monotonic()
    budget = _idle_budget()
    if not force and now < _next_trim and _own_idle_bytes <= budget:
        return 0
    freed = 0
    table = ofd_lease.own_table() if any(_own_idle.values()) else None
    with _lock:
        next_due = now + max(IDLE_SECONDS.values())
        for kind, idle in _own_idle.items():
            age = IDLE_SECONDS[kind]
            oldest = list(idle.values()) if force else list(islice(idle.values(), _SCAN_LIMIT))
            for seg in oldest:
                due = now - seg.idle_since > age
                if not (force or due or _own_idle_bytes > budget):
                    next_due = min(next_due, seg.idle_since + age)
                    break  # oldest first: the rest are younger
                if seg.alive() or idle.get(seg.key) is not seg:
                    continue
                if table is None:  # an own segment went idle since the test above
                    table = ofd_lease.own_table()
                if held_anywhere(table, seg.slot):
                    idle.move_to_end(seg.key)  # held elsewhere: let the next pass reach others
                    next_due = min(next_due, now + _RETRIM_SECONDS)
                    continue
                freed += seg.size
                _destroy(seg)
        _next_trim = next_due
    return freed


# --- attached segments (the receive cache) ------------------------------------------------

def receive(key: str, kind: str, size: int, table_id: str, slot: int,
            fd: int | list[int] | None, lease: int | list[int],
            deferred: Deferred | None = None, fd_i: int = 0) -> tuple[np.ndarray, bool]:
    """The anchor of segment ``key`` here, mapping the segment if this process has not
    (from ``fd``, or by name), and whether its memfd was kept.  ``fd`` may be the
    message's fd list, the memfd at ``fd_i``.  ``lease`` and ``deferred`` are
    :meth:`Segment.anchor`'s: the message's in-flight description (with ``deferred`` while
    a pickle is loaded), or the message's fd list when that description, last, covers this
    segment alone (a one-array message).  What is kept (the memfd, the description) leaves
    the list in the same step as it is taken, so the caller closes what is left, however
    this ends."""
    with _lock:  # lookup, map and anchor as one step: eviction cannot slip in between
        seg, took = _attached(key, kind, size, table_id, slot, fd, fd_i)
        try:
            return seg.anchor(lease, deferred), took
        except BaseException:
            _unanchored(seg, took, fd if type(fd) is list else None, fd_i)
            raise


def attach_held(key: str, kind: str, size: int, table_id: str, slot: int,
                fd: Callable[[], int], lease: Callable[[], int]) -> np.ndarray:
    """The anchor of segment ``key`` for a message that came without fds: mapped (from a
    new fd of the memfd ``fd()`` gives, which stays the caller's) if this process has
    not, and held by a lock through this process's description of its lease file, made
    from the one ``lease()`` gives (the caller's) if it has none."""
    fds: list[int] = []
    try:
        with _lock:
            seg, took = _by_key.get(key), False
            if seg is None or seg.mm is None:
                fds.extend(map(os.dup, (fd(),)))
                seg, took = _attached(key, kind, size, table_id, slot, fds)
            try:
                try:
                    return seg.anchor()
                except KeyError:  # no description of the lease file here
                    return seg.anchor(lease())
            except BaseException:
                _unanchored(seg, took, fds or None)
                raise
    finally:
        if fds:
            close_fds(fds)


def _unanchored(seg: Segment, took: bool, fds: list[int] | None = None, i: int = 0) -> None:
    """A received segment whose anchor could not be made (its hold failed: no fd or lock
    left): the message's fd stays the caller's to close (back in ``fds``, at ``i``, when it
    was taken from there), and the mapping idles in the receive cache instead of staying
    mapped for good (caller holds ``_lock``)."""
    global _kept_fds
    if took and seg.fd is not None:
        if fds is not None:
            fds[i] = seg.fd; seg.fd = None  # noqa: E702 (one line: owned once)
        else:
            seg.fd = None
        _kept_fds -= 1
    if not seg.own and not seg.alive():
        _cache_put(seg)


def _attached(key: str, kind: str, size: int, table_id: str, slot: int,
              fds: list[int] | int | None, i: int = 0) -> tuple[Segment, bool]:
    """Segment ``key`` mapped here, and whether its memfd was kept (caller holds
    ``_lock``).  ``fds``: the memfd (``FD`` kind), or the message's fd list with it at
    ``i``, which a kept memfd then leaves (-1) in the same step as the segment takes it.
    A new segment is idle in the receive cache until anchored, so one an exception (a
    signal handler's) abandons on its way to its anchor is evicted, not mapped for good."""
    global _kept_fds
    seg = _by_key.get(key)
    if seg is not None and seg.mm is not None:
        return seg, False
    name, offset = file_of(key)
    if type(fds) is not list:
        # an fd the caller keeps owning (fds is an int or None here: type() is not list)
        fds, i = [-1 if fds is None else fds], 0  # type: ignore[list-item]
    if fds[i] < 0 and kind == FD:
        raise ValueError(f"segment {key!r} came without its fd: a corrupt message")
    if not _died.empty() or _cache_bytes > _idle_budget():
        evict_idle()  # what died goes idle, and idle mappings past the budget go first
    budget = ofd_lease.kept_budget()
    opened: list[int] = []  # a named segment's fd, from the step that opens it
    seg, took = None, False
    try:
        mapfd = fds[i] if kind == FD else posix_shm.open_named(name, opened)
        posix_shm.check_extent(mapfd, offset, size, key)
        seg = new_segment(key, kind, size, table_id, slot, own=False, fd=mapfd)
        if kind == FD and _kept_fds < budget:
            # one line of stores, no call: kept by the segment and out of the list
            took = True; _kept_fds += 1; fds[i] = -1  # noqa: E702
        else:  # not kept: the caller's (a message's), or closed here (a named one's)
            seg.fd = None
        close_fds(opened)  # the mapping stays
        _cache_put(seg)  # idle until anchored; published after (see the except below)
        _by_key[key] = seg
        _stats.bump("segments_attached")
        _stats.bump("bytes_attached", size)
    except BaseException:
        close_fds(opened)
        if seg is not None and _by_key.get(key) is not seg:
            # never published: unmapped (closing a kept fd); out of the receive cache as
            # close() ends, so a close cut short leaves it there for eviction to finish
            if not took:
                seg.fd = None
            seg.close()
        raise
    return seg, took


def new_segment(key: str, kind: str, size: int, table_id: str, slot: int, own: bool, fd: int,
                populate: bool = False) -> Segment:
    seg = Segment.__new__(Segment)
    seg.key, seg.kind, seg.size = key, kind, size
    seg.table_id, seg.slot, seg.own = table_id, slot, own
    seg.fd = fd
    seg.address = 0
    seg._anchor = None
    seg.idle_since = time.monotonic()
    seg.pinned = False  # reserved by a BatchPool: never reused by acquire
    seg.slab = False
    seg.file = None
    seg.ino = 0
    seg.mm = None
    if _sweeper is None:  # settles what dies while anything is mapped (see _sweep)
        # before anything is mapped: an exception starting it (a signal handler's, no
        # thread to be had) leaves nothing made, where one after the mapping would leave
        # it unowned, mapped for good (the caller has no segment yet to close)
        _ensure_sweeper()
    mapped: list[posix_shm.Mapping] = []
    try:
        # the mapping is in ``mapped`` before it maps, so an exception (a signal
        # handler's) anywhere after that unmaps it below
        posix_shm.map_into(mapped, fd, size, populate, file_of(key)[1])
        seg.mm = mapped[0]
        seg.address = seg.mm.address  # type: ignore[assignment]  # mapped (or map_into raised)
        _by_buffer[id(seg.mm.buffer)] = seg
        _index(seg)
    except BaseException:
        seg.fd = None  # the caller's still
        seg.close()
        for m in mapped:  # not yet the segment's (closed already if it was)
            m.close()
        raise
    return seg


def evict_idle(force: bool = False) -> int:
    """Unmap idle attached segments past the cache limits (all of them with ``force``).
    Oldest first, and it stops at the first one within every limit."""
    now = time.monotonic()
    freed = 0
    budget = min(CACHE_IDLE_BYTES, _idle_budget())
    with _lock:
        _settle()
        while _cache:
            seg = next(iter(_cache.values()))
            if not (force or len(_cache) > CACHE_IDLE_COUNT or _cache_bytes > budget
                    or now - seg.idle_since > CACHE_IDLE_SECONDS):
                break
            # out of the cache once closed: an exception (a signal handler's) in the middle
            # leaves it there for the next call to finish (close() resumes where it stopped)
            if not seg.alive():
                freed += seg.size
                seg.close()
                _stats.bump("segments_evicted")
            _cache_drop(seg)
    return freed


# --- the sweeper, views for tools, fork ----------------------------------------------------

_sweeper: tuple[threading.Thread, threading.Event] | None = None
_sweeping_at_fork = False  # whether a fork stopped it (started again after, in the parent)
SWEEP_SECONDS = 1.0
_sweep_error_logged = False


def _sweep(stop: threading.Event) -> None:
    """Settle what died, apply the idle limits and run the :data:`sweepers` while the
    process is otherwise quiet; stop when nothing is mapped (an anchor can only die while
    something is) and no sweeper has work left, or when told (before a fork).  An error in
    one pass is logged once and the next pass goes on."""
    global _sweeper, _sweep_error_logged
    while not stop.wait(SWEEP_SECONDS):
        busy = True  # unless every hook says it has nothing left (an error: try again)
        try:
            trim()
            evict_idle()
            busy = False
            for hook in sweepers:
                busy = hook() or busy
        except Exception:
            busy = True
            if _AnchorRef.exiting:  # interpreter shutting down: nothing left to sweep for
                return
            if not _sweep_error_logged:
                _sweep_error_logged = True
                import logging
                logging.getLogger("shmtensor").warning(
                    "shmtensor: trimming idle shared memory failed (it is tried again every "
                    "%s s; this is logged once per process)", SWEEP_SECONDS, exc_info=True)
        with _lock:
            if not _by_key and _died.empty() and not busy:
                if _sweeper is not None and _sweeper[1] is stop:
                    _sweeper = None
                return


def _ensure_sweeper() -> None:
    global _sweeper
    if _sweeper is None:
        with _lock:
            if _sweeper is None:
                stop = threading.Event()
                t = threading.Thread(target=_sweep, args=(stop,), daemon=True,
                                     name="shmtensor-sweeper")
                t.start()
                # published once started: a fork from another thread in between must not
                # find a thread it cannot join
                _sweeper = (t, stop)


def _stop_sweeper_before_fork() -> None:
    """No thread of ours runs across a fork: a child forked from a multi-threaded process
    may deadlock, and Python >= 3.12 warns about every such fork.  The sweeper is woken,
    joined, and started again after the fork (:func:`_after_fork_in_parent`)."""
    global _sweeper, _sweeping_at_fork
    sweeper, _sweeper = _sweeper, None
    _sweeping_at_fork = sweeper is not None
    if sweeper is None:
        return
    thread, stop = sweeper
    stop.set()
    thread.join(1.0)  # a pass takes milliseconds; never hang a fork on it
    # join returns when the thread's Python state is gone; the kernel's thread (which is
    # what Python counts before warning) ends a moment later
    task = f"/proc/self/task/{thread.native_id}"
    deadline = time.monotonic() + 0.1
    while not thread.is_alive() and os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.0001)


def _after_fork_in_parent() -> None:
    if _by_key or _sweeping_at_fork:  # (a sweeper hook's work may need it, nothing mapped)
        _ensure_sweeper()


def mapped() -> list[Segment]:
    with _lock:
        _settle()
        return list(_by_key.values())


def idle_segments() -> list[Segment]:
    """Own segments waiting for reuse."""
    with _lock:
        _settle()
        return [s for idle in _own_idle.values() for s in idle.values()]


def empty_cache() -> int:
    """Let go of the current slabs and destroy or unmap everything idle that nobody holds;
    returns the bytes freed."""
    _release_held()
    with _lock:
        current = list(_current.values())
        _current.clear()
    del current  # slabs with no live array go idle here
    return trim(force=True) + evict_idle(force=True)


def _await_unlinked_space(size: int, timeout: float = 1.0) -> None:
    """Wait until /dev/shm has ``size`` bytes free, or ``timeout``: an unlinked segment's
    space comes back only once every fd of it is closed, and the janitor closes its own
    when it reads the untrack message, in its own time."""
    deadline = time.monotonic() + timeout
    while shm_space.shm_free(posix_shm.SHM_DIR) < size and time.monotonic() < deadline:
        time.sleep(0.005)


def give_back() -> bool:
    """Before a reservation fails for want of room: let go of the current slabs and give
    back every idle segment nobody holds, own or cached.  True when anything was freed."""
    _release_held()
    with _lock:
        current = list(_current.values())
        _current.clear()
        del current  # slabs with no live array go idle here
        freed = trim(force=True) + evict_idle(force=True)
    shm_space.forget()
    return freed > 0


def _after_fork_in_child() -> None:
    """The parent's segments are not the child's to reuse: forget them (views stay valid)."""
    global _lock, _sweeper, _own_idle_bytes, _next_trim, _kept_fds
    _lock = threading.RLock()
    _sweeper = None
    _next_trim = 0.0
    files: dict[int, _SharedFile] = {}  # the parent's shared files -> the child's copies
    for seg in list(_by_key.values()):
        if seg.own:
            seg.own = False  # attached, as far as this child is concerned
            seg.slab = False
            if seg.file is not None:  # the inherited fd is closed with the last segment
                mine = files.get(id(seg.file))
                if mine is None:
                    mine = files[id(seg.file)] = _SharedFile(seg.file.fd, None, 0)
                mine.users += 1
                seg.file = mine
            elif seg.fd is not None:
                _kept_fds += 1
    for idle in _own_idle.values():
        for seg in list(idle.values()):
            if not seg.alive():
                seg.close()
        idle.clear()
    _buckets.clear()
    _own_idle_bytes = 0
    for slabs in _slabs.values():
        slabs.clear()
    _current.clear()  # the parent carves on: the child's arrays come from its own slabs


# Registered after the package's own hooks (this module is imported later), so the sweeper
# is stopped before ofd_lease.before_fork takes the locks a pass may need.
os.register_at_fork(before=_stop_sweeper_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


@atexit.register
def _at_exit() -> None:
    sweeper = _sweeper
    if sweeper is not None:
        sweeper[1].set()  # its last pass ends before the modules are torn down
    try:
        trim(force=True)
    except Exception:  # never fail interpreter shutdown over a cache
        pass
    _AnchorRef.exiting = True  # as weakref.finalize's own exit hook stops its finalizers
