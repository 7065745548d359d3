"""Which types shmtensor's channels reduce themselves, registered by the code that owns them.

The core registers numpy's reducers; the CUDA adapter (:mod:`shmtensor.cuda`) and other
adapters register theirs here, as torch's ``init_reductions`` registers its own, so the core
never imports them.  A library that may not be imported yet (CuPy, torch) is registered
lazily: :func:`register_lazy` names its top-level module and an installer, which runs the
first time the channels pickle after that module was imported (it must not be imported just
to find out).  Every registration bumps :data:`version`, which the picklers compare to
rebuild their dispatch tables.  One lock guards all of it; installers run outside it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

_lock = threading.Lock()
_reducers: dict[type, Callable] = {}           # type -> reduce(obj) -> (fn, args)
_lanes: dict[type, Callable] = {}              # type -> dumps(obj) -> (payload, ctx) | None
_lane_kinds: dict[bytes, Callable] = {}        # 2-byte message kind -> loads(data, fds)
_lazy: dict[str, list[Callable[[], None]]] = {}  # top-level module -> installers to run
_stats: list[Callable[[], dict]] = []          # debug_info() counters of adapters
version = 0


def register(cls: type, reduce: Callable, lane: Callable | None = None) -> None:
    """Pickle instances of exactly ``cls`` with ``reduce`` on shmtensor's channels; a
    ``lane`` sends a message that is one such object without a pickler (it returns
    ``(payload, SendContext)``, or None to take the pickler)."""
    global version
    with _lock:
        _reducers[cls] = reduce
        if lane is not None:
            _lanes[cls] = lane
        version += 1


def register_lane_kind(kind: bytes, loads: Callable) -> None:
    """Messages whose payload starts with ``kind`` (two bytes, the first 0) are loaded by
    ``loads(data, fds)``, which closes every fd it does not keep."""
    if len(kind) != 2 or kind[0] != 0:
        raise ValueError(f"a lane kind is two bytes starting with 0, not {kind!r}")
    with _lock:
        if _lane_kinds.get(kind, loads) is not loads:
            raise ValueError(f"lane kind {kind!r} is registered already")
        _lane_kinds[kind] = loads


def register_lazy(module: str, install: Callable[[], None]) -> None:
    """Call ``install()`` (which registers reducers) once ``module`` has been imported by
    someone: at once if it is imported already, else before the channels next pickle."""
    global version
    if sys.modules.get(module) is not None:  # imported already: install now
        install()
        return
    with _lock:
        _lazy.setdefault(module, []).append(install)
        version += 1


def register_stats(fn: Callable[[], dict]) -> None:
    """Add ``fn()``'s counters to :func:`shmtensor.debug_info`."""
    with _lock:
        _stats.append(fn)


def install_pending() -> None:
    """Run the installers of lazily registered modules that have been imported since."""
    global version
    modules = sys.modules
    # a module blocked with sys.modules[name] = None is not imported
    if not _lazy or not any(modules.get(m) is not None for m in _lazy):  # the common case
        return
    with _lock:
        ready = [m for m in _lazy if modules.get(m) is not None]
        installers = [fn for m in ready for fn in _lazy.pop(m)]
        if installers:
            version += 1
    for fn in installers:
        fn()


def tables() -> tuple[dict, dict]:
    """Copies of the reducers and the lanes, for a pickler's dispatch table."""
    with _lock:
        return dict(_reducers), dict(_lanes)


def lane_loader(kind: bytes) -> Callable | None:
    return _lane_kinds.get(kind)


def stats() -> dict:
    out: dict = {}
    for fn in list(_stats):
        out.update(fn())
    return out
