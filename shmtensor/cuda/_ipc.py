"""CuPy arrays and interprocess events on shmtensor channels (legacy CUDA IPC).

Producer: an array's allocation base (``cuMemGetAddressRange``; CuPy's pool sub-allocates)
is *exported* once: an IPC handle, a lease slot in this process's lease table, and
references that keep the memory out of CuPy's pool while any process holds the slot.  Each
send records an interprocess event on its stream (the consumer's stream waits on it, the
host does not) and carries an in-flight lock on the slot.

Consumer: opens each handle once and keeps it open (up to ``MAPPED_IDLE_LIMIT`` idle ones,
least recently used closed first), holds the slot while any array built on it lives, and
on the last one's death waits for its own work on the device and releases the slot.
Consumers that die release by dying (OFD locks).  A received array forwarded to a third
process re-sends the original handle and slot, so the producer keeps the memory until the
third process lets go too.  The producer drops released exports in
:func:`ipc_collect`, which also runs on every new export.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections import OrderedDict, deque

from shmtensor.ipc import cuda_ipc, ofd_lease

from .. import _reductions

_IPC_LAZY_PEER = 1  # cudaIpcMemLazyEnablePeerAccess
# Interprocess events per device, recorded round-robin: re-recording an event another
# process is still waiting on costs ~0.1 ms per send, so a ring keeps them apart.
RING = 64

_monotonic = time.monotonic
_lock = threading.RLock()
_exports: dict[tuple[int, int], "_Export"] = {}
_mapped: "OrderedDict[bytes, _Mapping]" = OrderedDict()  # handle -> open mapping, LRU
MAPPED_IDLE_LIMIT = 1024  # idle open mappings kept per process (closing costs ~90 us)
_opened_events: dict[bytes, int] = {}       # handle -> opened pointer (IpcEvent objects)
_ring_opened: "OrderedDict[bytes, int]" = OrderedDict()  # other senders' ring events
RING_OPENED_LIMIT = 4096
_rings: dict[int, list] = {}                # device -> [(event, handle)], up to RING
_ring_next: dict[int, int] = {}
_own_events: dict[bytes, object] = {}       # handle -> this process's own ring event


_cp = None


def cupy():
    """CuPy, imported on first use (never at shmtensor's import)."""
    if _cp is not None and not cuda_ipc.bad_fork():
        return _cp
    return _import_cupy()


def _import_cupy():
    global _cp
    cuda_ipc.check_not_bad_fork()
    try:
        import cupy as cp
    except ImportError as e:
        raise ImportError("shmtensor's CUDA support needs CuPy: pip install 'shmtensor[cuda12]' "
                          "(CUDA 12) or 'shmtensor[cuda13]' (CUDA 13)") from e
    _cp = cp
    return cp


class _Export:
    __slots__ = ("slot", "handle", "base", "size", "device", "bus_id", "refs", "pending")

    def __init__(self, cp, device: int, base: int, size: int) -> None:
        self.device, self.base, self.size = device, base, size
        self.handle = cp.cuda.runtime.ipcGetMemHandle(base)
        self.bus_id = cp.cuda.runtime.deviceGetPCIBusId(device)
        self.slot = ofd_lease.own_table().new_slot()
        self.refs: dict[int, object] = {}
        self.pending = 0  # messages pickled but not yet sent: no in-flight lock covers them


class _Pending:
    """Kept by a message until it is sent: its export must not be dropped before then."""

    __slots__ = ("export",)

    def __init__(self, export: _Export) -> None:
        self.export = export
        with _lock:
            export.pending += 1

    def __del__(self) -> None:
        with _lock:
            self.export.pending -= 1


class _Mapping:
    """An IPC handle opened in this process.  It stays open while idle (a later message
    for the same allocation needs no new open) until evicted or :func:`collect`."""

    __slots__ = ("ptr", "device", "handle", "bus_id", "size", "table_id", "slot", "use",
                 "__weakref__")


class _Use:
    """Owner of the arrays built on a mapping: its death releases the lease (never the
    mapping) once this process's work on the device is done."""

    __slots__ = ("mapping", "__weakref__")


class UseRef(weakref.ref):
    """A weak reference to a use whose death releases the use's lease: ``_release(*args)``.
    Lighter than ``weakref.finalize`` on a path taken once per received message; whoever
    keeps the ref must keep it until the use dies (or the release never happens)."""

    __slots__ = ("args",)


def use_ref(use, args: tuple) -> UseRef:
    r = UseRef(use, _use_died)
    r.args = args
    return r


def _use_died(r: UseRef) -> None:
    # Takes no module lock: a GC pass may run this inside another module's locked section.
    try:
        _release(*r.args)
    except Exception:  # interpreter shutdown: dying releases anyway
        pass


def _use_of(m: _Mapping, lease_fd: int, deferred: list) -> _Use:
    use = m.use() if m.use is not None else None
    if use is None:
        ofd_lease.hold(m.table_id, m.slot, lease_fd, deferred)
        use = _Use()
        use.mapping = m
        m.use = use_ref(use, (m.device, m.table_id, m.slot))
    return use


def _order(cp, device: int) -> bytes | None:
    """Order the current stream's queued work before the receiver's use: the handle of a
    ring event recorded on it (or None after synchronizing the stream, when no interprocess
    event is to be had).  Once per message and stream."""
    stream = cp.cuda.get_current_stream()
    memo = _reductions.message_memo()
    key = ("cuda-order", device, stream.ptr)
    if key in memo:
        return memo[key]
    handle = memo[key] = order_now(cp, device, stream)
    return handle


def order_now(cp, device: int, stream) -> bytes | None:
    """:func:`_order` for a message that carries one array (no memo needed).  The event is
    recorded whether or not the stream has work queued: asking first (``stream.done``) costs
    as much as recording, and a stream that just made the array it sends is rarely idle."""
    with _lock:
        ring = _rings.get(device)
        if ring is None:
            ring = _rings[device] = []
        i = _ring_next.get(device, 0)
        if i >= len(ring):
            try:
                ev = cp.cuda.Event(block=False, disable_timing=True, interprocess=True)
                handle = bytes(cp.cuda.runtime.ipcGetEventHandle(ev.ptr))
                ring.append((ev, handle))
                _own_events[handle] = ev
            except Exception:  # out of event resources: reuse what there is, or synchronize
                if not ring:
                    stream.synchronize()
                    return None
                i = 0
        ev, handle = ring[i]
        _ring_next[device] = (i + 1) % RING
    ev.record(stream)
    return handle


def reduce_cupy_array(arr):
    cp = cupy()
    if arr.size == 0:
        bus_id = cp.cuda.runtime.deviceGetPCIBusId(arr.device.id)
        return _rebuild_empty, (arr.shape, arr.dtype.str, bus_id)
    mem = arr.data.mem
    owner = getattr(mem, "_owner", None) if isinstance(mem, cp.cuda.UnownedMemory) else None
    vmm = sys.modules.get("shmtensor.cuda._vmm")
    if vmm is not None and isinstance(owner, vmm.SHARED_OWNERS):
        return vmm.reduce_array(cp, arr, mem, owner)
    with cp.cuda.Device(arr.device.id):
        if isinstance(owner, _Use):  # forwarding what we received: same handle, same slot
            m = owner.mapping
            ev = _order(cp, m.device)
            table_id, slot = m.table_id, m.slot
            handle, bus_id, size, base = m.handle, m.bus_id, m.size, m.ptr
            _reductions.keep_alive(mem)
        else:
            ex = export(cp, arr)
            _reductions.keep_alive(_Pending(ex))
            ev = _order(cp, ex.device)
            table_id, slot = ofd_lease.own_table().id, ex.slot
            handle, bus_id, size, base = ex.handle, ex.bus_id, ex.size, ex.base
    lock_i = _reductions.inflight_index(table_id, slot)
    return _rebuild_cupy_array, (bytes(handle), bus_id, size, arr.data.ptr - base, arr.shape,
                                 arr.strides, arr.dtype.str, table_id, slot, lock_i,
                                 ev)


def export(cp, arr) -> _Export:
    """The export of ``arr``'s allocation, made if needed; keeps ``arr``'s memory alive."""
    device = arr.device.id
    ptr = arr.data.ptr
    with _lock:  # an allocation already exported needs no driver query
        ex = next((e for (d, b), e in _exports.items()
                   if d == device and b <= ptr < b + e.size), None)
    if ex is None:
        base, size = cuda_ipc.address_range(ptr)
    else:
        base, size = ex.base, ex.size
    with _lock:
        ex = _exports.get((device, base))
        if ex is None:
            if len(_exports) >= _next_sweep[0]:  # amortised: sweep when exports doubled
                _drop_released()
                _next_sweep[0] = max(64, 2 * len(_exports))
            ex = _exports[(device, base)] = _Export(cp, device, base, size)
        ex.refs[id(arr.data.mem)] = arr.data.mem
    return ex


def collect() -> int:
    """Drop exports nobody holds any more (their memory returns to CuPy's pool) and close
    the idle mappings of other processes' memory.  Returns the exports dropped."""
    _drain(block=True)  # releases waiting for this process's device work
    if _mapped:
        _evict(0)
    vmm = sys.modules.get("shmtensor.cuda._vmm")
    return _drop_released() + (vmm.collect() if vmm is not None else 0)


def _drop_released() -> int:
    table = ofd_lease.own_table()
    dropped = 0
    with _lock:
        for key, ex in list(_exports.items()):
            if ex.pending == 0 and not table.is_held(ex.slot):
                del _exports[key]
                dropped += 1
    return dropped


_next_sweep = [64]  # export count at which export() next drops released ones
_devices: dict[str, int] = {}  # PCI bus id -> this process's device index


def _local_device(cp, bus_id: str) -> int:
    device = _devices.get(bus_id)
    if device is not None:
        return device
    try:
        device = _devices[bus_id] = cp.cuda.runtime.deviceGetByPCIBusId(bus_id)
        return device
    except Exception:
        import os
        raise RuntimeError(
            f"this array lives on the GPU at PCI bus id {bus_id}, which this process cannot "
            f"see (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): "
            "make that device visible to the receiving process") from None


def _rebuild_empty(shape, dtype, bus_id):
    cp = cupy()
    with cp.cuda.Device(_local_device(cp, bus_id)):
        return cp.empty(shape, dtype)


# Releases wait for this process's work on the memory.  A release on a default stream
# only notes (device, stream, lease); a *flush* records one event per (device, stream) for
# everything noted since, and a *drain* releases, oldest first, what those events cover.
# The releasing thread drains (without waiting) once BATCH notes or DRAIN_S have gathered,
# so no event, thread hand-off or driver call is paid per array; a helper thread drains
# only what nobody has drained for DRAIN_S (the process stopped releasing), so it does not
# compete for the GIL with a busy one.  A release on a user stream records its event at
# once (the stream may be gone by the next flush).
_noted: "deque[tuple]" = deque()    # (device, stream, table_id, slot, done)
_pending: "deque[tuple]" = deque()  # (event, device, [(table_id, slot, done)]), oldest first
_drain_lock = threading.Lock()
_wake = threading.Event()
_idle_events: dict[int, list] = {}  # device -> events whose work is done, to record again
_releaser_started = False
_last_drain = [0.0]                 # time.monotonic() of the last drain
DRAIN_S = 0.002
BATCH = 64
# Streams that are the same stream in every thread (the legacy default stream): a flush in
# another thread may record on them.  cudaStreamPerThread (2) is not: it gets its event at
# once, in the releasing thread, as user streams do.
_SHARED_STREAMS = (0, 1)


def _release(device: int, table_id: str, slot: int, done=None) -> None:
    """The last array on a mapping (or VMM block) died: release its lease once the work this
    process queued on the current stream is done, then call ``done``."""
    global _releaser_started
    lease = (table_id, slot, done)
    try:
        stream = _current_stream(_cp, device)
        if stream in _SHARED_STREAMS:
            _noted.append((device, stream, lease))
        else:
            _pending.append((_record(_cp, device, stream), device, [lease]))
    except Exception:  # interpreter or driver shutting down: wait, if it still can, and go
        _release_now(device, [lease])
        return
    if len(_noted) >= BATCH or _monotonic() - _last_drain[0] >= DRAIN_S:
        _drain(block=False)
    if not _wake.is_set():
        if not _releaser_started:
            with _lock:
                if not _releaser_started:
                    threading.Thread(target=_releaser, daemon=True,
                                     name="shmtensor-cuda-release").start()
                    _releaser_started = True
        _wake.set()
    if len(_mapped) > MAPPED_IDLE_LIMIT:
        _evict(MAPPED_IDLE_LIMIT)


def _release_now(device: int | None, leases: list) -> None:
    """Release ``leases`` without an event: after the device's work, if it can still say."""
    if device is not None:
        try:
            import cupy as cp
            with cp.cuda.Device(device):
                cp.cuda.Device(device).synchronize()
        except Exception:  # the driver is going away: dying releases anyway
            pass
    for table_id, slot, done in leases:
        ofd_lease.release(table_id, slot)
        if done is not None:
            try:
                done()
            except Exception:  # shutting down
                pass


def _current_stream(cp, device: int) -> int:
    try:
        return cp.cuda.get_current_stream(device).ptr
    except TypeError:  # a CuPy without the device argument
        with cp.cuda.Device(device):
            return cp.cuda.get_current_stream().ptr


def _record(cp, device: int, stream: int):
    with cp.cuda.Device(device):
        try:
            ev = _idle_events[device].pop()
        except (KeyError, IndexError):  # none idle (another thread may have taken the last)
            ev = cp.cuda.Event(block=False, disable_timing=True)
        cp.cuda.runtime.eventRecord(ev.ptr, stream)
    return ev


def _flush(cp) -> None:
    """One event per (device, stream) for the releases noted so far."""
    groups: dict[tuple, list] = {}
    while _noted:
        device, stream, lease = _noted.popleft()
        groups.setdefault((device, stream), []).append(lease)
    for (device, stream), leases in groups.items():
        try:
            _pending.append((_record(cp, device, stream), device, leases))
        except Exception:  # no event to be had: wait here instead
            _release_now(device, leases)


def _drain(block: bool) -> None:
    """Flush, then release what the done events cover (``block``: wait for them)."""
    if not _noted and not _pending:
        return
    if not _drain_lock.acquire(blocking=block):
        return  # another thread is draining
    try:
        _last_drain[0] = _monotonic()
        import cupy as cp
        _flush(cp)
        while _pending:
            ev, device, leases = _pending[0]
            if block:
                try:
                    ev.synchronize()
                except Exception:  # the driver is going away with the process
                    pass
            elif not ev.done:
                break
            _pending.popleft()
            _idle_events.setdefault(device, []).append(ev)
            _release_now(None, leases)
    finally:
        _drain_lock.release()


def _releaser() -> None:
    """Drain what no releasing thread has drained for DRAIN_S."""
    while True:
        _wake.wait()
        _wake.clear()
        while _noted or _pending:
            time.sleep(DRAIN_S)
            if _monotonic() - _last_drain[0] >= DRAIN_S:
                _drain(block=True)


def wait_event(cp, event_handle: bytes) -> None:
    """Make the current stream wait for a sender's ring event (the host does not wait);
    once per message and stream."""
    memo = _reductions.message_memo()
    stream = cp.cuda.get_current_stream().ptr
    key = ("cuda-wait", event_handle, stream)
    if key in memo:
        return
    memo[key] = True
    stream_wait(cp, event_handle, stream)


def stream_wait(cp, event_handle: bytes, stream: int) -> None:
    """Make ``stream`` wait for a sender's ring event."""
    own = _own_events.get(event_handle)
    if own is not None:  # sent to ourselves
        cp.cuda.runtime.streamWaitEvent(stream, own.ptr)
        return
    with _lock:  # no other thread closes it between the lookup and the wait
        ev = _ring_opened.get(event_handle)
        if ev is None:
            ev = _ring_opened[event_handle] = cp.cuda.runtime.ipcOpenEventHandle(event_handle)
            if len(_ring_opened) > RING_OPENED_LIMIT:  # senders come and go: close the
                _, old = _ring_opened.popitem(last=False)  # first opened
                cp.cuda.runtime.eventDestroy(old)  # waits already queued on it complete
        cp.cuda.runtime.streamWaitEvent(stream, ev)


def _evict(keep: int) -> int:
    """Close idle mappings beyond the ``keep`` most recently used."""
    closed = 0
    with _lock:
        idle = [h for h, m in _mapped.items() if m.use is None or m.use() is None]
        for handle in idle[:max(0, len(idle) - keep)]:
            m = _mapped.pop(handle)
            try:
                import cupy as cp
                with cp.cuda.Device(m.device):
                    cp.cuda.runtime.ipcCloseMemHandle(m.ptr)
            except Exception:  # shutting down: the driver closes it with the process
                pass
            closed += 1
    return closed


def _own_export(table_id: str, slot: int) -> _Export | None:
    if not _exports or ofd_lease.own_table().id != table_id:
        return None
    with _lock:
        return next((ex for ex in _exports.values() if ex.slot == slot), None)


def _rebuild_cupy_array(handle, bus_id, size, offset, shape, strides, dtype, table_id, slot,
                        lock_i, event_handle):
    cp = cupy()
    lease_fd, deferred = _reductions.received_lease(table_id, slot, lock_i)
    device = _local_device(cp, bus_id)
    ex = _own_export(table_id, slot)
    if ex is not None:  # back in the process that exported it: its own memory, no IPC
        mem = cp.cuda.UnownedMemory(ex.base, ex.size, ex, ex.device)
        return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, offset), strides)
    with cp.cuda.Device(device):
        with _lock:
            m = _mapped.get(handle)
            if m is None or (m.table_id, m.slot) != (table_id, slot):
                if m is not None and (m.use is None or m.use() is None):
                    _mapped.pop(handle)  # exported anew by its producer: same memory
                    m.table_id, m.slot = table_id, slot
                    _mapped[handle] = m
                elif m is None:
                    m = _Mapping()
                    m.ptr = cp.cuda.runtime.ipcOpenMemHandle(handle, _IPC_LAZY_PEER)
                    m.device, m.handle, m.bus_id, m.size = device, handle, bus_id, size
                    m.table_id, m.slot, m.use = table_id, slot, None
                    _mapped[handle] = m
            _mapped.move_to_end(handle)
            use = _use_of(m, lease_fd, deferred)
            mem = cp.cuda.UnownedMemory(m.ptr, size, use, device)
        if event_handle is not None:
            wait_event(cp, event_handle)
        return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, offset), strides)


