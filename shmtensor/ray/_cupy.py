"""CuPy arrays through Ray: a CUDA IPC handle on the sender's host, the data elsewhere.

The sender exports the allocation holding the array (``cuMemGetAddressRange``: CuPy's
pool sub-allocates) with ``cudaIpcGetMemHandle``, waits for its current stream (the
receiver then reads finished data; Ray gives no stream to wait on), and keeps the CuPy
memory and a lease description for as long as Ray references the handle's pin, and after
that until no receiver holds the export's lease slot (see :mod:`._exports`).

A receiver on the same host opens the handle once per process (a second open of one
handle in one process fails) and holds the slot while any array on it lives; the last
one's death waits for the device, closes the handle and releases the slot.  Elsewhere, or
when the GPU is not visible to the receiver, the agent of the sender's node copies the
data to the host and it is copied onto the receiver's current device.  Memory CUDA IPC
cannot export (``shmtensor.cuda.malloc``'s VMM slabs, managed memory) is sent by value,
as Ray sends CuPy arrays without shmtensor.
"""

from __future__ import annotations

import os
import threading
from functools import partial
from typing import NamedTuple

from shmtensor.ipc import cuda_ipc, ofd_lease, posix_shm

from . import _agent, _exports, _host


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
    shape: tuple
    strides: tuple
    dtype: str


_lock = threading.Lock()
_opened: dict[bytes, list] = {}  # ipc handle -> [device pointer, live uses]
_own: dict[tuple[str, int], object] = {}  # (table, slot) -> this process's exported memory


def _cupy():
    import cupy
    return cupy


def serialize(arr):
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


def deserialize(payload):
    if payload[0] == "p":
        red = payload[1]
        obj = red[0](*red[1])
        if len(red) > 2 and red[2] is not None:
            obj.__setstate__(red[2])
        return obj
    return rebuild(payload[1])


def export(arr):
    import ray
    cp = _cupy()
    device = arr.device.id
    with cp.cuda.Device(device):
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


class _Use:
    """One received array's hold on an opened handle and on the export's lease slot."""

    def __init__(self, h: CudaHandle, device: int) -> None:
        self.table_id, self.slot, self.handle, self.device = h.table_id, h.slot, \
            h.ipc_handle, device

    def __del__(self) -> None:
        try:
            cp = _cupy()
            with cp.cuda.Device(self.device):
                cp.cuda.runtime.deviceSynchronize()  # our work on the memory is done
                with _lock:
                    entry = _opened.get(self.handle)
                    if entry is not None:
                        entry[1] -= 1
                        if entry[1] == 0:
                            del _opened[self.handle]
                            cp.cuda.runtime.ipcCloseMemHandle(entry[0])
        except Exception:  # shutting down: the driver and the kernel let go with the process
            pass
        ofd_lease.release(self.table_id, self.slot)


def _local_device(cp, bus_id: str) -> int:
    try:
        return cp.cuda.runtime.deviceGetByPCIBusId(bus_id)
    except Exception:
        raise _host.NotReachable(0, f"GPU {bus_id} is not visible here") from None


def attach(h: CudaHandle):
    cp = _cupy()
    device = _local_device(cp, h.bus_id)
    keep = _own.get((h.table_id, h.slot)) if h.pid == os.getpid() else None
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


def rebuild(h: CudaHandle):
    if h.host == _host.host_id():
        try:
            return attach(h)
        except _host.NotReachable:
            pass
    return _cupy().asarray(_agent.fetch(h.node_id, h))


def read_for_agent(h: CudaHandle):
    return attach(h).get()


def _forget_own(table_id: str, slot: int) -> None:
    _own.pop((table_id, slot), None)
