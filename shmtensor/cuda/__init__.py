"""CUDA: CuPy arrays and interprocess events through shmtensor channels.

Nothing here initialises CUDA or imports CuPy until an array is actually sent or
received: ``is_available()`` and ``device_count()`` ask NVML (respecting
``CUDA_VISIBLE_DEVICES``).  Without CuPy, everything else in shmtensor works and the CUDA
entry points say how to install it.  Using CUDA through shmtensor in a forked child of a
process that initialised CUDA raises the fork error, not an opaque driver error.
"""

from __future__ import annotations

from ipc import cuda_ipc

from . import _ipc
from ._ipc import IpcEvent

__all__ = ["is_available", "device_count", "ipc_collect", "exports", "IpcEvent"]


def device_count() -> int:
    """GPUs this process can see, from NVML: never initialises CUDA."""
    return cuda_ipc.nvml_device_count()


def is_available() -> bool:
    """True when a GPU is visible and CuPy is installed (CUDA is not initialised)."""
    if device_count() == 0:
        return False
    import importlib.util
    return importlib.util.find_spec("cupy") is not None


def ipc_collect() -> int:
    """Let go of device memory this process exported and nobody holds any more."""
    cuda_ipc.check_not_bad_fork()
    return _ipc.collect()


def exports() -> list[dict]:
    """Device allocations this process keeps for other processes, and whether still held."""
    return _ipc.exports()