class IpcEvent:
    """An interprocess CUDA event received from another process."""

    def __init__(self, ptr: int, handle: bytes) -> None:
        self.ptr, self.handle = ptr, handle

    def record(self, stream=None) -> None:
        cp = cupy()
        stream = stream or cp.cuda.get_current_stream()
        cp.cuda.runtime.eventRecord(self.ptr, stream.ptr)

    def wait(self, stream=None) -> None:
        """Make ``stream`` (default: current) wait for the event; the host does not wait."""
        cp = cupy()
        stream = stream or cp.cuda.get_current_stream()
        cp.cuda.runtime.streamWaitEvent(stream.ptr, self.ptr)

    def synchronize(self) -> None:
        cupy().cuda.runtime.eventSynchronize(self.ptr)

    def query(self) -> bool:
        return cupy().cuda.runtime.eventQuery(self.ptr) == 0

    def __reduce__(self):
        return _rebuild_event, (self.handle,)


def reduce_cupy_event(ev):
    """An interprocess event's handle.  Send an event while its own device is current: a
    CuPy event does not say which device it belongs to, and the driver (580) crashes the
    process when asked for the handle of another device's event."""
    cp = cupy()
    try:
        handle = cp.cuda.runtime.ipcGetEventHandle(ev.ptr)
    except Exception as e:
        raise ValueError("only events made with cupy.cuda.Event(interprocess=True, "
                         "disable_timing=True) can cross processes") from e
    return _rebuild_event, (bytes(handle),)


