"""Device memory that outlives its producer: CUDA VMM slabs, sub-allocated, shared by fd.

Producer: :func:`malloc` is a CuPy allocator.  A request up to ``SMALL_MAX`` takes a block
of its power-of-two size class (at least ``MIN_BLOCK``) from a *slab*: one VMM allocation
of the device's granularity (2 MiB), cut into equal blocks.  Larger requests get a slab of
their own.  A slab is mapped here once and its POSIX fd kept; every message that carries an
array on it carries a duplicate of that fd, so a consumer needs nothing from the producer
process afterwards (the driver frees the memory when the last mapping and fd are gone).
Each block gets a lease slot when first sent; a block that was sent waits in ``_held``
when freed here and is reused only once no process holds its slot.

Consumer: maps each slab once (``_maps``, keyed by the producer's table and the slab's
serial) and keeps its fd (the driver will not re-export an imported handle, so forwarding
sends that fd on).  Each received array (with its views) owns a ``_VUse`` that holds its
block's lease once more (holds are counted); its death lets go of that hold after this
process's work on the device is done.  Idle mappings are unmapped past
``MAPPED_IDLE_LIMIT`` (or ``MAPPED_IDLE_BYTES``) and by :func:`collect`.
"""

from __future__ import annotations

import functools
import os
import pickle
import queue
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, final

from shmtensor.ipc import cuda_ipc, cuda_vmm, ofd_lease
from shmtensor.ipc.scm_rights import close_fds

from .. import _wire
from . import _device, _events, _release

if TYPE_CHECKING:
    import numpy

SMALL_MAX = 1 << 20         # requests up to this many bytes share slabs
MIN_BLOCK = 512             # smallest block (CuPy's own pool rounds to 512 B too)
RECLAIM = 64                # held blocks looked at together for reuse (see _reclaim)
PROBE = 16                  # of those, probed one by one at most, before making a new slab
MAPPED_IDLE_LIMIT = 64      # idle slabs of other processes kept mapped (each keeps an fd)
MAPPED_IDLE_BYTES = 1 << 30

_lock = threading.RLock()
_serial = 0
_slabs: dict[str, "_Slab"] = {}                      # own slabs by key
# (device, stream, block) -> [(slab, i)]
_free: dict[tuple[int, int, int], list[tuple[_Slab, int]]] = {}
_held: dict[tuple[int, int, int], deque[tuple[_Slab, int]]] = {}  # freed here, held elsewhere
_maps: "OrderedDict[str, _SlabMap]" = OrderedDict()  # other processes' slabs, LRU
_granularity: dict[int, int] = {}
# (slab, index, stream) of dead _Blocks
_freed: queue.SimpleQueue[tuple[_Slab, int, int]] = queue.SimpleQueue()
_ready: dict[int, str] = {}                          # device -> bus id, once VMM is checked


class _Mapped:
    """A slab mapped in this process at ``ptr``; ``fd`` is what a message carries for it."""

    __slots__ = ("key", "device", "bus_id", "ptr", "size", "fd")
    key: str
    device: int
    bus_id: str
    ptr: int
    size: int
    fd: int


class _Slab(_Mapped):
    """One VMM allocation made here, cut into blocks of ``block`` bytes; ``table_id``: this
    process's lease table, whose slots its blocks get."""

    __slots__ = ("block", "slots", "live", "table_id")
    block: int
    slots: list[int]  # each block's lease slot, 0 until first sent
    live: int
    table_id: str


class _SlabMap(_Mapped):
    """Another process's slab; ``users``: its blocks held by live arrays or a message."""

    __slots__ = ("users", "done")
    users: int
    done: Callable[[int], None]


@final
class _Block:
    """Owner of one allocated block in its producer: its death enqueues the block for the
    next :func:`malloc` (or :func:`collect`) to free (a finalizer takes no lock)."""

    __slots__ = ("slab", "index", "stream")
    slab: _Slab
    index: int
    stream: int

    def __del__(self) -> None:
        _freed.put((self.slab, self.index, self.stream))


