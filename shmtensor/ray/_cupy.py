"""CuPy arrays through Ray: a CUDA IPC handle on the sender's host, the data elsewhere.

The sender exports the allocation holding the array as the queues do
(``cuda._ipc._export``: ``cuMemGetAddressRange``, as CuPy's pool sub-allocates, one
``cudaIpcGetMemHandle`` per allocation and a lease slot per chunk), waits for its current
stream (the receiver then reads finished data; Ray gives no stream to wait on), and keeps
the export's token and a lease description for as long as Ray references the handle's
pin, and after that until no receiver holds the slot (see :mod:`._exports`).

A receiver on the same host maps the handle through shmtensor.cuda's own table of opened
handles (``cuda._ipc._mapped``), so an allocation that reaches a process both through a
queue and through Ray is one mapping, and holds the slot while any array on it lives; the last one's death enqueues the release
(shmtensor.cuda's releaser, once the device work is done); the mapping stays open while
idle, until evicted, as a queue's does.  A received array sent on, through Ray or a queue,
names its exporter's handle and slot (CUDA will not export an imported handle), so its
return to the exporter is the exporter's own memory.  Elsewhere, or
when the GPU is not visible to the receiver, the agent of the sender's node copies the
data to the host and it is copied onto the receiver's current device.  Memory CUDA IPC
cannot export (``shmtensor.cuda.malloc``'s VMM slabs, managed memory) is sent by value,
as Ray sends CuPy arrays without shmtensor.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from shmtensor.cuda import _device, _ipc, _release
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


# CuPy has no type information: its module, arrays and memory are Any here
def _cupy() -> Any:
    import cupy
    return cupy


def serialize(arr: Any) -> tuple[Any, ...]:
    """Ray's serializer for ``cupy.ndarray``."""
    import ray
    if ray.is_initialized() and arr.size:
        try:
            exported = export(arr)
            # a result off the driver's node carries its bytes too: see _exports.carry
            return (*exported, arr.__reduce_ex__(5)) if _exports.carry() else exported
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
    if isinstance(owner, _ipc._Use):  # a received array sent on: its exporter's handle
        return _forward(ray, cp, arr, owner)
    h, token = handle_of(cp, arr, ray.get_runtime_context().get_node_id())
    try:
        pin = _exports.new_pin()
    except BaseException:
        os.close(h.lease_fd)
        raise
    _exports.add(pin, _exports.Export([h.lease_fd], (arr.data.mem, token), h.slot))
    return ("s", h, pin)


def handle_of(cp: Any, arr: Any, node_id: str) -> tuple[CudaHandle, object]:
    """``arr``'s handle, exported as the queues export (``cuda._ipc._export``: one export
    per allocation, a lease slot per chunk, found again by a message that comes home), and
    the token to keep while the handle may be unsent (with ``lease_fd``, its in-flight
    description: the caller's to keep and close)."""
    device = arr.device.id
    with cp.cuda.Device(device), cuda_ipc.Current(device):  # any thread: see Current
        lease, token = _ipc._export(cp, arr, device)
        cp.cuda.get_current_stream().synchronize()  # receivers read finished data
    ex = lease.export
    table = ofd_lease.own_table()
    fd = ofd_lease.inflight_fd(table.id, [lease.slot])
    return CudaHandle(_host.host_id(), node_id, os.getpid(), fd, table.id, lease.slot,
                      ex.handle, ex.bus_id, ex.size, arr.data.ptr - ex.base, arr.shape,
                      arr.strides, arr.dtype.str), token


def _forward(ray: ModuleType, cp: Any, arr: Any,
             owner: _ipc._Use) -> tuple[str, CudaHandle, Pin]:
    """Send on an array received from another process (through Ray or a queue): CUDA
    refuses to export an imported handle, so the message names the exporter's handle and
    slot, and this process's new description of the exporter's lease (kept while Ray
    references the pin)."""
    m = owner.mapping
    with cp.cuda.Device(arr.device.id):
        cp.cuda.get_current_stream().synchronize()  # receivers read finished data
    lease = ofd_lease.inflight_fd(owner.table_id, [owner.slot])
    try:
        pin = _exports.new_pin()
    except BaseException:
        os.close(lease)
        raise
    _exports.add(pin, _exports.Export([lease], arr.data.mem))
    fwd = CudaHandle(_host.host_id(), ray.get_runtime_context().get_node_id(), os.getpid(),
                     lease, owner.table_id, owner.slot, m.handle, m.bus_id, m.size,
                     arr.data.ptr - m.ptr, arr.shape, arr.strides, arr.dtype.str)
    return ("s", fwd, pin)


def _local_device(cp: Any, bus_id: str) -> int:
    try:
        return cast(int, cp.cuda.runtime.deviceGetByPCIBusId(bus_id))
    except Exception:
        raise _host.NotReachable(0, f"GPU {bus_id} is not visible here") from None


def attach(h: CudaHandle) -> Any:
    """The sender's device memory, mapped here as a queue's message's is (back in the
    process that exported it, through Ray or a queue: its own memory); the slot held
    through the sender's description of its lease file."""
    cp = _device.cupy()  # the fork error first; the releases below need it imported
    _release.ensure_releaser()
    _local_device(cp, h.bus_id)  # NotReachable where this process cannot see the GPU

    def take() -> None:  # the slot's hold, unless an array of this process holds it
        src = _host.open_peer_fd(h.pid, h.lease_fd, f"{posix_shm.PREFIX}_{h.table_id}_lease")
        try:
            ofd_lease.hold(h.table_id, h.slot, src)
        finally:
            os.close(src)
    mem, view = _ipc._map(cp, h.ipc_handle, h.bus_id, h.size, h.offset, h.shape, h.strides,
                          h.dtype, h.table_id, h.slot, None, take)
    return _ipc._view(cp, mem, view, None)


def rebuild(h: CudaHandle, carried: Callable[[], Any] | None = None) -> Any:
    """The array a handle stands for: the sender's device memory on its host, else a copy
    (of the bytes the payload carried, or from the agent of the sender's node)."""
    if h.host == _host.host_id():
        try:
            return attach(h)
        except _host.NotReachable:
            pass
        except _host.SenderGone:
            if carried is None:
                raise
    if carried is not None:
        return carried()  # CuPy's own reduction: a copy on the current device
    import numpy as np
    out = np.empty(h.shape, h.dtype)
    _agent.fetch_into(h.node_id, h, out)
    return _cupy().asarray(out)


def read_for_agent(h: CudaHandle) -> np.ndarray:
    return cast("np.ndarray", attach(h).get())  # CuPy's copy to the host


deserialize = _exports.deserializer(rebuild)  # Ray's deserializer: by value, or rebuild()
