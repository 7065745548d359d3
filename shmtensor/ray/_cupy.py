"""CuPy arrays through Ray: a CUDA IPC handle on the sender's host, the data elsewhere.

The sender exports the allocation holding the array (``cuMemGetAddressRange``: CuPy's
pool sub-allocates) with ``cudaIpcGetMemHandle``, waits for its current stream (the
receiver then reads finished data; Ray gives no stream to wait on), and keeps the CuPy
memory and a lease description for as long as Ray references the handle's pin, and after
that until no receiver holds the export's lease slot (see :mod:`._exports`).

A receiver on the same host opens the handle once per process (a second open of one
handle in one process fails) and holds the slot while any array on it lives; the last
one's death enqueues the release (shmtensor.cuda's releaser: once the device work is done
the slot is released and the handle closed).  A received array sent on names its
exporter's handle and slot (CUDA will not export an imported handle), so its return to
the exporter is the exporter's own memory.  Elsewhere, or
when the GPU is not visible to the receiver, the agent of the sender's node copies the
data to the host and it is copied onto the receiver's current device.  Memory CUDA IPC
cannot export (``shmtensor.cuda.malloc``'s VMM slabs, managed memory) is sent by value,
as Ray sends CuPy arrays without shmtensor.
"""

from __future__ import annotations

import os
import threading
from functools import partial
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from shmtensor.cuda import _device, _release
from shmtensor.ipc import cuda_ipc, ofd_lease, posix_shm

from . import _agent, _exports, _host

if TYPE_CHECKING:
    import numpy as np

    from ._exports import Pin


class CudaHandle(NamedTuple):
    host: str
    node_id: str
    pid: int
    lease_fd: int
    table_id: str
    slot: int
    ipc_handle: bytes
    bus_id: str
    size: int
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str


_lock = threading.Lock()
_opened: dict[bytes, list[int]] = {}  # ipc handle -> [device pointer, live uses]
# (table, slot) -> this process's exported memory: (CuPy memory, its base device pointer)
_own: dict[tuple[str, int], tuple[Any, int]] = {}


# CuPy has no type information: its module, arrays and memory are Any here
def _cupy() -> Any:
    import cupy
    return cupy


def serialize(arr: Any) -> tuple[str, CudaHandle, Pin] | tuple[str, tuple[Any, ...]]:
    """Ray's serializer for ``cupy.ndarray``."""
    import ray
    if ray.is_initialized() and arr.size:
        try:
            return export(arr)
        except cuda_ipc.CudaIpcError:
            pass
        except Exception as e:  # cudaIpcGetMemHandle refuses VMM or managed memory
            if type(e).__name__ != "CUDARuntimeError":
                raise
    return ("p", arr.__reduce_ex__(5))




def export(arr: Any) -> tuple[str, CudaHandle, Pin]:
    import ray
    cp = _cupy()
    mem = arr.data.mem
    owner = getattr(mem, "_owner", None) if isinstance(mem, cp.cuda.UnownedMemory) else None
    if isinstance(owner, _Use):  # a received array sent on: its exporter's handle and slot
        return _forward(ray, cp, arr, owner)
    device = arr.device.id
    with cp.cuda.Device(device), cuda_ipc.Current(device):  # any thread: see Current
        base, size = cuda_ipc.address_range(arr.data.ptr)
        handle = bytes(cp.cuda.runtime.ipcGetMemHandle(base))
        bus_id = cp.cuda.runtime.deviceGetPCIBusId(device)
        cp.cuda.get_current_stream().synchronize()
    table = ofd_lease.own_table()
    slot = table.new_slot()
    lease = ofd_lease.inflight_fd(table.id, [slot])
    try:
        pin = _exports.new_pin()
    except BaseException:
        os.close(lease)
        raise
    keep = (arr.data.mem, base)
    _own[(table.id, slot)] = keep
    _exports.add(pin, _exports.Export([lease], keep, slot,
                                                       partial(_forget_own, table.id, slot)))
    h = CudaHandle(_host.host_id(), ray.get_runtime_context().get_node_id(), os.getpid(),
                   lease, table.id, slot, handle, bus_id, size, arr.data.ptr - base,
                   arr.shape, arr.strides, arr.dtype.str)
    return ("s", h, pin)


