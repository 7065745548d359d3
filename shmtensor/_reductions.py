"""How arrays cross a process boundary on shmtensor's channels, and how they are rebuilt.

Only shmtensor's channels pickle with :class:`_Pickler`; a plain ``pickle.dumps`` of the
same array uses numpy's own reduction and gives an ordinary, self-contained pickle.

* An array whose memory is a segment crosses as a handle (segment key, offset, shape,
  strides, dtype, read-only flag): no copy, and writes are visible both ways.
* A view is sent as its root plus its place in the root, so several views of one base in
  one message arrive as views of one buffer (the pickle memo sends the root once).  A
  small view of a much larger base is compacted instead of dragging the base along.
* A root that is not shared is pickled inline when small and copied once into a recycled
  segment when large (see :mod:`shmtensor._strategy` for the threshold).
* Object arrays fall back to numpy's own reduction.

Segments themselves reduce to :func:`_rebuild_segment`; each message carries, per lease
table file, one in-flight lock description and, for memfds, the segment fds (see
:mod:`ipc.ofd_lease`).  The rebuild functions' import paths are part of the wire format.
"""

from __future__ import annotations

import copyreg
import errno
import io
import pickle
import sys
import types
from collections import ChainMap
from collections.abc import Callable
from multiprocessing.pool import ExceptionWithTraceback, rebuild_exc
from multiprocessing.reduction import ForkingPickler

import cloudpickle
import numpy as np

from shmtensor.ipc import scm_rights

from . import _registry, _segments, _stats, _strategy, _wire
from ._segments import FD, Segment
from ._wire import (LaneContext, RecvContext, SendContext, attach_fd, inflight_index,
                    keep_alive, received_fd, received_lease, take_received_fd)



def _dt(dt: np.dtype):
    return dt.str if dt.fields is None and dt.subdtype is None and not dt.metadata else dt


def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _reduce_ndarray(a: np.ndarray):
    if a.dtype.hasobject:
        return a.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    seg = _segments.segment_of(a)
    if seg is not None and (seg.kind != FD or seg.fd is not None):
        _stats.bump("arrays_sent_shared")
        return _reduce_on(a, seg, not a.flags.writeable)
    base = a.base
    if isinstance(base, np.ndarray) and seg is None:
        root = base
        while isinstance(root.base, np.ndarray):
            root = root.base
        if ((root.flags.c_contiguous or root.flags.f_contiguous) and root.dtype.hasobject is False
                and root.nbytes <= max(2 * a.nbytes, _strategy.get_inline_threshold())):
            return _rebuild_view, (root, _ptr(a) - _ptr(root), a.shape, a.strides, _dt(a.dtype),
                                   not a.flags.writeable)
    return _reduce_root(a)


def _reduce_root(a: np.ndarray):
    """An array sent by value: inline when small, else copied once into a segment."""
    if a.nbytes < _strategy.get_inline_threshold():
        _stats.bump("arrays_sent_inline")
        # numpy 2.4 pickles a strided array with its bytes but loses a non-native byte
        # order on the way ('>i4' arrives as int32): a contiguous copy keeps it, and
        # costs little under the inline threshold.
        src = a if a.flags.c_contiguous or a.flags.f_contiguous else np.ascontiguousarray(a)
        rv = src.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return rv if a.flags.writeable else (_rebuild_readonly, rv[:3])
    kind = _strategy.get_sharing_strategy()
    if a.nbytes <= _segments.SLAB_ITEM_MAX:
        anchor, offset = _segments.carve(a.nbytes, kind)
    else:
        _, anchor = _segments.acquire(a.nbytes, kind)
        offset = 0
    # Anchored until the message is sent: a segment nobody holds could be handed to another
    # thread's send and overwritten before this message's in-flight lock covers it.
    keep_alive(anchor)
    order = "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"
    dst = np.ndarray(a.shape, a.dtype, buffer=anchor, offset=offset, order=order)
    np.copyto(dst, a, casting="no")
    _stats.bump("arrays_sent_copied")
    return _reduce_on(dst, _segments.segment_of(anchor), not a.flags.writeable, True)


def _reduce_on(a: np.ndarray, seg: Segment, readonly: bool, copied: bool = False):
    """``copied``: ``a`` is a copy made only to send a plain array (see _rebuild_array)."""
    args = (seg, _ptr(a) - seg.address, a.shape, a.strides, _dt(a.dtype), readonly)
    return _rebuild_array, (args + (True,) if copied else args)


# A message that is one shared array (its memory a segment that can travel) goes without a
# pickler: NUMPY_LANE and a plain pickle of the segment's and the view's fields, and its
# fds (the segment's memfd, if it is one, then the in-flight description of its lease,
# which the receiver keeps as its hold).  Anything else takes the pickler.
NUMPY_LANE = b"\0N"


