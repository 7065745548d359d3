"""shmtensor: numpy arrays across processes through shared memory, without copies in pipes.

General layout: :mod:`ipc` is the transport (segments, fd passing, leases); this package
puts arrays on it.  Public names live here and in :mod:`shmtensor.multiprocessing`; every
``_module`` is internal.  Importing the package is cheap (the CLI and the pytest plugin
import it): numpy and the array machinery load on first use of an array name.
"""

from __future__ import annotations

import importlib as _importlib
import os as _os
from typing import TYPE_CHECKING, Any

from shmtensor.ipc import janitor as _janitor
from shmtensor.ipc import ofd_lease as _ofd_lease
from shmtensor.ipc.posix_shm import ShmSpaceError

from . import _log, _registry, _stats, _strategy
from . import cuda as _cuda  # noqa: F401 (registers CuPy's reducers, for when CuPy is imported)
from . import _torch  # noqa: F401 (registers torch's reducers, for when torch is imported)
from ._strategy import (get_all_sharing_strategies, get_inline_threshold, get_receive_spin,
                        get_sharing_strategy, set_inline_threshold, set_receive_spin,
                        set_sharing_strategy)

__version__ = "0.1.0"
__all__ = ["empty", "zeros", "ones", "full", "empty_like", "zeros_like", "share_memory",
           "is_shared", "set_sharing_strategy", "get_sharing_strategy",
           "get_all_sharing_strategies", "set_inline_threshold", "get_inline_threshold",
           "set_receive_spin", "get_receive_spin", "empty_cache", "debug_info", "ShmSpaceError",
           "BatchPool"]

if TYPE_CHECKING:  # a type checker sees the real signatures; at run time they load lazily
    from ._alloc import (empty, empty_like, full, is_shared, ones, share_memory, zeros,
                         zeros_like)
    from ._batch_pool import BatchPool

_LAZY = {name: "._alloc" for name in ("empty", "zeros", "ones", "full", "empty_like",
                                     "zeros_like", "share_memory", "is_shared")}
_LAZY["BatchPool"] = "._batch_pool"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shmtensor' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def empty_cache() -> int:
    """Unmap every idle segment this process keeps for reuse.

    Segments still in use (an array here, a consumer's view, a message in flight) are
    kept; shmtensor makes or maps segments again as it needs them.

    :returns: The bytes let go (of segments this process made; received ones it only unmaps)."""
    from . import _segments
    freed = _segments.empty_cache()
    _ofd_lease.forget_idle()
    return freed


def debug_info() -> dict[str, Any]:
    """This process's counters and settings, one dict per subsystem.

    * ``segments``: own segments made (``created``, ``bytes_created``), ``recycled``,
      ``destroyed``, ``slabs_started``; other processes' ``attached``, ``bytes_attached``,
      ``evicted``; live and idle ones now (``own_live``, ``own_idle``, ``attached_live``,
      ``attached_idle``) and ``bytes_mapped``.
    * ``arrays``: sent as a handle (``sent_shared``), copied into a segment to be sent
      (``sent_copied``), pickled into the message (``sent_inline``), ``received``.
    * ``leases``: lease ``tables`` this process has open.
    * ``cuda`` (and ``torch`` once torch is imported): the adapters' counters (zeros until
      CUDA is used).
    * ``settings``: ``sharing_strategy``, ``inline_threshold``, ``receive_spin_us`` (a bad
      environment variable shows as its error, as a string).
    * ``fallbacks``: the kinds of fallback this process has reported to the ``shmtensor``
      logger (an array pickled by value or copied, a function sent with cloudpickle).

    The flat names ``info["segments_created"]``, ``info["cuda_opened"]`` and so on read
    the same numbers.  Never raises.

    Example::

        >>> import shmtensor
        >>> a = shmtensor.zeros(1000)
        >>> shmtensor.debug_info()["segments"]["own_live"] >= 1
        True
    """
    from . import _log, _segments
    segs = _segments.mapped()
    own = [s for s in segs if s.own]
    flat = _stats.snapshot()
    flat["segments_own_live"] = sum(1 for s in own if s.alive())
    flat["segments_own_idle"] = len(_segments.idle_segments())
    flat["segments_attached_live"] = sum(1 for s in segs if not s.own and s.alive())
    flat["segments_attached_idle"] = sum(1 for s in segs if not s.own and not s.alive())
    flat["bytes_mapped"] = sum(s.size for s in segs)
    flat["lease_tables"] = _ofd_lease.table_count()
    flat.update(_registry.stats())  # adapters' counters: cuda_*, torch_*
    return _stats.grouped(flat, {"settings": _strategy.describe(),
                                 "fallbacks": _log.reported()})


def _after_fork_in_child() -> None:
    _stats.after_fork_in_child()
    _log.after_fork_in_child()
    _ofd_lease.after_fork_in_child()
    _janitor.after_fork_in_child()


_os.register_at_fork(before=_ofd_lease.before_fork,
                     after_in_parent=_ofd_lease.after_fork_in_parent,
                     after_in_child=_after_fork_in_child)
