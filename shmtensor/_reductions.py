"""How a message is pickled for shmtensor's channels, and loaded.

Only shmtensor's channels pickle with :class:`_Pickler`: the reducers registered in
:mod:`shmtensor._registry` ahead of multiprocessing's and copyreg's.  numpy's arrays and
the segments under them are one such adapter (:mod:`shmtensor._numpy`), installed once
numpy is imported; CuPy's and torch's are others.  Functions and classes go by name, as
the stdlib sends them, and by value (cloudpickle) only when that fails.  A process that
never handles an array or a lambda imports neither numpy nor cloudpickle (a spawned worker
that does trivial work imports what the stdlib's does, and shmtensor's channels).
"""

from __future__ import annotations

import copyreg
import errno
import importlib
import io
import pickle
import sys
import types
import weakref
from collections import ChainMap
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from shmtensor.ipc import scm_rights

from . import _log, _registry, _wire
from ._wire import RecvContext
from ._wire import SendContext as SendContext  # re-exported: the channels annotate with it

if TYPE_CHECKING:
    from multiprocessing.reduction import ForkingPickler as _StdForkingPickler
    from typing import Protocol

    from ._registry import Lane, LaneLoads
    from ._wire import Payload

    class ForkingPickler(_StdForkingPickler):
        # the stdlib's class-level reducer table, which typeshed leaves out
        _extra_reducers: ClassVar[dict[type, Callable[[Any], Any]]]

    class _ExceptionWithTraceback(Protocol):
        """``multiprocessing.pool.ExceptionWithTraceback``, which typeshed leaves out."""
        exc: BaseException
        tb: str
else:
    from multiprocessing.reduction import ForkingPickler

# A message that is one numpy array goes without a pickler (``_numpy.lane_dumps``): one of
# these kinds (a shared array, a plain one), then the array's fields.
NUMPY_LANE = b"\0N"
PLAIN_LANE = b"\0P"


def _install_numpy() -> None:
    """numpy was imported: its arrays (and the segments under them) cross by its adapter."""
    importlib.import_module("._numpy", __package__)  # whose import registers its reducers


def _install_pool() -> None:
    """multiprocessing.pool was imported: a pool worker's exception crosses as itself."""
    # a private name of the stdlib's pool, which typeshed leaves out
    from multiprocessing.pool import ExceptionWithTraceback  # type: ignore[attr-defined]
    _registry.register(ExceptionWithTraceback, _reduce_exception_with_traceback)


def _reduce_exception_with_traceback(
        e: _ExceptionWithTraceback) -> tuple[Callable[..., BaseException], tuple[object, ...]]:
    """A pool worker's exception: itself when the caller can rebuild it, else a stand-in."""
    import cloudpickle
    # a private name of the stdlib's pool, which typeshed leaves out
    from multiprocessing.pool import rebuild_exc  # type: ignore[attr-defined]
    exc = e.exc
    try:
        pickle.loads(cloudpickle.dumps(exc))
    except Exception:
        exc = RemoteError(f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc))
    return rebuild_exc, (exc, e.tb)


class RemoteError(Exception):
    """Stands in for a pool worker's exception whose type cannot be rebuilt in the caller
    (its class takes other ``__init__`` arguments than it gives ``Exception``, or is not
    importable there).  The worker's traceback is its ``__cause__``, as for any exception
    a pool re-raises.

    :ivar type_name: the original exception's ``module.QualifiedName``.
    :ivar message: its ``str()``."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(type_name, message)
        self.type_name, self.message = type_name, message

    def __str__(self) -> str:
        return (f"{self.type_name}: {self.message} (the exception could not be rebuilt here: "
                "make its class picklable, e.g. pass every __init__ argument to "
                "super().__init__)")


_registry.register_lazy("numpy", _install_numpy)
_registry.register_lazy("multiprocessing.pool", _install_pool)


class _Table(dict[type, Callable[[Any], Any]]):
    """A pickler's dispatch table.  pickle looks a reducer up by the object's exact type;
    on a miss this finds the one an adapter registered for a base of the type
    (``_registry.subclass_reducer``), once per type: the types it finds none for are
    remembered (weakly: a class made at run time still dies)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.plain: weakref.WeakSet[type] = weakref.WeakSet()

    def __missing__(self, t: type) -> Callable[[Any], Any]:
        if t in self.plain or not isinstance(t, type):
            raise KeyError(t)
        reduce = _registry.subclass_reducer(t)
        if reduce is None:
            self.plain.add(t)
            raise KeyError(t)
        self[t] = reduce
        return reduce


class _Pickler(pickle.Pickler):
    """The fast pickler: the registered reducers (:mod:`shmtensor._registry`) ahead of
    multiprocessing's and copyreg's, in one plain dict (rebuilt when a reducer is registered
    anywhere, or a lazily registered library such as CuPy is imported)."""

    dispatch_table: dict[type, Callable[[Any], Any]] = {}
    # type -> f(obj): (payload, SendContext) without a pickler, or None
    lanes: dict[type, Lane] = {}
    _signature: tuple[int, ...] = ()

    @classmethod
    def refresh(cls) -> None:
        _registry.install_pending()
        sig = (len(copyreg.dispatch_table), len(ForkingPickler._extra_reducers),
               _registry.version)
        if sig != cls._signature:
            reducers, lanes = _registry.tables()
            table = _Table(copyreg.dispatch_table)
            table.update(ForkingPickler._extra_reducers)
            table.update(reducers)
            cls.lanes = lanes
            # the C pickler reads the table when a pickler is made: a class attribute
            cls.dispatch_table, cls._signature = table, sig


