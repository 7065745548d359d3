"""CuPy arrays from any allocator, across processes by legacy CUDA IPC handles.

Producer: an array's allocation (``cuMemGetAddressRange``; CuPy's pool carves many arrays
from one) is *exported* once, an IPC handle; each chunk sent (``arr.data.mem``) gets a
*lease*: a slot in this process's lease table, and a reference that keeps the chunk out of
CuPy's pool while any process holds the slot or a message naming it is unsent.  Each send
records a ring event (:mod:`._events`) and carries an in-flight lock on the slot.  Leases
nobody holds are dropped as sends go (the oldest ``PROBE`` looked at per send), so the pool
gets each chunk back on its own; an export with no lease left is remembered, and an
allocation sent again keeps its handle, one the consumers have open already.  CuPy's pool
gives each small array an allocation of its own unless it holds a larger free chunk, so
after exporting a new small allocation the producer leaves one ``ARENA`` chunk free there:
the next small arrays share its handle (one open per consumer instead of one per array).

Consumer: opens each handle once and keeps it open (up to ``MAPPED_IDLE_LIMIT`` idle ones,
least recently used closed first, by a closer thread that does not hold the GIL meanwhile),
holds each chunk's slot while any array built on that chunk lives, and on the last one's
death enqueues the release (:mod:`._release`).  Consumers that die
release by dying (OFD locks).  A received array forwarded to a third process re-sends the
original handle and slot, so the producer keeps the memory until the third process lets go.

Locks: ``_Exports.lock`` and ``_Mappings.lock`` are never held together; ``_Mappings.lock``
is held while the lease table's lock is taken (a hold), never the other way round.  The
closer thread holds ``_Mappings.lock`` only to take its batch and to say it is done, never
across a driver call.
"""

from __future__ import annotations

import bisect
import functools
import os
import pickle
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, cast

from shmtensor.ipc import cuda_ipc, ofd_lease
from shmtensor.ipc.scm_rights import close_fds

from .. import _channel, _wire
from . import _device, _events, _release

_IPC_LAZY_PEER = 1  # cudaIpcMemLazyEnablePeerAccess
PROBE = 2  # leases looked at per send, oldest first, to give back those nobody holds
MAPPED_IDLE_LIMIT = 1024  # idle open mappings kept per process (closing one: 20-90 us)
CLOSE_WAIT_S = 10.0  # how long collect() waits for the closer thread
RETIRED_LIMIT = 4096  # exports with no lease left, remembered for reuse
ARENA = 2 << 20  # the free chunk left in CuPy's pool after a small allocation is exported


class _Token:
    """Kept by every unsent message naming a lease (a weak reference tells it is alive)."""

    __slots__ = ("__weakref__",)


class _Export:
    """One allocation exported: its IPC handle, kept while any chunk of it is leased (and
    remembered after, by base, for as long as the driver's buffer id says it is the same
    allocation)."""

    __slots__ = ("handle", "base", "size", "device", "bus_id", "buffer", "leases")

    def __init__(self, cp: Any, device: int, base: int, size: int) -> None:
        self.device, self.base, self.size = device, base, size
        self.buffer = cuda_ipc.buffer_id(base)
        self.handle = bytes(cp.cuda.runtime.ipcGetMemHandle(base))
        self.bus_id = _device.bus_id(cp, device)
        self.leases = 0  # live leases on chunks of it


class _Lease:
    """One chunk of an export that was sent (CuPy's pool carves many arrays from one
    allocation): its own lease slot, and its memory, kept out of the pool until nobody
    holds the slot and no message naming it is unsent."""

    __slots__ = ("slot", "export", "mem", "token", "key")
    slot: int
    export: _Export
    mem: Any  # the chunk's CuPy memory; None once dropped
    token: weakref.ref[_Token] | None  # the unsent messages' token
    key: tuple[int, int]  # (device, chunk pointer)

    def unsent(self) -> bool:
        return self.token is not None and self.token() is not None


