"""Which types shmtensor's channels reduce themselves, registered by the code that owns them.

The core registers numpy's reducers; the CUDA adapter (:mod:`shmtensor.cuda`) and other
adapters register theirs here, as torch's ``init_reductions`` registers its own, so the core
never imports them.  A library that may not be imported yet (CuPy, torch) is registered
lazily: :func:`register_lazy` names its top-level module and an installer, which runs the
first time the channels pickle after that module was imported (it must not be imported just
to find out).  Every registration bumps :data:`version`, which the picklers compare to
rebuild their dispatch tables.  One lock guards all of it; installers run outside it.

Adapters are installed in isolation: an installer that raises (a module named ``cupy`` that
is not CuPy, a broken install) is reported once, as a warning of the ``shmtensor`` logger,
and disabled: what it registered is taken back and it never runs again, while numpy and the
other adapters keep working.
"""

from __future__ import annotations

import pickle
import sys
import threading
from collections.abc import Callable, Sequence
from functools import partial
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec
    from typing import TypeAlias

    from ._wire import Payload, SendContext

    # reduce(obj): a __reduce__ value, (rebuild, args) and optionally state and the rest
    Reduce: TypeAlias = Callable[[Any], tuple[Any, ...]]
    # lane(obj): the message (payload and what travels with it) without a pickler, or None
    Lane: TypeAlias = Callable[[Any], tuple[bytes, SendContext] | None]
    # loads(data, fds): the object of a lane message; closes every fd it does not keep
    LaneLoads: TypeAlias = Callable[[Payload, list[int]], object]
    # attach(data, memory_fd, lease): a lane message that came without fds, its memory
    # held here: (what holds it, what load needs); load(held, view): its object
    HeldAttach: TypeAlias = Callable[[Payload, Callable[[], int], Callable[[], int]],
                                     tuple[Any, Any]]
    HeldLoad: TypeAlias = Callable[[Any, Any], object]
    Stats: TypeAlias = Callable[[], dict[str, int]]  # an adapter's debug_info() counters
    # view(obj, cls): obj's memory as an instance of cls (a base or a subclass of obj's type)
    View: TypeAlias = Callable[[Any, type], Any]

_lock = threading.Lock()
_reducers: dict[type, Reduce] = {}             # type -> reduce(obj) -> (fn, args)
_lanes: dict[type, Lane] = {}                  # type -> dumps(obj) -> (payload, ctx) | None
_views: dict[type, View] = {}                  # type -> view(obj, cls), for its subclasses
_lane_kinds: dict[bytes, LaneLoads] = {}       # 2-byte message kind -> loads(data, fds)
_held_kinds: dict[bytes, tuple[HeldAttach, HeldLoad]] = {}  # the same, sent without fds
_lazy: dict[str, list[Callable[[], None]]] = {}  # top-level module -> installers to run
_stats: list[Stats] = []                       # debug_info() counters of adapters
_on_import: dict[str, list[Callable[[ModuleType], None]]] = {}  # module -> after_import hooks
_installing = threading.local()  # .added: what the installer running in this thread registered
version = 0


def _record(table: dict[Any, Any], key: object) -> None:
    """Note that the installer running in this thread (if any) registered ``table[key]``."""
    added = getattr(_installing, "added", None)
    if added is not None:
        added.append((table, key, table[key]))


def register(cls: type, reduce: Reduce, lane: Lane | None = None,
             view: View | None = None) -> None:
    """Pickle instances of ``cls`` with ``reduce`` on shmtensor's channels; a ``lane``
    sends a message that is one such object without a pickler (it returns
    ``(payload, SendContext)``, or None to take the pickler).

    ``view(obj, c)`` (a module-level function: receivers import it by name) gives ``obj``'s
    memory as an instance of ``c``.  With it, a subclass of ``cls`` that keeps ``cls``'s
    own pickling (no ``__reduce__``/``__reduce_ex__`` of its own: ``numpy.memmap``,
    ``numpy.matrix``, a user's ``ndarray`` subclass) is sent as ``cls`` and rebuilt as
    itself, as the stdlib's pickle rebuilds it; without it, only ``cls`` itself."""
    global version
    with _lock:
        _reducers[cls] = reduce
        _record(_reducers, cls)
        if lane is not None:
            _lanes[cls] = lane
            _record(_lanes, cls)
        if view is not None:
            _views[cls] = view
            _record(_views, cls)
        version += 1


def subclass_reducer(t: type) -> Reduce | None:
    """The reducer for instances of ``t``, a type not registered itself: that of its
    nearest registered base, when that base has a ``view`` and ``t`` keeps its pickling;
    else None (pickle's own way: ``t``'s ``__reduce_ex__``)."""
    with _lock:
        base = next((b for b in t.__mro__[1:] if b in _reducers), None)
        if base is None or base not in _views:
            return None
        reduce, view = _reducers[base], _views[base]
    if (getattr(t, "__reduce_ex__", None) is not getattr(base, "__reduce_ex__", None)
            or getattr(t, "__reduce__", None) is not getattr(base, "__reduce__", None)):
        return None
    return partial(_reduce_as, reduce, view, base, t)


def _reduce_as(reduce: Reduce, view: View, base: type, cls: type, obj: object
               ) -> tuple[Any, ...]:
    rv = reduce(view(obj, base))
    if len(rv) > 3:  # items to append or set: not an array's; the subclass's own pickling
        return cast("tuple[Any, ...]", obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL))
    return rebuild_as, (view, cls) + tuple(rv)


def rebuild_as(view: View, cls: type, fn: Callable[..., Any], args: tuple[Any, ...],
               state: object = None) -> Any:
    """What ``(fn, args, state)`` rebuilds (as pickle does), as an instance of ``cls``."""
    obj = fn(*args)
    if state is not None:
        obj.__setstate__(state)
    return view(obj, cls)