def _numpy_lane_dumps(a: np.ndarray):
    """``a`` alone as a message ``(payload, LaneContext)``, or None when it is not shared."""
    seg = _segments.segment_of(a)
    if seg is None or (seg.kind == FD and seg.fd is None) or a.dtype.hasobject:
        return None
    anchor = seg.anchor()  # kept until sent: keeps the segment (and its memfd) here
    # strides None: C-contiguous, not empty, with no axis of length 1 (the flag ignores
    # the strides of those), so the receiver's ndarray computes the very same strides,
    # which is faster than checking given ones
    shape = a.shape
    fields = (seg.key, seg.kind, seg.size, seg.table_id, seg.slot, _ptr(a) - seg.address,
              shape, None if a.flags.c_contiguous and a.size and 1 not in shape else a.strides,
              _dt(a.dtype), not a.flags.writeable)
    _stats.bump("arrays_sent_shared")
    return (NUMPY_LANE + pickle.dumps(fields, pickle.HIGHEST_PROTOCOL),
            LaneContext(anchor, seg.fd if seg.kind == FD else None, seg.table_id, seg.slot))


_dtypes: dict = {}  # dtype strings of lane messages -> numpy dtypes (a few, never evicted)


def _numpy_lane_loads(data, fds: list[int]):
    """The array of a :func:`_numpy_lane_dumps` message; closes every fd it does not keep.
    The message's in-flight description covers this one slot, so it may itself become the
    hold (``_segments.receive_sole``), with nothing deferred."""
    try:
        (key, kind, size, table_id, slot, offset, shape, strides, dtype,
         readonly) = pickle.loads(memoryview(data)[len(NUMPY_LANE):])
        if len(fds) != (2 if kind == FD else 1):
            raise pickle.UnpicklingError(f"a shared array came with {len(fds)} fds")
        anchor, took, kept = _segments.receive_sole(key, kind, size, table_id, slot,
                                                    fds[0] if kind == FD else None, fds[-1])
        if took:
            fds[0] = -1
        if kept:
            fds[-1] = -1
        dt = _dtypes.get(dtype) if type(dtype) is str else None
        if dt is None:
            dt = np.dtype(dtype)
            if type(dtype) is str and len(_dtypes) < 256:
                _dtypes[dtype] = dt
        return _rebuild_array(anchor, offset, shape, strides, dt, readonly)
    finally:
        scm_rights.close_fds(fds)


def _reduce_segment(seg: Segment):
    ctx = _wire.send_context()
    ctx.keep.append(seg.anchor())
    i = inflight_index(seg.table_id, seg.slot)
    d = attach_fd(seg.fd) if seg.kind == FD else -1
    return _rebuild_segment, (seg.key, seg.kind, seg.size, seg.table_id, seg.slot, d, i)


def _reduce_exception_with_traceback(e: ExceptionWithTraceback):
    """A pool worker's exception: itself when the caller can rebuild it, else a stand-in."""
    exc = e.exc
    try:
        pickle.loads(cloudpickle.dumps(exc))
    except Exception:
        exc = RemoteError(f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc))
    return rebuild_exc, (exc, e.tb)


class RemoteError(Exception):
    """Stands in for a worker's exception whose type cannot be rebuilt in the caller."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(type_name, message)
        self.type_name, self.message = type_name, message

    def __str__(self) -> str:
        return (f"{self.type_name}: {self.message} (the exception could not be rebuilt here: "
                "make its class picklable, e.g. pass every __init__ argument to "
                "super().__init__)")


_registry.register(np.ndarray, _reduce_ndarray, _numpy_lane_dumps)
_registry.register(Segment, _reduce_segment)
_registry.register(ExceptionWithTraceback, _reduce_exception_with_traceback)


class _Pickler(pickle.Pickler):
    """The fast pickler: the registered reducers (:mod:`shmtensor._registry`) ahead of
    multiprocessing's and copyreg's, in one plain dict (rebuilt when a reducer is registered
    anywhere, or a lazily registered library such as CuPy is imported)."""

    dispatch_table: dict = {}
    lanes: dict = {}  # type -> f(obj): (payload, SendContext) without a pickler, or None
    _signature: tuple = ()

    @classmethod
    def refresh(cls) -> None:
        _registry.install_pending()
        sig = (len(copyreg.dispatch_table), len(ForkingPickler._extra_reducers),
               _registry.version)
        if sig != cls._signature:
            reducers, lanes = _registry.tables()
            table = dict(copyreg.dispatch_table)
            table.update(ForkingPickler._extra_reducers)
            table.update(reducers)
            cls.lanes = lanes
            cls.dispatch_table, cls._signature = table, sig
            # the C pickler reads the table when a pickler is made: a class attribute
            _CloudPickler.dispatch_table = ChainMap(table, cloudpickle.Pickler.dispatch_table)


class _CloudPickler(cloudpickle.Pickler):
    """The fallback: the same reducers, and functions or classes that cannot be imported
    by name (lambdas, closures, those of a ``__main__`` without a main file) travel by
    value (cloudpickle).  What a by-value function names in ``__main__`` still goes by
    name where the fast pickler would send it so: the receiver's own function or class,
    with its globals and identity (cloudpickle sends all of ``__main__`` by value)."""

    def reducer_override(self, obj):
        t = type(obj)
        if (t is types.FunctionType or issubclass(t, type)) and _named_in_main(obj):
            return NotImplemented  # pickle's save_global: by name, as the stdlib does
        return super().reducer_override(obj)


_main_seen: tuple = (None, False)  # the __main__ module last looked at, and the verdict


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


def _named_in_main(obj) -> bool:
    """``obj`` (a function or class) is ``__main__``'s, found there by its name, and
    ``__main__`` goes by name (:func:`_main_by_reference`)."""
    qualname = getattr(obj, "__qualname__", None)
    if (getattr(obj, "__module__", None) != "__main__" or not isinstance(qualname, str)
            or not _main_by_reference()):
        return False
    found = sys.modules["__main__"]
    for part in qualname.split("."):  # '<locals>' is never found
        found = getattr(found, part, None)
    return found is obj


def _dump(pickler_cls, obj) -> tuple[bytes, SendContext]:
    ctx = SendContext()
    prev = getattr(_wire.current, "send", None)
    _wire.current.send = ctx
    buf = io.BytesIO()
    try:
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


def dumps(obj, undo: Callable[[], object] | None = None) -> tuple[bytes, SendContext]:
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


def _dump_by_value(obj, undo, first: BaseException | None) -> tuple[bytes, SendContext]:
    """The second try, after ``first`` (the fast pickler's error, if it failed)."""
    if undo is not None:
        undo()
    try:
        return _dump(_CloudPickler, obj)
    except Exception as e:
        if first is None:
            raise
        if hasattr(first, "add_note"):  # Python 3.11+
            first.add_note(f"(shmtensor also tried to pickle it by value, with cloudpickle: "
                           f"{type(e).__name__}: {e})")
        raise first from None


_RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOLCK)