class _Exports:
    """Owner of this process's exports (by (device, base), each device's bases sorted, for
    finding the allocation of an inner pointer) and of their chunks' leases (by (device,
    chunk pointer), oldest first, and by slot)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_base: dict[tuple[int, int], _Export] = {}
        self.bases: dict[int, list[int]] = {}  # device -> sorted bases
        self.leases: dict[tuple[int, int], _Lease] = {}  # insertion order is age
        self.by_slot: dict[int, _Lease] = {}
        self.next_sweep = 64
        # Exports with no lease left, by (device, base), oldest first: CuPy's pool hands the
        # same allocations out again, and one sent anew (same driver buffer id) keeps its
        # handle, so its consumers find their mapping open and no driver call is made for it.
        self.retired: "OrderedDict[tuple[int, int], _Export]" = OrderedDict()

    def find(self, device: int, ptr: int) -> _Export | None:
        ex = self.by_base.get((device, ptr))
        if ex is not None:
            return ex
        bases = self.bases.get(device)
        if bases:
            i = bisect.bisect_right(bases, ptr) - 1
            if i >= 0:
                ex = self.by_base.get((device, bases[i]))
                if ex is not None and ptr < ex.base + ex.size:
                    return ex
        return None

    def add(self, ex: _Export) -> None:
        self.by_base[(ex.device, ex.base)] = ex
        bisect.insort(self.bases.setdefault(ex.device, []), ex.base)

    def lease(self, ex: _Export, key: tuple[int, int], mem: Any) -> _Lease:
        lease = _Lease()
        lease.slot, lease.export, lease.mem, lease.token, lease.key = (
            ofd_lease.own_table().new_slot(), ex, mem, None, key)
        self.leases[key] = lease
        self.by_slot[lease.slot] = lease
        ex.leases += 1
        return lease

    def drop(self, lease: _Lease) -> None:
        """Give the chunk back to CuPy's pool; retire its export if it was the last."""
        del self.leases[lease.key]
        del self.by_slot[lease.slot]
        lease.mem = lease.token = None
        ex = lease.export
        ex.leases -= 1
        if ex.leases == 0:
            key = (ex.device, ex.base)
            del self.by_base[key]
            bases = self.bases[ex.device]
            del bases[bisect.bisect_left(bases, ex.base)]
            self.retired[key] = ex
            if len(self.retired) > RETIRED_LIMIT:
                self.retired.popitem(last=False)

    def sweep(self, table: ofd_lease.LeaseTable, probe: int | None) -> int:
        """Drop leases nobody holds: the ``probe`` oldest (moving held ones to the back), or
        every one (``probe`` None).  Caller holds ``lock``."""
        dropped = 0
        leases = self.leases
        items = list(leases.values()) if probe is None else [
            lease for _, lease in zip(range(probe), leases.values())]
        for lease in items:
            if not lease.unsent() and not table.is_held(lease.slot):
                self.drop(lease)
                dropped += 1
            elif probe is not None:  # still held: to the back of the line
                leases[lease.key] = leases.pop(lease.key)
        return dropped


_exports = _Exports()


class _Mapping:
    """An IPC handle opened in this process.  It stays open while idle (a later message
    for the same allocation needs no new open) until evicted or :func:`collect`."""

    __slots__ = ("ptr", "device", "handle", "bus_id", "size", "uses", "prune_at",
                 "__weakref__")
    ptr: int
    device: int
    handle: bytes
    bus_id: str
    size: int
    uses: dict[tuple[str, int], UseRef]  # (table id, slot) -> its use
    prune_at: int

    def idle(self) -> bool:
        """True when no array built on it lives (forgets the uses that died); caller holds
        the mappings' lock."""
        uses = self.uses
        if uses:
            for k in [k for k, r in uses.items() if r() is None]:
                del uses[k]
            self.prune_at = max(16, 2 * len(uses))
        return not uses


