"""CUDA virtual memory (VMM) allocations that cross processes as POSIX file descriptors.

Facts this module is built on (driver API, CUDA >= 10.2):

* ``cuMemCreate`` makes physical device memory with a *generic allocation handle*; asking
  for ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`` lets ``cuMemExportToShareableHandle``
  turn it into an fd, which travels like any fd (SCM_RIGHTS).  Another process turns the fd
  back into a handle with ``cuMemImportFromShareableHandle``.
* The driver frees the physical memory when no handle, no mapping and no exported fd of it
  is left in any process: the creator may exit while others still read it.
* Using memory takes a reserved address range, ``cuMemMap`` of the handle into it and
  ``cuMemSetAccess``.  Once mapped, the handle may be released (the mapping keeps the
  memory); sizes are multiples of the allocation granularity (2 MiB on current GPUs).

The calls go through ctypes over libcuda (as in :mod:`ipc.cuda_ipc`), each under the
device's primary context, so they work on any thread of a process that uses the runtime.
"""

from __future__ import annotations

import ctypes
import os

from .cuda_ipc import Current as _Current, _check

__all__ = ["supported", "granularity", "create", "export_fd", "import_fd", "map_handle",
           "unmap", "release"]

_LOCATION_DEVICE = 1           # CU_MEM_LOCATION_TYPE_DEVICE
_ALLOCATION_PINNED = 1         # CU_MEM_ALLOCATION_TYPE_PINNED
_HANDLE_POSIX_FD = 1           # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_ACCESS_READWRITE = 3          # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_GRANULARITY_RECOMMENDED = 1   # CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
_ATTR_VMM = 102                # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
_ATTR_POSIX_FD = 103           # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", _Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


def _prop(device: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = _ALLOCATION_PINNED
    prop.requestedHandleTypes = _HANDLE_POSIX_FD
    prop.location.type, prop.location.id = _LOCATION_DEVICE, device
    return prop


def supported(device: int) -> bool:
    """True when ``device`` has VMM with POSIX-fd handles (not on Windows, WSL or some vGPUs)."""
    with _Current(device) as lib:
        out = []
        for attr in (_ATTR_VMM, _ATTR_POSIX_FD):
            v = ctypes.c_int()
            _check("cuDeviceGetAttribute", lib.cuDeviceGetAttribute(ctypes.byref(v), attr, device))
            out.append(bool(v.value))
    return all(out)


def granularity(device: int) -> int:
    """The recommended size multiple for allocations on ``device``."""
    g = ctypes.c_size_t()
    with _Current(device) as lib:
        _check("cuMemGetAllocationGranularity", lib.cuMemGetAllocationGranularity(
            ctypes.byref(g), ctypes.byref(_prop(device)), _GRANULARITY_RECOMMENDED))
    return g.value


def create(device: int, size: int) -> int:
    """A new allocation of ``size`` bytes (a granularity multiple) on ``device``: its handle."""
    h = ctypes.c_ulonglong()
    with _Current(device) as lib:
        _check("cuMemCreate", lib.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size),
                                              ctypes.byref(_prop(device)), ctypes.c_ulonglong(0)))
    return h.value


def export_fd(device: int, handle: int) -> int:
    """A new fd for the allocation (close-on-exec); the caller owns and closes it."""
    fd = ctypes.c_int(-1)
    with _Current(device) as lib:
        _check("cuMemExportToShareableHandle", lib.cuMemExportToShareableHandle(
            ctypes.byref(fd), ctypes.c_ulonglong(handle), _HANDLE_POSIX_FD, ctypes.c_ulonglong(0)))
    os.set_inheritable(fd.value, False)
    return fd.value


def import_fd(device: int, fd: int) -> int:
    """A handle for the allocation behind ``fd`` (the fd stays the caller's)."""
    h = ctypes.c_ulonglong()
    with _Current(device) as lib:
        _check("cuMemImportFromShareableHandle", lib.cuMemImportFromShareableHandle(
            ctypes.byref(h), ctypes.c_void_p(fd), _HANDLE_POSIX_FD))
    return h.value


def map_handle(device: int, handle: int, size: int) -> int:
    """Map the whole allocation read-write for ``device``: the device address."""
    ptr = ctypes.c_ulonglong()
    with _Current(device) as lib:
        _check("cuMemAddressReserve", lib.cuMemAddressReserve(
            ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
            ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)))
        try:
            _check("cuMemMap", lib.cuMemMap(ctypes.c_ulonglong(ptr.value), ctypes.c_size_t(size),
                                            ctypes.c_size_t(0), ctypes.c_ulonglong(handle),
                                            ctypes.c_ulonglong(0)))
            desc = _AccessDesc()
            desc.location.type, desc.location.id = _LOCATION_DEVICE, device
            desc.flags = _ACCESS_READWRITE
            err = lib.cuMemSetAccess(ctypes.c_ulonglong(ptr.value), ctypes.c_size_t(size),
                                     ctypes.byref(desc), ctypes.c_size_t(1))
            if err:
                lib.cuMemUnmap(ctypes.c_ulonglong(ptr.value), ctypes.c_size_t(size))
                _check("cuMemSetAccess", err)
        except BaseException:
            lib.cuMemAddressFree(ctypes.c_ulonglong(ptr.value), ctypes.c_size_t(size))
            raise
    return ptr.value


def unmap(device: int, ptr: int, size: int) -> None:
    """Unmap and free the address range (the memory goes when nothing else refers to it)."""
    with _Current(device) as lib:
        _check("cuMemUnmap", lib.cuMemUnmap(ctypes.c_ulonglong(ptr), ctypes.c_size_t(size)))
        _check("cuMemAddressFree", lib.cuMemAddressFree(ctypes.c_ulonglong(ptr),
                                                        ctypes.c_size_t(size)))


def release(device: int, handle: int) -> None:
    with _Current(device) as lib:
        _check("cuMemRelease", lib.cuMemRelease(ctypes.c_ulonglong(handle)))
