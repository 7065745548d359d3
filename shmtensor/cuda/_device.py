"""CuPy, imported on first use, and which local device holds another process's memory.

Every CUDA entry point of shmtensor (sending, receiving, events, ``ipc_collect``) starts
with :func:`cupy`, which raises the fork error before any driver call in a forked child of
a process that had initialised CUDA (see :mod:`shmtensor.ipc.cuda_ipc`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, ContextManager, cast

from shmtensor.ipc import cuda_ipc

_cp: Any = None  # the cupy module (untyped: Any)
_devices: dict[str, int] = {}  # PCI bus id -> this process's device index (only grows)
_bus_ids: dict[int, str] = {}  # and back


def cupy() -> Any:
    """CuPy, imported on first use (never at shmtensor's import); the fork error first."""
    if _cp is not None and not cuda_ipc.bad_fork():
        return _cp
    return _import_cupy()


def _import_cupy() -> Any:
    global _cp
    cuda_ipc.check_can_initialize()  # the fork error, even where no fork hook saw the fork
    try:
        import cupy as cp
    except ImportError as e:
        raise ImportError("shmtensor's CUDA support needs CuPy: pip install 'shmtensor[cuda12]' "
                          "(CUDA 12) or 'shmtensor[cuda13]' (CUDA 13)") from e
    _cp = cp
    return cp


def on(cp: Any, device: int) -> ContextManager[Any]:
    """``device`` made current for a ``with`` block: nothing to do where it is already
    (entering ``cp.cuda.Device`` costs driver calls even then)."""
    if cp.cuda.runtime.getDevice() == device:
        return contextlib.nullcontext()
    return cast(ContextManager[Any], cp.cuda.Device(device))


def local_device(cp: Any, bus_id: str) -> int:
    """This process's index of the device at PCI ``bus_id`` (where a sender's memory is)."""
    device = _devices.get(bus_id)
    if device is not None:
        return device
    try:
        device = _devices[bus_id] = cast(int, cp.cuda.runtime.deviceGetByPCIBusId(bus_id))
        return device
    except Exception:
        raise RuntimeError(
            f"this array lives on the GPU at PCI bus id {bus_id}, which this process cannot "
            f"see (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): "
            "make that device visible to the receiving process") from None


def bus_id(cp: Any, device: int) -> str:
    """The PCI bus id of this process's ``device`` (asked of the runtime once)."""
    found = _bus_ids.get(device)
    if found is None:
        found = _bus_ids[device] = cp.cuda.runtime.deviceGetPCIBusId(device)
    return found