# the by-value pickler class, made by the first message that needs it
_CloudPickler: type[Any] | None = None


def _cloud_pickler() -> type[pickle.Pickler]:
    """The fallback pickler: the same reducers, and functions or classes that cannot be
    imported by name (lambdas, closures, those of a ``__main__`` without a main file) travel
    by value (cloudpickle, imported by the first message that needs it).  What a by-value
    function names in ``__main__`` still goes by name where the fast pickler would send it
    so: the receiver's own function or class, with its globals and identity (cloudpickle
    sends all of ``__main__`` by value)."""
    global _CloudPickler
    import cloudpickle
    if _CloudPickler is None:
        class CloudPickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle: untyped
            # the fast pickler's table this one's is made from
            table: dict[type, Callable[[Any], Any]] = {}

            def reducer_override(self, obj: object) -> object:
                t = type(obj)
                if (t is types.FunctionType or issubclass(t, type)) and _named_in_main(obj):
                    return NotImplemented  # pickle's save_global: by name, as the stdlib does
                return super().reducer_override(obj)

        _CloudPickler = CloudPickler
    table = _Pickler.dispatch_table
    if _CloudPickler.table is not table:
        # the C pickler reads the table when a pickler is made: a class attribute
        _CloudPickler.dispatch_table = ChainMap(table, cloudpickle.Pickler.dispatch_table)
        _CloudPickler.table = table
    return _CloudPickler


# the __main__ module last looked at, and the verdict
_main_seen: tuple[types.ModuleType | None, bool] = (None, False)


def _main_by_reference() -> bool:
    """Whether ``__main__``'s functions and classes go by name, as the stdlib sends them:
    when the main module is a file.  A child started by spawn or forkserver then imports it
    again (as ``__mp_main__``, which multiprocessing aliases to ``__main__``), and a forked
    child has it.  A session without a main file (``python -c``, a REPL, a notebook) has
    nothing a spawned child could import: its functions and classes travel by value."""
    global _main_seen
    main, ok = _main_seen
    if sys.modules.get("__main__") is not main:
        main = sys.modules.get("__main__")
        ok = getattr(main, "__file__", None) is not None
        _main_seen = (main, ok)
    return ok


def _named_in_main(obj: object) -> bool:
    """``obj`` (a function or class) is ``__main__``'s, found there by its name, and
    ``__main__`` goes by name (:func:`_main_by_reference`)."""
    qualname = getattr(obj, "__qualname__", None)
    if (getattr(obj, "__module__", None) != "__main__" or not isinstance(qualname, str)
            or not _main_by_reference()):
        return False
    found: object = sys.modules["__main__"]
    for part in qualname.split("."):  # '<locals>' is never found
        found = getattr(found, part, None)
    return found is obj


def _dump(pickler_cls: type[pickle.Pickler], obj: object) -> tuple[bytes, SendContext]:
    ctx = SendContext()
    prev = getattr(_wire.current, "send", None)
    try:  # set inside: an exception (a signal handler's) at any step leaves it as it was
        _wire.current.send = ctx
        buf = io.BytesIO()
        pickler_cls(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    except BaseException:
        ctx.release()
        raise
    finally:
        _wire.current.send = prev
    # bytes, not getbuffer()'s view (no copy either way): CPython 3.12.0-3.12.1's GC
    # crashes on a BytesIO view in a reference cycle (gh-111049), as a kept error makes
    return buf.getvalue(), ctx


_SCAN_MAIN_UPTO = 1 << 16  # larger messages are data; a function in one is sent by name
# what the fast pickler raises for what it cannot pickle by name (a lambda: PicklingError;
# a local function: AttributeError; a lock: TypeError)
_BY_NAME_ERRORS = (pickle.PicklingError, AttributeError, TypeError)


def dumps(obj: object, undo: Callable[[], object] | None = None) -> tuple[bytes, SendContext]:
    """Pickle ``obj`` for a shmtensor channel: the bytes and what must travel with them.

    By reference first, as the stdlib pickles (the fast pickler); by value (cloudpickle)
    only when that fails (a lambda, a closure) or when the message names a ``__main__``
    without a main file, which a spawned child cannot import (see
    :func:`_main_by_reference`; messages over 64 KiB are not searched for it).  When both
    fail, the first error is raised, as the stdlib would raise it.

    ``undo`` is for a message pickled with side effects outside itself (a spawned
    Process's arguments register their fds with the stdlib's popen as they are pickled):
    it is called before a second try, so nothing is registered twice, and the whole
    message is searched for ``__main__``."""
    lane = _Pickler.lanes.get(type(obj))
    if lane is None:  # none, or not yet: refresh() finds the lanes (CuPy's once imported)
        _Pickler.refresh()
        lane = _Pickler.lanes.get(type(obj))
    if lane is not None:
        out = lane(obj)
        if out is not None:
            return out
        _Pickler.refresh()
    try:
        data, ctx = _dump(_Pickler, obj)
    except _BY_NAME_ERRORS as e:
        return _dump_by_value(obj, undo, e)
    if _main_by_reference() or (undo is None and len(data) > _SCAN_MAIN_UPTO) or (
            b"__main__" not in data):
        return data, ctx
    ctx.release()
    return _dump_by_value(obj, undo, None)


def _dump_by_value(obj: object, undo: Callable[[], object] | None,
                   first: BaseException | None) -> tuple[bytes, SendContext]:
    """The second try, after ``first`` (the fast pickler's error, if it failed)."""
    if undo is not None:
        undo()
    try:
        out = _dump(_cloud_pickler(), obj)
    except Exception as e:
        if first is None:
            raise
        if hasattr(first, "add_note"):  # Python 3.11+
            first.add_note(f"(shmtensor also tried to pickle it by value, with cloudpickle: "
                           f"{type(e).__name__}: {e})")
        raise first from None
    _log.once("cloudpickle", _log.INFO,
              "shmtensor: a message was pickled by value with cloudpickle (%s). Functions "
              "and classes that can be imported by name (module-level, in a main file) go by "
              "name, as the stdlib sends them, and faster. (Reported once per process.)",
              "its main module has no file, which a spawned child could not import"
              if first is None else f"{type(first).__name__}: {first}")
    return out


_RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOLCK)