def loads(data, fds: list[int], private: bool = False):
    """Unpickle a message from a shmtensor channel; closes every fd it did not keep.  A
    message that cannot be loaded for want of an fd or a lock is lost (it was read off the
    channel), and the error says so.  ``private``: see ``_rebuild_array``."""
    try:
        return _loads(data, fds, private)
    except OSError as e:
        if e.errno not in _RESOURCE_ERRNOS:
            raise
        raise OSError(e.errno, f"{e.strerror}; the message was received and discarded") from e


def _loads(data, fds: list[int], private: bool = False):
    if not fds:
        return pickle.loads(data)
    if data and data[0] == 0:  # a lane: pickle data starts with PROTO (0x80)
        return _lane_loads(data, fds)  # only arrays shared already take a lane
    ctx = RecvContext(fds, private)
    prev = getattr(_wire.current, "recv", None)
    _wire.current.recv = ctx
    loaded = False
    try:
        obj = pickle.loads(data)
        loaded = True
        return obj
    finally:
        _wire.current.recv = prev
        try:
            if ctx.deferred:
                ctx.establish(loaded)
        finally:
            for fn in ctx.after:
                fn()
            scm_rights.close_fds(fds)


def _lane_loads(data, fds: list[int]):
    """A message sent without a pickler (see ``_Pickler.lanes``): one object, loaded by the
    lane kind's registered loader."""
    kind = bytes(data[:2])
    if kind == NUMPY_LANE:
        return _numpy_lane_loads(data, fds)
    loader = _registry.lane_loader(kind)
    if loader is None:
        scm_rights.close_fds(fds)
        raise pickle.UnpicklingError(f"unknown message kind {kind!r}: the sender runs another "
                                     "shmtensor version, or an adapter this process lacks")
    return loader(data, fds)


def _rebuild_segment(key, kind, size, table_id, slot, data_i, lock_i):
    lease_fd, deferred = received_lease(table_id, slot, lock_i)
    anchor, took = _segments.receive(key, kind, size, table_id, slot,
                                     received_fd(data_i) if data_i >= 0 else None, lease_fd,
                                     deferred)
    if took:
        take_received_fd(data_i)
    return anchor


def _rebuild_array(anchor, offset, shape, strides, dtype, readonly, copied=False):
    """A received array on shared memory.  One the sender ``copied`` there only to send it
    (a plain array, not a shared one) is a value: where the channel keeps values (a
    manager's server), it becomes a private copy, so that what the server hands out later
    is copied again, as the stdlib's manager does, and never a view two readers write."""
    a = np.ndarray(shape, np.dtype(dtype), buffer=anchor, offset=offset, strides=strides)
    if copied and _wire.private_values():
        a = a.copy(order="K")  # the segment's hold goes with the view
    if readonly:
        a.flags.writeable = False
    _stats.bump("arrays_received")
    return a


def _rebuild_readonly(fn, args, state=None):
    """numpy's own reduction of a read-only array (which arrives writeable), read-only."""
    a = fn(*args)
    if state is not None:
        a.__setstate__(state)
    a.flags.writeable = False
    return a


def _rebuild_view(root, offset, shape, strides, dtype, readonly):
    flat = root.ravel(order="K").view(np.uint8) if root.size else np.empty(0, np.uint8)
    if 0 in shape:
        a = np.empty(shape, np.dtype(dtype))
    else:
        a = np.ndarray(shape, np.dtype(dtype), buffer=flat, offset=offset, strides=strides)
    if readonly:
        a.flags.writeable = False
    return a