class _Use:
    """Owner of the arrays built on one leased chunk of a mapping: its death releases the
    lease (never the mapping) once this process's work on the device is done."""

    __slots__ = ("mapping", "table_id", "slot", "__weakref__")
    mapping: _Mapping
    table_id: str
    slot: int


class _Mappings:
    """Owner of the handles this process opened: handle -> mapping, least recently used
    first, and of the evicted ones until the closer thread has closed them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # closing filled, or busy emptied
        self.open: "OrderedDict[bytes, _Mapping]" = OrderedDict()
        self.evict_at = MAPPED_IDLE_LIMIT  # open mappings at which a receive evicts
        # Evicted, to be closed by the closer thread; a receive of the same handle before
        # then takes its mapping back.  ``busy``: being closed now (a receive of the same
        # handle waits, as the driver maps a handle once per context).
        self.closing: dict[bytes, _Mapping] = {}
        self.busy: set[bytes] = set()
        self.closer = False  # the closer thread started (under lock)

    def mapped(self) -> int:
        return len(self.open) + len(self.closing) + len(self.busy)


_mappings = _Mappings()


def _closer(ms: _Mappings) -> None:
    """Close evicted mappings.  ``cuIpcCloseMemHandle`` takes 20-90 us, and CuPy's wrapper
    keeps the GIL through it: here, through ctypes, the receiving thread goes on meanwhile."""
    while ms is _mappings:
        with ms.changed:
            while not ms.closing:
                ms.changed.wait()
            batch = list(ms.closing.items())
            ms.closing.clear()
            ms.busy.update(h for h, _ in batch)
        for _, m in batch:
            try:
                cuda_ipc.close_mem_handle(m.device, m.ptr)
            except Exception:  # shutting down: the driver closes it with the process
                pass
        with ms.changed:
            ms.busy.difference_update(h for h, _ in batch)
            ms.changed.notify_all()


def _after_fork_in_child() -> None:
    global _mappings
    _mappings = _Mappings()  # the parent's mappings are no use here (CUDA does not fork)


os.register_at_fork(after_in_child=_after_fork_in_child)


class UseRef(weakref.ref[_Use]):
    """A weak reference to a use whose death enqueues the release of the use's lease.
    Lighter than ``weakref.finalize`` on a path taken once per received message."""

    __slots__ = ("args",)
    args: tuple[int, str, int]  # _release.enqueue's (device, table id, slot)


def _use_died(r: UseRef) -> None:
    _release.enqueue(*r.args)  # a finalizer: enqueues, takes no lock


def _use_of(m: _Mapping, table_id: str, slot: int, take: Callable[[], object]) -> _Use:
    """The use of chunk ``slot`` of ``m``, made if none is alive and then holding the lease
    by ``take()``; caller holds the mappings' lock."""
    key = (table_id, slot)
    r = m.uses.get(key)
    use = r() if r is not None else None
    if use is None:
        take()
        use = _Use()
        use.mapping, use.table_id, use.slot = m, table_id, slot
        r = UseRef(use, _use_died)
        r.args = (m.device, table_id, slot)
        if len(m.uses) >= m.prune_at:
            m.idle()
        m.uses[key] = r
    return use


