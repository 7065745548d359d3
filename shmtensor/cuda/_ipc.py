"""CuPy arrays from any allocator, across processes by legacy CUDA IPC handles.

Producer: an array's allocation base (``cuMemGetAddressRange``; CuPy's pool sub-allocates)
is *exported* once: an IPC handle, a lease slot in this process's lease table, and
references that keep the memory out of CuPy's pool while any process holds the slot or a
message naming it is unsent.  Each send records a ring event (:mod:`._events`) and carries
an in-flight lock on the slot.  Exports nobody holds are dropped as sends go (the oldest
``PROBE`` looked at per send), so CuPy's pool gets their memory back and hands the same
allocations out again: their handles are ones the consumers have open already.

Consumer: opens each handle once and keeps it open (up to ``MAPPED_IDLE_LIMIT`` idle ones,
least recently used closed first), holds the slot while any array built on it lives, and
on the last one's death enqueues the release (:mod:`._release`).  Consumers that die
release by dying (OFD locks).  A received array forwarded to a third process re-sends the
original handle and slot, so the producer keeps the memory until the third process lets go.

Locks: ``_Exports.lock`` and ``_Mappings.lock`` are never held together; ``_Mappings.lock``
is held while the lease table's lock is taken (a hold), never the other way round.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections import OrderedDict

from shmtensor.ipc import cuda_ipc, ofd_lease

from .. import _wire
from . import _device, _events, _release

_IPC_LAZY_PEER = 1  # cudaIpcMemLazyEnablePeerAccess
PROBE = 2  # exports looked at per send, oldest first, to give back those nobody holds
MAPPED_IDLE_LIMIT = 1024  # idle open mappings kept per process (closing costs ~90 us)
RETIRED_LIMIT = 4096  # dropped exports remembered for reuse (each keeps a lease slot)


class _Token:
    """Kept by every unsent message naming an export (a weak reference tells it is alive)."""

    __slots__ = ("__weakref__",)


class _Export:
    __slots__ = ("slot", "handle", "base", "size", "device", "bus_id", "refs", "token",
                 "buffer")

    def __init__(self, cp, device: int, base: int, size: int) -> None:
        self.device, self.base, self.size = device, base, size
        self.buffer = cuda_ipc.buffer_id(base)
        self.handle = bytes(cp.cuda.runtime.ipcGetMemHandle(base))
        self.bus_id = _device.bus_id(cp, device)
        self.slot = ofd_lease.own_table().new_slot()
        self.refs: dict[int, object] = {}
        self.token = None  # weakref to the _Token of unsent messages, or None

    def unsent(self) -> bool:
        return self.token is not None and self.token() is not None


class _Exports:
    """Owner of this process's exports: by (device, base), with each device's bases sorted
    for finding the allocation of an inner pointer; insertion order is age."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_base: dict[tuple[int, int], _Export] = {}
        self.bases: dict[int, list[int]] = {}  # device -> sorted bases
        self.next_sweep = 64
        # Dropped exports, by (device, base), oldest first: CuPy's pool hands the same
        # allocations out again, and one exported anew (same driver buffer id) keeps its
        # handle and slot, so its consumers find their mapping open and no driver call is
        # made for the handle.
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

    def drop(self, ex: _Export) -> None:
        key = (ex.device, ex.base)
        del self.by_base[key]
        bases = self.bases[ex.device]
        del bases[bisect.bisect_left(bases, ex.base)]
        ex.refs = {}  # CuPy's pool may hand the memory out again
        ex.token = None
        self.retired[key] = ex
        if len(self.retired) > RETIRED_LIMIT:
            self.retired.popitem(last=False)

    def sweep(self, table, probe: int | None) -> int:
        """Drop exports nobody holds: the ``probe`` oldest (moving held ones to the back),
        or every one (``probe`` None).  Caller holds ``lock``."""
        dropped = 0
        items = list(self.by_base.values()) if probe is None else [
            ex for _, ex in zip(range(probe), self.by_base.values())]
        for ex in items:
            if not ex.unsent() and not table.is_held(ex.slot):
                self.drop(ex)
                dropped += 1
            elif probe is not None:  # still held: to the back of the line
                key = (ex.device, ex.base)
                self.by_base[key] = self.by_base.pop(key)
        return dropped


_exports = _Exports()