def _forward(ray: ModuleType, cp: Any, arr: Any,
             owner: "_Use") -> tuple[str, CudaHandle, Pin]:
    """Send on an array received from another process: CUDA refuses to export an imported
    handle, so the message names the exporter's handle and slot, and this process's new
    description of the exporter's lease (kept while Ray references the pin)."""
    h = owner.h
    with cp.cuda.Device(arr.device.id):
        cp.cuda.get_current_stream().synchronize()  # receivers read finished data
    with _lock:
        base = _opened[h.ipc_handle][0]
    lease = ofd_lease.inflight_fd(h.table_id, [h.slot])
    try:
        pin = _exports.new_pin()
    except BaseException:
        os.close(lease)
        raise
    _exports.add(pin, _exports.Export([lease], arr.data.mem))
    fwd = h._replace(host=_host.host_id(), node_id=ray.get_runtime_context().get_node_id(),
                     pid=os.getpid(), lease_fd=lease, offset=arr.data.ptr - base,
                     shape=arr.shape, strides=arr.strides, dtype=arr.dtype.str)
    return ("s", fwd, pin)


class _Use:
    """One received array's hold on an opened handle and on the export's lease slot.  Its
    death only enqueues the release (``shmtensor.cuda._release``: after this process's
    work on the device is done, then the handle is closed by :func:`_closed_one`)."""

    def __init__(self, h: CudaHandle, device: int) -> None:
        self.h, self.device = h, device

    def __del__(self) -> None:
        _release.enqueue(self.device, self.h.table_id, self.h.slot,
                         partial(_closed_one, self.h.ipc_handle, self.device))


def _closed_one(handle: bytes, device: int, n: int) -> None:
    """``n`` uses of ``handle`` were released (from a drain, not a finalizer): close the
    handle with the last one."""
    with _lock:
        entry = _opened.get(handle)
        if entry is None:
            return
        entry[1] -= n
        if entry[1] > 0:
            return
        del _opened[handle]
    try:
        cp = _cupy()
        with cp.cuda.Device(device):
            cp.cuda.runtime.ipcCloseMemHandle(entry[0])
    except Exception:  # shutting down: the driver lets go with the process
        pass


def _local_device(cp: Any, bus_id: str) -> int:
    try:
        return cast(int, cp.cuda.runtime.deviceGetByPCIBusId(bus_id))
    except Exception:
        raise _host.NotReachable(0, f"GPU {bus_id} is not visible here") from None


def attach(h: CudaHandle) -> Any:
    cp = _device.cupy()  # the fork error first; the releases below need it imported
    _release.poll()
    _release.ensure_releaser()
    device = _local_device(cp, h.bus_id)
    keep = _own.get((h.table_id, h.slot))  # only this process's exports are there
    with cp.cuda.Device(device):
        if keep is not None:  # back in the process that exported it: its own memory
            mem = cp.cuda.UnownedMemory(keep[1], h.size, keep, device)
            return cp.ndarray(h.shape, h.dtype, cp.cuda.MemoryPointer(mem, h.offset),
                              h.strides)
        src = _host.open_peer_fd(h.pid, h.lease_fd, f"{posix_shm.PREFIX}_{h.table_id}_lease")
        try:
            ofd_lease.hold(h.table_id, h.slot, src)
        finally:
            os.close(src)
        try:
            with _lock:
                entry = _opened.get(h.ipc_handle)
                if entry is None:
                    ptr = cp.cuda.runtime.ipcOpenMemHandle(h.ipc_handle, 1)  # lazy peer access
                    entry = _opened[h.ipc_handle] = [ptr, 0]
                entry[1] += 1
        except BaseException:
            ofd_lease.release(h.table_id, h.slot)
            raise
        use = _Use(h, device)
        mem = cp.cuda.UnownedMemory(entry[0], h.size, use, device)
        return cp.ndarray(h.shape, h.dtype, cp.cuda.MemoryPointer(mem, h.offset), h.strides)


def rebuild(h: CudaHandle) -> Any:
    if h.host == _host.host_id():
        try:
            return attach(h)
        except _host.NotReachable:
            pass
    return _cupy().asarray(_agent.fetch(h.node_id, h))


def read_for_agent(h: CudaHandle) -> np.ndarray:
    return cast("np.ndarray", attach(h).get())  # CuPy's copy to the host


def _forget_own(table_id: str, slot: int) -> None:
    _own.pop((table_id, slot), None)


deserialize = _exports.deserializer(rebuild)  # Ray's deserializer: by value, or rebuild()