def reduce_array(cp: Any, arr: Any, mem: Any, owner: object
                 ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """An array on memory from any allocator: its allocation's handle and its place in it."""
    device = arr.device.id
    with _device.on(cp, device):
        return _reduce_array(cp, arr, mem, owner, device)


def _reduce_array(cp: Any, arr: Any, mem: Any, owner: object, device: int
                  ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """:func:`reduce_array` with the array's device current."""
    if isinstance(owner, _Use):  # forwarding what we received: same handle, same slot
        m = owner.mapping
        ev = _events.order(cp, m.device)
        table_id, slot = owner.table_id, owner.slot
        handle, bus_id, size, base = m.handle, m.bus_id, m.size, m.ptr
        _wire.keep_alive(mem)
    else:
        lease, token = _export(cp, arr, device)
        _wire.keep_alive(token)
        ex = lease.export
        ev = _events.order(cp, ex.device)
        table_id, slot = ofd_lease.own_table().id, lease.slot
        handle, bus_id, size, base = ex.handle, ex.bus_id, ex.size, ex.base
    lock_i = _wire.inflight_index(table_id, slot)
    return _rebuild_cupy_array, (handle, bus_id, size, arr.data.ptr - base, arr.shape,
                                 arr.strides, arr.dtype.str, table_id, slot, lock_i, ev)


def _export(cp: Any, arr: Any, device: int) -> tuple[_Lease, _Token]:
    """The lease of ``arr``'s chunk (and the export of its allocation), made if needed, and
    the token the message must keep until it is sent: the chunk stays out of CuPy's pool
    until then and until nobody holds the lease's slot."""
    mem = arr.data.mem
    key = (device, mem.ptr)
    x = _exports
    table = ofd_lease.own_table()
    with x.lock:
        lease = x.leases.get(key)
        if lease is None:
            ex = x.find(device, key[1])
            if ex is not None:
                lease = x.lease(ex, key, mem)
        token = _token_of(lease) if lease is not None else None
    if lease is None:
        # driver calls, outside the lock and under the device's context (this thread may
        # never have made a CUDA call): an allocation sent before and still the same (a
        # freed and remade one has a new buffer id) keeps its handle, else a new export
        with cuda_ipc.Current(device):
            base, size = cuda_ipc.address_range(key[1])
            with x.lock:
                ex = x.retired.pop((device, base), None)
            fresh = ex is None or ex.size != size or cuda_ipc.buffer_id(base) != ex.buffer
            if fresh:
                ex = _Export(cp, device, base, size)
        with x.lock:
            found = x.find(device, key[1])
            if found is None:
                if len(x.leases) >= x.next_sweep:  # amortised: all, when leases doubled
                    x.sweep(table, None)
                    x.next_sweep = max(64, 2 * len(x.leases))
                x.add(cast(_Export, ex))  # not None: the retired one, or made above
            else:
                ex = found
            lease = x.leases.get(key) or x.lease(cast(_Export, ex), key, mem)
            token = _token_of(lease)
        if fresh and size < ARENA:
            _seed(mem)
    with x.lock:  # give back the oldest that nobody holds (this one is unsent: kept)
        x.sweep(table, PROBE)
    return lease, cast(_Token, token)  # made with the lease, found or new


def _seed(mem: Any) -> None:
    """After a small allocation of CuPy's pool was exported: leave an ``ARENA`` chunk free in
    that pool (if it has less free), so that the next small arrays are carved from one
    allocation, whose handle each receiver opens once, instead of each being a new
    ``cudaMalloc`` whose handle every receiver must open (45-65 us) and later close."""
    pool = getattr(mem, "pool", None)
    pool = pool() if pool is not None else None
    if pool is None:
        return
    try:
        if pool.free_bytes() < ARENA:
            pool.malloc(ARENA).mem.free()  # back to the pool's free list at once
    except Exception:  # out of memory, or a CuPy without these: no harm, no seed
        pass


def _token_of(lease: _Lease) -> _Token:
    """The token the message must keep (caller holds the lock)."""
    token = lease.token() if lease.token is not None else None
    if token is None:
        token = _Token()
        lease.token = weakref.ref(token)
    return token


def own_lease(table_id: str, slot: int) -> _Lease | None:
    if not _exports.by_slot or ofd_lease.own_table().id != table_id:
        return None
    with _exports.lock:
        return _exports.by_slot.get(slot)


def _rebuild_cupy_array(handle: bytes, bus_id: str, size: int, offset: int,
                        shape: tuple[int, ...], strides: tuple[int, ...], dtype: str,
                        table_id: str, slot: int, lock_i: int, event_handle: bytes | None
                        ) -> Any:
    cp = _device.cupy()
    lease_fd, deferred = _wire.received_lease(table_id, slot, lock_i)
    return _attach(cp, handle, bus_id, size, offset, shape, strides, dtype, table_id, slot,
                   lease_fd, deferred, event_handle)


def _attach(cp: Any, handle: bytes, bus_id: str, size: int, offset: int,
            shape: tuple[int, ...], strides: tuple[int, ...] | None, dtype: str,
            table_id: str, slot: int, lease: int | list[int], deferred: _wire.Deferred | None,
            event_handle: bytes | None) -> Any:
    """The one receive of an array on legacy IPC (a pickled message's and a lane's; a
    record without fds takes the same two steps apart, see :func:`held_attach`): its
    memory (:func:`_map`), then the array on it (:func:`_view`).

    ``lease`` and ``deferred`` are ``ofd_lease.hold``'s ``source`` and ``deferred``: the
    in-flight description of a pickled message, with ``deferred``, or a one-array message's
    fd list, that description last (kept as the hold, it leaves the list in the same step:
    the caller closes what is left)."""
    mem, view = _map(cp, handle, bus_id, size, offset, shape, strides, dtype, table_id, slot,
                     event_handle, functools.partial(ofd_lease.hold, table_id, slot, lease,
                                                     deferred))
    return _view(cp, mem, view, deferred)


def _map(cp: Any, handle: bytes, bus_id: str, size: int, offset: int, shape: tuple[int, ...],
         strides: tuple[int, ...] | None, dtype: str, table_id: str, slot: int,
         event_handle: bytes | None, take: Callable[[], object]) -> tuple[Any, tuple[Any, ...]]:
    """The memory of an array on legacy IPC, and the fields :func:`_view` makes the array
    of: its chunk's own memory back in the process that exported it (its own work on it,
    nothing to wait for), else the mapping of ``handle``, owned by the use of chunk
    ``slot`` (made, and holding the chunk through ``take()``, if none is alive)."""
    _release.poll()
    device = _device.local_device(cp, bus_id)
    home = _home_memory(cp, table_id, slot)
    if home is not None:
        return home, (offset, shape, strides, dtype, None, device)
    with _device.on(cp, device):
        return (_mapped(cp, device, handle, bus_id, size, table_id, slot, take),
                (offset, shape, strides, dtype, event_handle, device))


def _view(cp: Any, mem: Any, view: tuple[Any, ...], deferred: _wire.Deferred | None) -> Any:
    """The array at its offset of ``mem``, once the current stream waits for the sender's
    work: once per message and stream (a pickled message's arrays, ``deferred`` given,
    share its event), or at once (a one-array message, whose only wait this is)."""
    offset, shape, strides, dtype, event_handle, device = view
    _wire.check_view(offset, shape, strides, _itemsize(dtype), mem.size)
    if event_handle is not None:
        with _device.on(cp, device):
            _events.wait_sent(cp, event_handle, deferred)
    return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, offset), strides)


