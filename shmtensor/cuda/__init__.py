"""CUDA: CuPy arrays and interprocess events through shmtensor channels.

Any CuPy array crosses by legacy CUDA IPC (its producer keeps the memory until every
consumer has let go, so it must stay alive until then).  Arrays made by :func:`empty`,
:func:`zeros` and friends, or by CuPy while :func:`set_allocator` / :func:`using_allocator`
is in force, live in CUDA VMM memory shared by file descriptor: their producer may exit
while consumers still read, and small ones are sub-allocated from 2 MiB slabs.

Nothing here initialises CUDA or imports CuPy until an array is actually sent or
received: ``is_available()`` and ``device_count()`` ask NVML (reading
``CUDA_VISIBLE_DEVICES`` as CUDA and torch do), or, where NVML cannot tell, the driver in
a child process.  Without CuPy, everything else in shmtensor works and the CUDA
entry points say how to install it.  Using CUDA through shmtensor in a forked child of a
process that initialised CUDA raises the fork error, not an opaque driver error.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, cast

from shmtensor.ipc import cuda_ipc

from .. import _registry
from . import _device

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from .._wire import Payload
    from ._events import IpcEvent

__all__ = ["is_available", "device_count", "ipc_collect", "exports", "IpcEvent", "malloc",
           "set_allocator", "using_allocator", "empty", "zeros", "ones", "full", "empty_like",
           "zeros_like"]


def __getattr__(name: str) -> type[IpcEvent]:
    if name == "IpcEvent":
        from ._events import IpcEvent
        return IpcEvent
    raise AttributeError(f"module 'shmtensor.cuda' has no attribute {name!r}")


# The core never imports this package: it registers itself (``shmtensor`` imports it).
def _install_cupy() -> None:
    """CuPy was imported: its arrays and interprocess events cross by shmtensor's reducers."""
    from . import _reducers
    _reducers.register()


_vmm_lane_loads: Callable[[Payload, list[int]], Any] | None = None
_ipc_lane_loads: Callable[[Payload, list[int]], Any] | None = None


def _lane_loads(data: Payload, fds: list[int]) -> Any:
    """A VMM lane message: ``_vmm.lane_loads``, imported by the first one."""
    global _vmm_lane_loads
    if _vmm_lane_loads is None:
        from ._vmm import lane_loads as _vmm_lane_loads
    return _vmm_lane_loads(data, fds)  # type: ignore[misc]  # bound by the import above


def _ipc_lane(data: Payload, fds: list[int]) -> Any:
    """A legacy IPC lane message: ``_ipc.lane_loads``, imported by the first one."""
    global _ipc_lane_loads
    if _ipc_lane_loads is None:
        from ._ipc import lane_loads as _ipc_lane_loads
    return _ipc_lane_loads(data, fds)  # type: ignore[misc]  # bound by the import above


def _ipc_held_attach(data: Payload, memory_fd: Callable[[], int],
                     lease: Callable[[], int]) -> tuple[Any, Any]:
    """A legacy IPC lane message that came without fds: ``_ipc.held_attach``."""
    from ._ipc import held_attach
    return held_attach(data, memory_fd, lease)


def _ipc_held_load(mem: Any, view: Any) -> Any:
    from ._ipc import held_load
    return held_load(mem, view)


def _stats() -> dict[str, int]:
    from . import _reducers  # no CuPy import: counters of empty tables until it is used
    return _reducers.stats()


def _record_event_devices(cupy_module: ModuleType) -> None:
    from . import _events
    _events.record_devices(cupy_module)


_registry.register_lazy("cupy", _install_cupy)
if "cupy" not in sys.modules:  # else installed (and its events recorded) just now
    # right after `import cupy`, before any event can be made; the adapter itself is
    # installed later, before the channels next pickle
    _registry.after_import("cupy", _record_event_devices)
_registry.register_lane_kind(b"\0V", _lane_loads)  # _vmm.LANE
_registry.register_lane_kind(b"\0I", _ipc_lane)  # _ipc.LANE
_registry.register_held_kind(b"\0I", _ipc_held_attach, _ipc_held_load)
_registry.register_stats(_stats)


def device_count() -> int:
    """GPUs this process can see: never initialises CUDA (see ``cuda_ipc.device_count``)."""
    return cuda_ipc.device_count()


def is_available() -> bool:
    """True when a GPU is visible and CuPy is installed (CUDA is not initialised)."""
    if device_count() == 0:
        return False
    import importlib.util
    return importlib.util.find_spec("cupy") is not None


def ipc_collect() -> int:
    """Let go of device memory this process exported and nobody holds any more."""
    cuda_ipc.check_not_bad_fork()  # before any driver call
    from . import _reducers
    return _reducers.collect()


def exports() -> list[dict[str, Any]]:
    """Device allocations this process keeps for other processes, and whether still held."""
    from . import _reducers
    return _reducers.exports()


def malloc(nbytes: int) -> Any:
    """CuPy allocator for shared device memory (VMM, outlives its producer): pass it to
    ``cupy.cuda.set_allocator`` or use :func:`set_allocator` / :func:`using_allocator`."""
    from . import _vmm
    return _vmm.malloc(nbytes)


def set_allocator() -> None:
    """Make every CuPy allocation in this process shared device memory (see :func:`malloc`)."""
    from . import _vmm
    _device.cupy().cuda.set_allocator(_vmm.malloc)  # what malloc calls, one call fewer


def using_allocator() -> AbstractContextManager[None]:
    """Context manager: CuPy allocations on this thread are shared device memory inside."""
    from . import _vmm
    return cast("AbstractContextManager[None]", _device.cupy().cuda.using_allocator(_vmm.malloc))


def _make(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with using_allocator():
        return fn(*args, **kwargs)


def empty(shape: int | tuple[int, ...], dtype: DTypeLike = float,
          order: Literal["C", "F"] = "C") -> Any:
    """An uninitialised CuPy array in shared device memory (current device)."""
    return _make(_device.cupy().empty, shape, dtype, order)


def zeros(shape: int | tuple[int, ...], dtype: DTypeLike = float,
          order: Literal["C", "F"] = "C") -> Any:
    """A CuPy array of zeros in shared device memory (current device)."""
    return _make(_device.cupy().zeros, shape, dtype, order)


def ones(shape: int | tuple[int, ...], dtype: DTypeLike = float,
         order: Literal["C", "F"] = "C") -> Any:
    """A CuPy array of ones in shared device memory (current device); see :func:`empty`."""
    return _make(_device.cupy().ones, shape, dtype, order)


def full(shape: int | tuple[int, ...], fill_value: object, dtype: DTypeLike | None = None,
         order: Literal["C", "F"] = "C") -> Any:
    """A CuPy array filled with ``fill_value`` in shared device memory (current device)."""
    return _make(_device.cupy().full, shape, fill_value, dtype, order)


def empty_like(a: Any, dtype: DTypeLike | None = None, order: Literal["C", "F", "A", "K"] = "K",
               shape: int | tuple[int, ...] | None = None) -> Any:
    """An uninitialised CuPy array like ``a`` (as :func:`cupy.empty_like`) in shared device
    memory."""
    return _make(_device.cupy().empty_like, a, dtype, order, shape=shape)


def zeros_like(a: Any, dtype: DTypeLike | None = None, order: Literal["C", "F", "A", "K"] = "K",
               shape: int | tuple[int, ...] | None = None) -> Any:
    """A CuPy array of zeros like ``a`` (as :func:`cupy.zeros_like`) in shared device
    memory."""
    return _make(_device.cupy().zeros_like, a, dtype, order, shape=shape)