def register_lane_kind(kind: bytes, loads: LaneLoads) -> None:
    """Messages whose payload starts with ``kind`` (two bytes, the first 0) are loaded by
    ``loads(data, fds)``, which closes every fd it does not keep."""
    if len(kind) != 2 or kind[0] != 0:
        raise ValueError(f"a lane kind is two bytes starting with 0, not {kind!r}")
    with _lock:
        if _lane_kinds.get(kind, loads) is not loads:
            raise ValueError(f"lane kind {kind!r} is registered already")
        _lane_kinds[kind] = loads
        _record(_lane_kinds, kind)


def register_held_kind(kind: bytes, attach: HeldAttach, load: HeldLoad) -> None:
    """Lane messages of ``kind`` (see :func:`register_lane_kind`) may come without fds
    (``_channel.Channel.post``, for a ``SendContext.handle``): ``attach(data, memory_fd,
    lease)`` attaches and holds their memory as the channel takes the record (``memory_fd()``
    and ``lease()`` give the memory's memfd and a description of its lease file, asked for
    only where this process lacks them), and ``load(held, view)`` makes the object of what
    it returned."""
    if len(kind) != 2 or kind[0] != 0:
        raise ValueError(f"a lane kind is two bytes starting with 0, not {kind!r}")
    with _lock:
        if _held_kinds.get(kind, (attach, load)) != (attach, load):
            raise ValueError(f"held kind {kind!r} is registered already")
        _held_kinds[kind] = (attach, load)
        _record(_held_kinds, kind)


def register_lazy(module: str, install: Callable[[], None]) -> None:
    """Call ``install()`` (which registers reducers) once ``module`` has been imported by
    someone: at once if it is imported already, else before the channels next pickle."""
    global version
    if sys.modules.get(module) is not None:  # imported already: install now
        _install(module, install)
        return
    with _lock:
        _lazy.setdefault(module, []).append(install)
        version += 1


def after_import(module: str, hook: Callable[[ModuleType], None]) -> None:
    """Call ``hook(module)`` right after ``import module`` has run, before any code can use
    the module (CuPy's events must learn their device before one is made): at once when it
    is imported already.  One meta path finder serves every hook; a mere lookup
    (``importlib.util.find_spec``) runs nothing and keeps the hooks."""
    if sys.modules.get(module) is not None:
        hook(sys.modules[module])
        return
    with _lock:
        _on_import.setdefault(module, []).append(hook)
        if not any(isinstance(f, _ImportHook) for f in sys.meta_path):
            sys.meta_path.insert(0, _ImportHook())


class _ImportHook:
    """The meta path finder of :func:`after_import`.  It finds nothing itself: it wraps the
    loader of the spec that the finders after it give for a watched module, and leaves
    ``sys.meta_path`` once no module is watched."""

    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if name not in _on_import:
            return None
        try:
            later = sys.meta_path[sys.meta_path.index(self) + 1:]
        except ValueError:  # left meanwhile
            return None
        for finder in later:
            find = getattr(finder, "find_spec", None)
            spec: ModuleSpec | None = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        exec_module = getattr(spec.loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_module_then_hooks(module: ModuleType) -> None:
            exec_module(module)
            with _lock:
                hooks = _on_import.pop(name, [])
                if not _on_import and self in sys.meta_path:
                    sys.meta_path.remove(self)
            for hook in hooks:
                hook(module)

        try:  # this loader's own exec_module (found above), wrapped on the instance
            cast(Any, spec.loader).exec_module = exec_module_then_hooks
        except AttributeError:  # a loader that takes no attribute: the hooks wait
            pass
        return spec


def register_stats(fn: Stats) -> None:
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
        installers = [(m, fn) for m in ready for fn in _lazy.pop(m)]
        if installers:
            version += 1
    for module, fn in installers:
        _install(module, fn)


def _install(module: str, install: Callable[[], None]) -> None:
    """Run one adapter's installer in isolation: if it raises, take back what it registered
    and report it once (see the module docs); the caller goes on as if it had none."""
    global version
    outer = getattr(_installing, "added", None)  # an installer may install another first
    added: list[tuple[dict[Any, Any], object, object]]  # (table, key, value) it registered
    _installing.added = added = []
    try:
        install()
    except Exception as e:
        with _lock:
            for table, key, value in added:
                if table.get(key) is value:
                    del table[key]
            version += 1
        _report_failed(module, install, e)
    finally:
        _installing.added = outer


def _report_failed(module: str, install: Callable[[], None], error: Exception) -> None:
    import logging
    where = getattr(sys.modules.get(module), "__file__", None) or "an unknown location"
    logging.getLogger("shmtensor").warning(
        "shmtensor: the adapter for %s (%s.%s) failed and is disabled: %s: %s. The %s "
        "imported from %s is not a working install: repair or reinstall it, or rename what "
        "shadows it on sys.path. Its objects now cross shmtensor's channels as ordinary "
        "pickles; numpy arrays and other adapters are not affected.",
        module, install.__module__, install.__qualname__, type(error).__name__, error,
        module, where)


def tables() -> tuple[dict[type, Reduce], dict[type, Lane]]:
    """Copies of the reducers and the lanes, for a pickler's dispatch table."""
    with _lock:
        return dict(_reducers), dict(_lanes)


def lane_loader(kind: bytes) -> LaneLoads | None:
    return _lane_kinds.get(kind)


def held_kind(kind: bytes) -> tuple[HeldAttach, HeldLoad] | None:
    return _held_kinds.get(kind)


def stats() -> dict[str, int]:
    out: dict[str, int] = {}
    for fn in list(_stats):
        out.update(fn())
    return out