def loads(data: Payload, fds: list[int], private: bool = False) -> Any:
    """Unpickle a message from a shmtensor channel; closes every fd it did not keep.  A
    message that cannot be loaded for want of an fd or a lock is lost (it was read off the
    channel), and the error says so.  ``private``: see ``_rebuild_array``."""
    try:
        return _loads(data, fds, private)
    except OSError as e:
        if e.errno not in _RESOURCE_ERRNOS:
            raise
        raise OSError(e.errno, f"{e.strerror}; the message was received and discarded") from e


def _loads(data: Payload, fds: list[int], private: bool = False) -> Any:
    if data and data[0] == 0:  # a lane: pickle data starts with PROTO (0x80)
        return _lane_loads(data, fds)
    if not fds:
        return pickle.loads(data)
    ctx = RecvContext(fds, private)
    prev = getattr(_wire.current, "recv", None)
    loaded = False
    try:  # from the context's first use: its fds are closed however the load ends
        _wire.current.recv = ctx
        obj = pickle.loads(data)
        loaded = True
        return obj
    finally:
        _wire.current.recv = prev
        try:
            if ctx.deferred:
                ctx.establish(loaded)
        finally:
            scm_rights.close_fds(fds)


def _lane_loads(data: Payload, fds: list[int]) -> object:
    """A message sent without a pickler (see ``_Pickler.lanes``): one object, loaded by the
    lane kind's registered loader."""
    kind = bytes(data[:2])
    if kind == NUMPY_LANE or kind == PLAIN_LANE:
        return (_numpy_lane or _numpy_lane_loads)(data, fds)
    loader = _registry.lane_loader(kind)
    if loader is None:
        scm_rights.close_fds(fds)
        raise pickle.UnpicklingError(f"unknown message kind {kind!r}: the sender runs another "
                                     "shmtensor version, or an adapter this process lacks")
    return loader(data, fds)


# _numpy.lane_loads, once the first numpy lane message imported it
_numpy_lane: LaneLoads | None = None


def _numpy_lane_loads(data: Payload, fds: list[int]) -> object:
    """A numpy lane message: numpy's adapter loads it (imported by the first one)."""
    global _numpy_lane
    from ._numpy import lane_loads as _numpy_lane
    return _numpy_lane(data, fds)  # type: ignore[misc]  # bound by the import above


def held_attach(data: Payload, seg_fd: Callable[[], int],
                lease: Callable[[], int]) -> tuple[Any, Any, Callable[[Any, Any], Any]]:
    """A one-array message that came without fds (its reader had them: see
    ``_channel.Channel.post``): its memory, attached and held here, what its adapter makes
    the array of, and the adapter's ``load(memory, view)`` that makes it.  Run under the
    channel's readers' lock, before the message leaves the channel."""
    attach, load = _held_pair(data)
    memory, view = attach(data, seg_fd, lease)
    return memory, view, load


def _held_pair(data: Payload) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The adapter's (attach, load) of a lane message that came without fds."""
    if data[:2] == NUMPY_LANE:
        if not _held:
            from ._numpy import held_attach as attach, held_load as load
            _held.append((attach, load))
        return _held[0]
    kind = bytes(data[:2])
    pair = _registry.held_kind(kind)
    if pair is None:
        raise pickle.UnpicklingError(f"a message of kind {kind!r} came without fds, which "
                                     "no adapter of this process loads")
    return pair


# numpy's adapter's held_attach and held_load, once the first such message imported it
_held: list[tuple[Callable[..., Any], Callable[..., Any]]] = []