def _rebuild_event(handle: bytes) -> IpcEvent:
    cp = cupy()
    with _lock:
        ptr = _opened_events.get(handle)
        if ptr is None:
            ptr = _opened_events[handle] = cp.cuda.runtime.ipcOpenEventHandle(handle)
    return IpcEvent(ptr, handle)


def exports() -> list[dict]:
    """The exports this process keeps for other processes (for leak checks and debugging)."""
    table = ofd_lease.own_table() if _exports else None
    with _lock:
        out = [{"kind": "ipc", "device": ex.device, "base": ex.base, "size": ex.size,
                "slot": ex.slot, "held": table.is_held(ex.slot)} for ex in _exports.values()]
    vmm = sys.modules.get("shmtensor.cuda._vmm")
    return out + (vmm.exports() if vmm is not None else [])


def stats() -> dict[str, int]:
    vmm = sys.modules.get("shmtensor.cuda._vmm")
    with _lock:
        out = {"cuda_exports": len(_exports),
               "cuda_bytes_exported": sum(e.size for e in _exports.values()),
               "cuda_opened": len(_mapped), "cuda_events": len(_own_events)}
    out.update(vmm.stats() if vmm is not None else dict.fromkeys(_VMM_STATS, 0))
    return out


_VMM_STATS = ("cuda_vmm_slabs", "cuda_vmm_bytes", "cuda_vmm_blocks_held", "cuda_vmm_mapped")