class _VUse:
    """Owner of a received array on a block (and of its views): holds the block's lease
    once, and its death enqueues the release of that hold (:mod:`._release`: after this
    process's work on the device is done).  A ``__del__``, lighter than a weak reference
    with a callback on a path taken once per message; it takes no lock."""

    __slots__ = ("slab", "table_id", "slot", "done")
    slab: _Mapped
    table_id: str
    slot: int
    done: Callable[[int], None] | None

    def __del__(self) -> None:
        _release.enqueue(self.slab.device, self.table_id, self.slot, self.done)


SHARED_OWNERS = (_Block, _VUse)


def _block_size(device: int, nbytes: int) -> int:
    if nbytes <= SMALL_MAX:
        return max(MIN_BLOCK, 1 << max(0, nbytes - 1).bit_length())
    g = _granularity[device]
    return -(-nbytes // g) * g


def _prepare(cp: Any, device: int) -> None:
    """Check once per device that VMM with POSIX fds works there; learn its granularity."""
    if device in _ready:
        return
    if not cuda_vmm.supported(device):
        raise RuntimeError(
            f"GPU {device} does not support CUDA virtual memory with POSIX file descriptors "
            "(needs Linux outside WSL and a GPU/vGPU with VMM): allocate with CuPy's default "
            "allocator instead; such arrays still cross processes by CUDA IPC, but their "
            "producer must stay alive until every consumer has let go")
    _granularity[device] = cuda_vmm.granularity(device)
    _ready[device] = _device.bus_id(cp, device)  # last: marks it ready


def _new_slab(cp: Any, device: int, block: int) -> "_Slab":
    """A slab of blocks of ``block`` bytes: driver calls only, made outside ``_lock`` (an
    allocation, or a retry after giving memory back, must not stall other threads)."""
    global _serial
    size = max(block, _granularity[device])
    try:
        handle = cuda_vmm.create(device, size)
    except cuda_ipc.CudaIpcError as e:
        if "OUT_OF_MEMORY" not in str(e):
            raise
        collect()  # give back what is free here and in CuPy's pool, then try once more
        cp.get_default_memory_pool().free_all_blocks()
        try:
            handle = cuda_vmm.create(device, size)
        except cuda_ipc.CudaIpcError:
            raise cp.cuda.memory.OutOfMemoryError(size, 0) from e
    try:
        ptr = cuda_vmm.map_handle(device, handle, size)
        try:
            fd = cuda_vmm.export_fd(device, handle)
        except BaseException:
            cuda_vmm.unmap(device, ptr, size)
            raise
    finally:
        cuda_vmm.release(device, handle)  # the mapping (and the fd) keep the memory
    s = _Slab()
    with _lock:
        _serial += 1
        serial = _serial
    s.table_id = ofd_lease.own_table().id
    s.key = f"{s.table_id}.{serial}"
    s.device, s.bus_id, s.ptr, s.size, s.fd, s.block = (device, _ready[device], ptr, size,
                                                          fd, block)
    s.slots = [0] * (size // block)
    s.live = 1
    return s


def _add_slab(s: "_Slab", key: tuple[int, int, int]) -> None:
    """Make ``s`` (block 0 taken) this process's (caller holds ``_lock``)."""
    _slabs[s.key] = s
    if len(s.slots) > 1:
        _free.setdefault(key, []).extend((s, i) for i in range(len(s.slots) - 1, 0, -1))


def _reclaim(key: tuple[int, int, int]) -> tuple[_Slab, int] | None:
    """A block freed here earlier whose lease nobody holds any more, or None (caller holds
    ``_lock``).  The oldest ``RECLAIM`` held blocks are looked at together (see
    ``LeaseTable.unheld``); those found free wait in ``_free`` for the next allocations."""
    held = _held.get(key)
    if not held:
        return None
    batch = [held.popleft() for _ in range(min(RECLAIM, len(held)))]
    free = ofd_lease.own_table().unheld([slab.slots[i] for slab, i in batch], PROBE)
    ready = _free.get(key)
    if ready is None:
        ready = _free[key] = []
    still = []
    for slab, i in reversed(batch):  # the oldest last: popped first
        if slab.slots[i] in free:
            ready.append((slab, i))
            slab.live -= 1
        else:
            still.append((slab, i))
    held.extend(reversed(still))  # in their order, behind the younger ones
    if not ready:
        return None
    found = ready.pop()
    found[0].live += 1
    return found


def _take_freed() -> None:
    """Free the blocks whose owners died since (caller holds ``_lock``)."""
    while not _freed.empty():  # only this function takes from it, under _lock
        slab, index, stream = _freed.get_nowait()
        key = (slab.device, stream, slab.block)
        if slab.slots[index]:  # it was sent: reusable once nobody holds it (see _reclaim)
            held = _held.get(key)
            if held is None:
                held = _held[key] = deque()
            held.append((slab, index))
        else:
            _free.setdefault(key, []).append((slab, index))
            slab.live -= 1


def malloc(nbytes: int) -> Any:
    """CuPy allocator: ``nbytes`` of shared device memory on the current device and stream
    (what ``cupy.cuda.set_allocator(shmtensor.cuda.malloc)`` installs)."""
    cp = _device.cupy()
    device = cp.cuda.runtime.getDevice()
    stream = cp.cuda.get_current_stream().ptr
    block = (max(MIN_BLOCK, 1 << (nbytes - 1).bit_length()) if 0 < nbytes <= SMALL_MAX
             else None)
    if block is None or device not in _ready:
        _prepare(cp, device)  # driver calls, once per device: outside the lock
        if block is None:
            block = _block_size(device, nbytes)
    key = (device, stream, block)
    with _lock:
        if not _freed.empty():
            _take_freed()
        free = _free.get(key)
        found: tuple[_Slab, int] | None
        if free:
            found = free.pop()
            found[0].live += 1
        else:
            found = _reclaim(key)
    if found is None:
        slab = _new_slab(cp, device, block)
        with _lock:
            _add_slab(slab, key)
        found = slab, 0
    slab, i = found
    b = _Block()
    b.slab, b.index, b.stream = slab, i, stream
    mem = cp.cuda.UnownedMemory(slab.ptr + i * block, nbytes or 1, b, device)
    return cp.cuda.MemoryPointer(mem, 0)


def _slot_of(owner: _Block) -> int:
    """The lease slot of an own block, given on its first send."""
    slab = owner.slab
    slot = slab.slots[owner.index]
    if not slot:
        with _lock:  # two threads sending it at once must agree on one slot
            slot = slab.slots[owner.index]
            if not slot:
                slot = slab.slots[owner.index] = ofd_lease.own_table().new_slot()
    return slot


def reduce_array(cp: Any, arr: Any, mem: Any, owner: _Block | _VUse
                 ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """An array on shared memory: its slab (whose fd travels once per message), its place in
    it, and its block's lease (this process's, or the producer's when forwarding)."""
    slab: _Mapped
    if isinstance(owner, _Block):
        slab, table_id, slot = owner.slab, owner.slab.table_id, _slot_of(owner)
    else:
        slab, table_id, slot = owner.slab, owner.table_id, owner.slot
    # the array kept alive with the message keeps the slab's fd open until it is sent: a
    # live block of an own slab, or a use of a mapping
    _wire.keep_alive(mem)
    memo = _wire.message_memo()
    fd_i = memo.get(slab.key)
    if fd_i is None:
        fd_i = memo[slab.key] = _wire.attach_fd(slab.fd)
    device = slab.device
    with _device.on(cp, device):
        ev = _events.order(cp, device)
    lock_i = _wire.inflight_index(table_id, slot)
    return _rebuild_array, (slab.key, slab.bus_id, slab.size, fd_i, arr.data.ptr - slab.ptr,
                            arr.shape, arr.strides, arr.dtype.str, table_id, slot, lock_i, ev)


def _mapping(key: str, bus_id: str, size: int, fds: list[int], i: int) -> _SlabMap:
    """Another process's slab ``key`` in this process, *pinned* (one more user, which the
    caller's use takes over or gives back: the pin keeps it from being evicted as idle
    before a use counts): found, or mapped from ``fds[i]`` (a message's copy of the slab's
    fd), which the mapping keeps and which leaves the list in the same step (caller holds
    ``_lock``)."""
    m = _maps.get(key)
    if m is not None:  # its place in the LRU order is set when it falls idle
        m.users += 1
        return m
    device = _device.local_device(_device.cupy(), bus_id)
    fd = fds[i]
    handle = cuda_vmm.import_fd(device, fd)
    try:
        ptr = cuda_vmm.map_handle(device, handle, size)
    finally:
        cuda_vmm.release(device, handle)
    m = _SlabMap()
    m.key, m.device, m.bus_id, m.ptr, m.size, m.fd = key, device, bus_id, ptr, size, fd
    m.users = 1  # pinned
    m.done = functools.partial(_map_released, m)  # a use's release calls it
    # one line of stores, no call: kept by the mapping and out of the message's list
    _maps[key] = m; fds[i] = -1  # noqa: E702
    return m


# dtype.str -> numpy dtype: CuPy takes a dtype faster than a string
_dtypes: dict[str, numpy.dtype[Any]] = {}
_dtype_strs: dict[numpy.dtype[Any], str] = {}  # and back: numpy makes a new string each .str


def _numpy_dtype(dtype: str) -> numpy.dtype[Any]:
    import numpy
    return numpy.dtype(dtype)


def _attach(cp: Any, key: str, bus_id: str, size: int, fds: list[int], fd_i: int,
            offset: int, shape: tuple[int, ...], strides: tuple[int, ...] | None, dtype: str,
            table_id: str, slot: int, lease: int | list[int], deferred: _wire.Deferred | None,
            event_handle: bytes | None) -> Any:
    """The one receive of an array on a VMM slab (a pickled message's and a lane's): the
    slab ``key`` here (this process's own, or another's, mapped from ``fds[fd_i]`` if it is
    not yet), a new use of its block ``slot`` that holds the block once more, and the array
    at ``offset`` on it, after the current stream waits for the sender's work.

    ``lease`` and ``deferred`` are ``ofd_lease.hold``'s ``source`` and ``deferred``: the
    in-flight description of a pickled message, with ``deferred``, or a one-array message's
    fd list, that description last (it becomes the hold at once).  What is kept (the slab's
    fd, the description) leaves ``fds`` in the step that takes it: the caller closes what is
    left, however this ends.  Holds are counted, so two messages carrying one block give
    two uses and each lets go on its own.  Written for the cost of each call: it runs once
    per message of a queue of GPU arrays."""
    _release.poll()
    _release.ensure_releaser()
    done: Callable[[int], None] | None
    with _lock:
        s: _Mapped | None = _slabs.get(key)
        if s is None:  # another process's slab: mapped, and pinned, which is the use's count
            m = _mapping(key, bus_id, size, fds, fd_i)
            try:
                ofd_lease.hold(table_id, slot, lease, deferred)
            except BaseException:
                m.users -= 1
                raise
            s, done = m, m.done
        else:  # back where it was made
            ofd_lease.hold(table_id, slot, lease, deferred)
            done = None
        use = _VUse()  # owns the hold (and the pin) from here on
        use.slab, use.table_id, use.slot, use.done = s, table_id, slot, done
    dt = _dtypes.get(dtype)
    if dt is None:
        dt = _dtypes[dtype] = _numpy_dtype(dtype)
    device = s.device
    if cp.cuda.runtime.getDevice() != device:
        with cp.cuda.Device(device):
            return _array(cp, s, use, offset, shape, strides, dt, event_handle, deferred)
    if event_handle is not None:
        if deferred is None:  # one array: its message waits on this event once anyway
            _events.stream_wait(cp, event_handle, cp.cuda.get_current_stream().ptr)
        else:
            _events.wait(cp, event_handle)
    ptr = cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(s.ptr, s.size, use, device), offset)
    if strides is None:
        return cp.ndarray(shape, dt, ptr)
    return cp.ndarray(shape, dt, ptr, strides)


def _array(cp: Any, s: _Mapped, use: _VUse, offset: int, shape: tuple[int, ...],
           strides: tuple[int, ...] | None, dt: numpy.dtype[Any], event_handle: bytes | None,
           deferred: _wire.Deferred | None) -> Any:
    """:func:`_attach`'s wait and array with ``s``'s device current, when it was not."""
    _wire.check_view(offset, shape, strides, dt.itemsize, s.size)
    if event_handle is not None:
        _events.wait_sent(cp, event_handle, deferred)
    mem = cp.cuda.UnownedMemory(s.ptr, s.size, use, s.device)
    if strides is None:
        return cp.ndarray(shape, dt, cp.cuda.MemoryPointer(mem, offset))
    return cp.ndarray(shape, dt, cp.cuda.MemoryPointer(mem, offset), strides)


def _rebuild_array(key: str, bus_id: str, size: int, fd_i: int, offset: int,
                   shape: tuple[int, ...], strides: tuple[int, ...], dtype: str, table_id: str,
                   slot: int, lock_i: int, event_handle: bytes | None) -> Any:
    cp = _device.cupy()
    lease_fd, deferred = _wire.received_lease(table_id, slot, lock_i)
    return _attach(cp, key, bus_id, size, _wire.received_fds(), fd_i, offset, shape, strides,
                   dtype, table_id, slot, lease_fd, deferred, event_handle)


# A message that is one array on shared memory, the common case of a queue of arrays, goes
# without a pickler: LANE and a plain pickle of its fields, and its fds (the slab's, then
# the in-flight description of the block's lease, which the receiver keeps as its hold).
# Anything else (a view on another device, an array inside a container, ...) takes the
# general path above.
LANE = b"\0V"


def lane_dumps(cp: Any, arr: Any, mem: Any, owner: _Block | _VUse
               ) -> tuple[bytes, _wire.LaneContext] | None:
    """``arr`` alone as a message ``(payload, LaneContext)``, or None when it is not on the
    current device; ``mem``/``owner``: its memory and that memory's owner, one of
    ``SHARED_OWNERS`` (the caller checked CuPy and the fork first)."""
    slab: _Mapped
    if type(owner) is _Block:
        slab = owner.slab
        slot = slab.slots[owner.index] or _slot_of(owner)
        table_id = slab.table_id
    else:
        slab, table_id, slot = owner.slab, owner.table_id, owner.slot
    device = slab.device
    if cp.cuda.runtime.getDevice() != device:
        return None  # the general path switches devices
    ev = _events.order_now(cp, device, cp.cuda.get_current_stream())
    # strides None: C-contiguous with no axis of length 1 (whose stride CuPy's flag
    # ignores), so the receiver's ndarray may compute them, which is faster than checking
    shape = arr.shape
    strides = None if arr._c_contiguous and 1 not in shape else arr.strides
    dtype = arr.dtype
    dts = _dtype_strs.get(dtype)
    if dts is None:
        dts = _dtype_strs[dtype] = dtype.str
    fields = (slab.key, slab.bus_id, slab.size, arr.data.ptr - slab.ptr, shape, strides, dts,
              table_id, slot, ev)
    # the array's memory, kept until sent, keeps the slab's fd open (see reduce_array)
    return (LANE + pickle.dumps(fields, pickle.HIGHEST_PROTOCOL),
            _wire.LaneContext(mem, slab.fd, table_id, slot))


def lane_loads(data: _wire.Payload, fds: list[int]) -> Any:
    """The array of a :func:`lane_dumps` message; closes every fd it does not keep.  Its
    fds are the slab's, then the in-flight description covering this one block: the list
    itself is the lease (:func:`_attach`), so nothing is deferred."""
    try:
        (key, bus_id, size, offset, shape, strides, dtype, table_id, slot,
         event_handle) = _wire.lane_fields(data, fds, 2, "a shared CUDA array")
        return _attach(_device.cupy(), key, bus_id, size, fds, 0, offset, shape, strides,
                       dtype, table_id, slot, fds, None, event_handle)
    finally:
        close_fds(fds)


def _map_released(m: _SlabMap, n: int) -> None:
    """``n`` uses of ``m`` were released (from a drain, not a finalizer)."""
    with _lock:
        m.users -= n
        if m.users == 0 and _maps.get(m.key) is m:
            _maps.move_to_end(m.key)  # the most recently idle: evicted last
        # Idle mappings no larger than BYTES / LIMIT can only break the byte limit by
        # breaking the count limit first: only a larger one needs a look at once.
        if len(_maps) > MAPPED_IDLE_LIMIT or m.size > MAPPED_IDLE_BYTES // MAPPED_IDLE_LIMIT:
            _evict(MAPPED_IDLE_LIMIT, MAPPED_IDLE_BYTES)


def _evict(keep: int, keep_bytes: int) -> int:
    """Unmap idle mappings of other processes' slabs, oldest first, beyond ``keep`` of them
    and ``keep_bytes`` in all."""
    with _lock:
        idle = [m for m in _maps.values() if m.users == 0]
        total = sum(m.size for m in idle)
        gone: list[_SlabMap] = []
        for m in idle:
            if len(idle) - len(gone) <= keep and total <= keep_bytes:
                break
            gone.append(_maps.pop(m.key))
            total -= m.size
    for m in gone:
        _unmap(m.device, m.ptr, m.size, m.fd)
    return len(gone)


def _unmap(device: int, ptr: int, size: int, fd: int) -> None:
    try:
        cuda_vmm.unmap(device, ptr, size)
    except Exception:  # shutting down: the driver unmaps with the process
        pass
    os.close(fd)


def collect() -> int:
    """Reclaim blocks whose consumers let go, give back slabs with nothing live in them (the
    driver frees their memory once no other process maps them) and unmap idle mappings of
    other processes' slabs.  Returns the slabs given back."""
    table = ofd_lease.own_table() if _slabs else None
    with _lock:
        _take_freed()
        # table is None only if a slab was made since the check above: a race, which
        # raises AttributeError here once a block of it is held
        for key, held in list(_held.items()):
            for _ in range(len(held)):
                slab, i = held.popleft()
                if table.is_held(slab.slots[i]):  # type: ignore[union-attr]  # the race
                    held.append((slab, i))
                else:
                    _free.setdefault(key, []).append((slab, i))
                    slab.live -= 1
        empty = [s for s in _slabs.values() if s.live == 0]
        for s in empty:
            del _slabs[s.key]
        if empty:
            for key, free in list(_free.items()):
                free[:] = [(s, i) for s, i in free if s.key in _slabs]
    if empty:
        import cupy as cp
        for device in {s.device for s in empty}:
            with cp.cuda.Device(device):
                cp.cuda.Device(device).synchronize()  # our own work on them is done
    for s in empty:
        _unmap(s.device, s.ptr, s.size, s.fd)
    _evict(0, 0)
    return len(empty)


def exports() -> list[dict[str, Any]]:
    """Blocks freed here that other processes still hold (or that wait for :func:`collect`)."""
    table = ofd_lease.own_table() if _slabs else None
    with _lock:
        # table is None only if a slab was made since the check above: a race, which
        # raises AttributeError here once a block of it is held
        return [{"kind": "vmm", "device": s.device, "base": s.ptr + i * s.block,
                 "size": s.block, "slot": s.slots[i],
                 "held": table.is_held(s.slots[i])}  # type: ignore[union-attr]  # the race
                for held in list(_held.values()) for s, i in list(held)]


def stats() -> dict[str, int]:
    with _lock:
        return {"cuda_vmm_slabs": len(_slabs),
                "cuda_vmm_bytes": sum(s.size for s in _slabs.values()),
                "cuda_vmm_blocks_held": sum(len(h) for h in _held.values()),
                "cuda_vmm_mapped": len(_maps)}
