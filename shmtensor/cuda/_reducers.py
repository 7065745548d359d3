"""CuPy's types on shmtensor's channels: which path an array takes, and the registration.

:func:`register` runs once CuPy has been imported (``shmtensor.cuda`` registers it lazily
with :mod:`shmtensor._registry`): arrays on shared device memory (:mod:`._vmm`) cross by
their slab's fd, others by legacy CUDA IPC (:mod:`._ipc`); a message that is one array
takes its kind's lane (no pickler); interprocess events cross by handle (:mod:`._events`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import _registry
from . import _device, _events, _ipc, _release, _vmm

if TYPE_CHECKING:
    from .._wire import LaneContext


def _owner(cp: Any, mem: Any) -> object:
    """What owns memory shmtensor handed to CuPy (a VMM block or use, a legacy IPC use), or
    None for memory of CuPy's own."""
    return getattr(mem, "_owner", None) if isinstance(mem, cp.cuda.UnownedMemory) else None


def reduce_cupy_array(arr: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    cp = _device.cupy()  # the fork error, before any driver call
    _release.poll()
    if arr.size == 0:
        return _ipc.rebuild_empty, (arr.shape, arr.dtype.str,
                                    _device.bus_id(cp, arr.device.id))
    mem = arr.data.mem
    owner = _owner(cp, mem)
    if isinstance(owner, _vmm.SHARED_OWNERS):
        return _vmm.reduce_array(cp, arr, mem, owner)
    return _ipc.reduce_array(cp, arr, mem, owner)


def lane_dumps(arr: Any) -> tuple[bytes, LaneContext] | None:
    """A message that is ``arr`` alone, without a pickler: by the VMM lane or the legacy
    IPC lane (None: the general path, which also raises what is wrong)."""
    cp = _device.cupy()  # the fork error, before any driver call
    mem = arr.data.mem
    owner = _owner(cp, mem)
    if isinstance(owner, _vmm.SHARED_OWNERS):
        return _vmm.lane_dumps(cp, arr, mem, owner)
    _release.poll()
    return _ipc.lane_dumps(cp, arr, mem, owner)


def view_as(arr: Any, cls: type) -> Any:
    """``arr``'s memory as an instance of ``cls``: how a subclass of ``cupy.ndarray`` is
    sent as one and rebuilt as itself (see ``_registry.register``)."""
    return arr.view(type=cls)


def register() -> None:
    """Register CuPy's types (CuPy is imported already: no driver call is made here, so
    importing shmtensor after CuPy leaves CUDA uninitialised and forking safe)."""
    import cupy as cp
    _registry.register(cp.ndarray, reduce_cupy_array, lane_dumps, view_as)
    _registry.register(cp.cuda.Event, _events.reduce_event)
    _events.record_devices(cp)  # done already where CuPy was imported after shmtensor


def collect() -> int:
    """Release what this process's finished device work lets go, drop exports nobody holds,
    close idle mappings.  Returns the exports and slabs given back."""
    _release.drain(block=True)
    return _ipc.collect() + _vmm.collect()


def exports() -> list[dict[str, Any]]:
    return _ipc.exports() + _vmm.exports()


def stats() -> dict[str, int]:
    out = _ipc.stats()
    out["cuda_events"] = _events.count()
    out.update(_vmm.stats())
    return out