class _Mapping:
    """An IPC handle opened in this process.  It stays open while idle (a later message
    for the same allocation needs no new open) until evicted or :func:`collect`."""

    __slots__ = ("ptr", "device", "handle", "bus_id", "size", "table_id", "slot", "use",
                 "__weakref__")


class _Use:
    """Owner of the arrays built on a mapping: its death releases the lease (never the
    mapping) once this process's work on the device is done."""

    __slots__ = ("mapping", "__weakref__")


class _Mappings:
    """Owner of the handles this process opened: handle -> mapping, least recently used
    first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: "OrderedDict[bytes, _Mapping]" = OrderedDict()
        self.evict_at = MAPPED_IDLE_LIMIT  # open mappings at which a receive evicts


_mappings = _Mappings()


class UseRef(weakref.ref):
    """A weak reference to a use whose death enqueues the release of the use's lease.
    Lighter than ``weakref.finalize`` on a path taken once per received message."""

    __slots__ = ("args",)


def _use_died(r: UseRef) -> None:
    _release.enqueue(*r.args)  # a finalizer: enqueues, takes no lock


def _use_of(m: _Mapping, lease_fd: int, deferred: list) -> _Use:
    """The use of ``m`` (made and holding the lease if none is alive); caller holds the
    mappings' lock."""
    use = m.use() if m.use is not None else None
    if use is None:
        ofd_lease.hold(m.table_id, m.slot, lease_fd, deferred)
        use = _Use()
        use.mapping = m
        r = UseRef(use, _use_died)
        r.args = (m.device, m.table_id, m.slot)
        m.use = r
    return use


def reduce_array(cp, arr, mem, owner):
    """An array on memory from any allocator: its allocation's handle and its place in it."""
    device = arr.device.id
    if cp.cuda.runtime.getDevice() == device:
        return _reduce_array(cp, arr, mem, owner)
    with cp.cuda.Device(device):
        return _reduce_array(cp, arr, mem, owner)


def _reduce_array(cp, arr, mem, owner):
    """:func:`reduce_array` with the array's device current."""
    if isinstance(owner, _Use):  # forwarding what we received: same handle, same slot
        m = owner.mapping
        ev = _events.order(cp, m.device)
        table_id, slot = m.table_id, m.slot
        handle, bus_id, size, base = m.handle, m.bus_id, m.size, m.ptr
        _wire.keep_alive(mem)
    else:
        ex = export(cp, arr)
        ev = _events.order(cp, ex.device)
        table_id, slot = ofd_lease.own_table().id, ex.slot
        handle, bus_id, size, base = ex.handle, ex.bus_id, ex.size, ex.base
    lock_i = _wire.inflight_index(table_id, slot)
    return _rebuild_cupy_array, (handle, bus_id, size, arr.data.ptr - base, arr.shape,
                                 arr.strides, arr.dtype.str, table_id, slot, lock_i, ev)


def export(cp, arr) -> _Export:
    """The export of ``arr``'s allocation, made if needed; keeps ``arr``'s memory alive
    until the message being pickled is sent and nobody holds the export's slot."""
    device = arr.device.id
    ptr = arr.data.ptr
    x = _exports
    table = ofd_lease.own_table()
    with x.lock:
        ex = live = x.find(device, ptr)
        if live is not None:
            token = _attach(live, arr.data.mem)
        elif x.retired:
            ex = x.retired.pop((device, ptr), None)  # exported before, at this base
    if live is None:
        # driver calls, outside the lock: the same allocation still (a freed and remade one
        # has a new buffer id) keeps its handle and slot, else a new export
        if ex is None or cuda_ipc.buffer_id(ptr) != ex.buffer:
            base, size = cuda_ipc.address_range(ptr)
            ex = _Export(cp, device, base, size)
        with x.lock:
            found = x.by_base.get((device, ex.base))
            if found is None:
                if len(x.by_base) >= x.next_sweep:  # amortised: all, when exports doubled
                    x.sweep(table, None)
                    x.next_sweep = max(64, 2 * len(x.by_base))
                x.add(ex)
            else:
                ex = found
            token = _attach(ex, arr.data.mem)
    _wire.keep_alive(token)
    with x.lock:  # give back the oldest that nobody holds (this one is unsent: kept)
        x.sweep(table, PROBE)
    return ex