@functools.lru_cache(maxsize=64)
def _itemsize(dtype: str) -> int:
    import numpy
    return numpy.dtype(dtype).itemsize


def _home_memory(cp: Any, table_id: str, slot: int) -> Any:
    """The allocation of chunk ``slot`` of ``table_id`` if this process exported it (its
    chunk's memory object the owner), or None."""
    lease = own_lease(table_id, slot)
    mem = lease.mem if lease is not None else None
    if mem is None:
        return None
    ex = cast(_Lease, lease).export  # not None: it had memory
    return cp.cuda.UnownedMemory(ex.base, ex.size, mem, ex.device)


def _mapped(cp: Any, device: int, handle: bytes, bus_id: str, size: int, table_id: str,
            slot: int, take: Callable[[], object]) -> Any:
    """Memory over the mapping of ``handle`` (opened, or taken back from the closer), owned
    by the use of its chunk ``slot`` (made, and holding the lease by ``take()``, if none is
    alive); ``device`` is current."""
    _release.ensure_releaser()
    ms = _mappings
    with ms.lock:
        m = ms.open.get(handle)
        if m is None and ms.closing:
            m = ms.closing.pop(handle, None)  # evicted, not closed yet: taken back
            if m is not None:
                ms.open[handle] = m
        if m is None:
            while handle in ms.busy:  # being closed: the driver maps it once
                ms.changed.wait()
            m = _Mapping()
            m.ptr = cp.cuda.runtime.ipcOpenMemHandle(handle, _IPC_LAZY_PEER)
            m.device, m.handle, m.bus_id, m.size = device, handle, bus_id, size
            m.uses, m.prune_at = {}, 16
            ms.open[handle] = m
        ms.open.move_to_end(handle)
        use = _use_of(m, table_id, slot, take)
        mem = cp.cuda.UnownedMemory(m.ptr, size, use, device)
        crowded = len(ms.open) > ms.evict_at
    if crowded:
        evict(MAPPED_IDLE_LIMIT * 3 // 4)
    return mem


# A message that is one array on legacy IPC, sent without a pickler: LANE and a plain
# pickle of its fields, and one fd, the in-flight description of its chunk's lease (which
# the receiver keeps as its hold).  An empty array, or one on another device than the
# current one, takes the general path above.
LANE = b"\0I"


def lane_dumps(cp: Any, arr: Any, mem: Any, owner: object
               ) -> tuple[bytes, _wire.LaneContext] | None:
    """``arr`` alone as a message ``(payload, LaneContext)``, or None."""
    device = arr.device.id
    if arr.size == 0 or cp.cuda.runtime.getDevice() != device:
        return None
    named = None  # an export of its own may go without fds (see LaneContext.handle)
    if isinstance(owner, _Use):  # forwarding what we received: same handle, same slot
        m = owner.mapping
        handle, bus_id, size, base = m.handle, m.bus_id, m.size, m.ptr
        table_id, slot, keep = owner.table_id, owner.slot, mem
    else:
        lease, keep = _export(cp, arr, device)
        ex = lease.export
        handle, bus_id, size, base = ex.handle, ex.bus_id, ex.size, ex.base
        table = ofd_lease.own_table()
        table_id, slot = table.id, lease.slot
        named = (-1, 0, *table.shard(slot), 0)
    ev = _events.order_now(cp, device, cp.cuda.get_current_stream())
    shape = arr.shape
    strides = None if arr._c_contiguous and 1 not in shape else arr.strides
    fields = (handle, bus_id, size, arr.data.ptr - base, shape, strides, arr.dtype.str,
              table_id, slot, ev)
    return (LANE + pickle.dumps(fields, pickle.HIGHEST_PROTOCOL),
            _wire.LaneContext(keep, None, table_id, slot, named))


def lane_loads(data: _wire.Payload, fds: list[int]) -> Any:
    """The array of a :func:`lane_dumps` message; closes every fd it does not keep.  Its
    one fd is the in-flight description covering this one chunk: the list itself is the
    lease (:func:`_attach`), so nothing is deferred."""
    try:
        (handle, bus_id, size, offset, shape, strides, dtype, table_id, slot,
         event_handle) = _wire.lane_fields(data, fds, 1, "a CUDA IPC array")
        return _attach(_device.cupy(), handle, bus_id, size, offset, shape, strides, dtype,
                       table_id, slot, fds, None, event_handle)
    finally:
        close_fds(fds)


def held_attach(data: _wire.Payload, memory_fd: Callable[[], int],
                lease: Callable[[], int]) -> tuple[Any, tuple[Any, ...]]:
    """The chunk of a :func:`lane_dumps` message that came without fds (its reader holds
    its exporter's lease file already), mapped and held here as the channel takes the
    record: its memory (which holds it), and the view's fields for :func:`held_load`.
    ``lease`` gives a description of the lease file, asked for only where this process
    has none; the memory is the handle's, so ``memory_fd`` is never asked for."""
    (handle, bus_id, size, offset, shape, strides, dtype, table_id, slot,
     event_handle) = pickle.loads(memoryview(data)[len(LANE):])
    return _map(_device.cupy(), handle, bus_id, size, offset, shape, strides, dtype, table_id,
                slot, event_handle, functools.partial(_hold_named, table_id, slot, lease))


def _hold_named(table_id: str, slot: int, lease: Callable[[], int]) -> None:
    """Hold ``slot`` through this process's description of its lease file, made from
    ``lease()`` where it has none."""
    try:
        ofd_lease.hold(table_id, slot)
    except KeyError:
        ofd_lease.hold(table_id, slot, lease())


def held_load(mem: Any, view: tuple[Any, ...]) -> Any:
    """The array of a message :func:`held_attach` attached."""
    return _view(_device.cupy(), mem, view, None)


def rebuild_empty(shape: tuple[int, ...], dtype: str, bus_id: str) -> Any:
    cp = _device.cupy()
    with cp.cuda.Device(_device.local_device(cp, bus_id)):
        return cp.empty(shape, dtype)


def evict(keep: int) -> int:
    """Hand idle mappings, least recently used first, to the closer thread until ``keep``
    mappings are left (or only mappings in use).  A receive that finds more than
    ``MAPPED_IDLE_LIMIT`` evicts down to 3/4 of it, so the walk is paid once per quarter of
    the limit, not per receive."""
    ms = _mappings
    gone = 0
    with ms.lock:
        excess = len(ms.open) - keep
        for h, m in list(ms.open.items()):
            if excess <= 0:
                break
            if m.idle():
                ms.closing[h] = ms.open.pop(h)
                excess -= 1
                gone += 1
        # mappings in use cannot go: look again once a quarter of the limit more is open
        ms.evict_at = max(MAPPED_IDLE_LIMIT, len(ms.open) + MAPPED_IDLE_LIMIT // 4)
        if gone:
            if not ms.closer:
                threading.Thread(target=_closer, args=(ms,), daemon=True,
                                 name="shmtensor-cuda-close").start()
                ms.closer = True
            ms.changed.notify_all()
    return gone


def _wait_closed(timeout: float) -> bool:
    """Wait until the closer has closed every evicted mapping; False on timeout."""
    ms = _mappings
    with ms.changed:
        return ms.changed.wait_for(lambda: not ms.closing and not ms.busy, timeout)


def collect() -> int:
    """Drop leases nobody holds any more (their memory returns to CuPy's pool) and close
    the idle mappings of other processes' memory.  Returns the leases dropped.  A queue's
    records sent without fds keep their exports' tokens until taken: those taken since the
    last put are let go of first."""
    _channel.prune_all()
    if _mappings.open:
        evict(0)
    if _mappings.closing or _mappings.busy:
        _wait_closed(CLOSE_WAIT_S)
    with _exports.lock:
        return _exports.sweep(ofd_lease.own_table(), None) if _exports.leases else 0


def exports() -> list[dict[str, Any]]:
    """The chunks this process keeps for other processes (for leak checks and debugging)."""
    table = ofd_lease.own_table() if _exports.leases else None
    with _exports.lock:
        # table is None only if a lease was made since the check above: a race, which
        # raises AttributeError here
        return [{"kind": "ipc", "device": lease.export.device, "base": lease.key[1],
                 "size": lease.mem.size, "slot": lease.slot,
                 "held": table.is_held(lease.slot)}  # type: ignore[union-attr]  # the race
                for lease in _exports.leases.values()]


def stats() -> dict[str, int]:
    with _exports.lock:
        out = {"cuda_exports": len(_exports.leases),
               "cuda_bytes_exported": sum(e.size for e in _exports.by_base.values())}
    out["cuda_opened"] = _mappings.mapped()
    return out