def _attach(ex: _Export, mem) -> _Token:
    """Keep ``mem`` with ``ex``; the token the message must keep (caller holds the lock)."""
    ex.refs[id(mem)] = mem
    token = ex.token() if ex.token is not None else None
    if token is None:
        token = _Token()
        ex.token = weakref.ref(token)
    return token


def own_export(table_id: str, slot: int) -> _Export | None:
    if not _exports.by_base or ofd_lease.own_table().id != table_id:
        return None
    with _exports.lock:
        return next((ex for ex in _exports.by_base.values() if ex.slot == slot), None)


def _rebuild_cupy_array(handle, bus_id, size, offset, shape, strides, dtype, table_id, slot,
                        lock_i, event_handle):
    cp = _device.cupy()
    _release.poll()
    lease_fd, deferred = _wire.received_lease(table_id, slot, lock_i)
    device = _device.local_device(cp, bus_id)
    ex = own_export(table_id, slot)
    if ex is not None:  # back in the process that exported it: its own memory, no IPC
        mem = cp.cuda.UnownedMemory(ex.base, ex.size, ex, ex.device)
        return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, offset), strides)
    _release.ensure_releaser()
    ms = _mappings
    with cp.cuda.Device(device):
        with ms.lock:
            m = ms.open.get(handle)
            if m is None or (m.table_id, m.slot) != (table_id, slot):
                if m is not None and (m.use is None or m.use() is None):
                    m.table_id, m.slot = table_id, slot  # exported anew: same memory
                elif m is None:
                    m = _Mapping()
                    m.ptr = cp.cuda.runtime.ipcOpenMemHandle(handle, _IPC_LAZY_PEER)
                    m.device, m.handle, m.bus_id, m.size = device, handle, bus_id, size
                    m.table_id, m.slot, m.use = table_id, slot, None
                    ms.open[handle] = m
            ms.open.move_to_end(handle)
            use = _use_of(m, lease_fd, deferred)
            mem = cp.cuda.UnownedMemory(m.ptr, size, use, device)
            crowded = len(ms.open) > ms.evict_at
        if crowded:
            evict(MAPPED_IDLE_LIMIT * 3 // 4)
        if event_handle is not None:
            _events.wait(cp, event_handle)
        return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, offset), strides)


def rebuild_empty(shape, dtype, bus_id):
    cp = _device.cupy()
    with cp.cuda.Device(_device.local_device(cp, bus_id)):
        return cp.empty(shape, dtype)


def evict(keep: int) -> int:
    """Close idle mappings, least recently used first, until ``keep`` mappings are left
    (or only mappings in use).  A receive that finds more than ``MAPPED_IDLE_LIMIT`` evicts
    down to 3/4 of it, so the walk is paid once per quarter of the limit, not per receive."""
    ms = _mappings
    gone = []
    with ms.lock:
        excess = len(ms.open) - keep
        for h, m in list(ms.open.items()):
            if excess <= 0:
                break
            if m.use is None or m.use() is None:
                gone.append(ms.open.pop(h))
                excess -= 1
        # mappings in use cannot go: look again once a quarter of the limit more is open
        ms.evict_at = max(MAPPED_IDLE_LIMIT, len(ms.open) + MAPPED_IDLE_LIMIT // 4)
    cp = _device._cp
    for m in gone:
        try:
            with cp.cuda.Device(m.device):
                cp.cuda.runtime.ipcCloseMemHandle(m.ptr)
        except Exception:  # shutting down: the driver closes it with the process
            pass
    return len(gone)


def collect() -> int:
    """Drop exports nobody holds any more (their memory returns to CuPy's pool) and close
    the idle mappings of other processes' memory.  Returns the exports dropped."""
    if _mappings.open:
        evict(0)
    with _exports.lock:
        return _exports.sweep(ofd_lease.own_table(), None) if _exports.by_base else 0


def exports() -> list[dict]:
    """The exports this process keeps for other processes (for leak checks and debugging)."""
    table = ofd_lease.own_table() if _exports.by_base else None
    with _exports.lock:
        return [{"kind": "ipc", "device": ex.device, "base": ex.base, "size": ex.size,
                 "slot": ex.slot, "held": table.is_held(ex.slot)}
                for ex in _exports.by_base.values()]


def stats() -> dict[str, int]:
    with _exports.lock:
        out = {"cuda_exports": len(_exports.by_base),
               "cuda_bytes_exported": sum(e.size for e in _exports.by_base.values())}
    out["cuda_opened"] = len(_mappings.open)
    return out
