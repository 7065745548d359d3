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
import io
import pickle
import sys
import threading
import types
from collections import ChainMap
from collections.abc import Callable
from multiprocessing.pool import ExceptionWithTraceback, rebuild_exc
from multiprocessing.reduction import ForkingPickler

import cloudpickle
import numpy as np

from shmtensor.ipc import ofd_lease, scm_rights

from . import _segments, _stats, _strategy
from ._segments import FD, Segment

_local = threading.local()


class SendContext:
    """What one outgoing message needs besides its bytes: fds to attach and refs to keep.

    In-flight lock descriptions are made by :meth:`wire_fds`, right before the send, so a
    message waiting in a queue's buffer costs no fd (its anchors keep the holds meanwhile).
    """

    __slots__ = ("fds", "owned", "keep", "inflight", "memo", "__weakref__")

    def __init__(self) -> None:
        self.fds: list[int] = []
        self.owned: list[int] = []   # in-flight lock descriptions: closed once sent
        self.keep: list = []          # anchors that must outlive the send
        self.inflight: dict[tuple, tuple[int, list[int]]] = {}  # (table, file) -> fd index, slots
        self.memo: dict = {}          # what reducers did once for the whole message

    def wire_fds(self) -> list[int]:
        """The fds to send: segment fds plus one fresh in-flight description per lease
        table file (see ``ofd_lease.SHARDS``)."""
        for (table_id, _), (i, slots) in self.inflight.items():
            if self.fds[i] < 0:
                fd = ofd_lease.inflight_fd(table_id, slots)
                self.owned.append(fd)
                self.fds[i] = fd
        return self.fds

    def release(self) -> None:
        owned, self.owned = self.owned, []
        scm_rights.close_fds(owned)
        self.keep = []
        self.fds = []

    def __del__(self) -> None:
        if self.owned:  # never sent, nor released
            self.release()


class LaneContext(SendContext):
    """The context of a message sent without a pickler (see ``_Pickler.lanes``): the data
    fd, if any (``fd`` None: none), then one in-flight description of one lease slot,
    made when the message is sent.  ``keep`` keeps the data fd open until then."""

    __slots__ = ("table_id", "slot")

    def __init__(self, keep, fd: int | None, table_id: str, slot: int) -> None:
        self.keep = [keep]
        self.fds = [-1] if fd is None else [fd, -1]
        self.owned = []
        self.table_id, self.slot = table_id, slot

    def wire_fds(self) -> list[int]:
        fds = self.fds
        if fds[-1] < 0:
            fds[-1] = ofd_lease.inflight_fd(self.table_id, (self.slot,))
            self.owned.append(fds[-1])
        return fds


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
    return _reduce_on(dst, _segments.segment_of(anchor), not a.flags.writeable)


def _reduce_on(a: np.ndarray, seg: Segment, readonly: bool):
    return _rebuild_array, (seg, _ptr(a) - seg.address, a.shape, a.strides, _dt(a.dtype), readonly)


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
    fields = (seg.key, seg.kind, seg.size, seg.table_id, seg.slot, _ptr(a) - seg.address,
              a.shape, a.strides, _dt(a.dtype), not a.flags.writeable)
    _stats.bump("arrays_sent_shared")
    return (NUMPY_LANE + pickle.dumps(fields, pickle.HIGHEST_PROTOCOL),
            LaneContext(anchor, seg.fd if seg.kind == FD else None, seg.table_id, seg.slot))


def _numpy_lane_loads(data, fds: list[int]):
    """The array of a :func:`_numpy_lane_dumps` message; closes every fd it does not keep.
    Its hold is made as :func:`loads` makes one: deferred while loading, then established
    (keeping the message's description, which covers this one slot)."""
    ctx = _RecvContext(fds)
    loaded = False
    try:
        (key, kind, size, table_id, slot, offset, shape, strides, dtype,
         readonly) = pickle.loads(memoryview(data)[len(NUMPY_LANE):])
        if len(fds) != (2 if kind == FD else 1):
            raise pickle.UnpicklingError(f"a shared array came with {len(fds)} fds")
        ctx.claims[len(fds) - 1] = {(table_id, slot)}
        anchor, took = _segments.receive(key, kind, size, table_id, slot,
                                         fds[0] if kind == FD else None, fds[-1], ctx.deferred)
        if took:
            fds[0] = -1
        a = _rebuild_array(anchor, offset, shape, strides, dtype, readonly)
        loaded = True
        return a
    finally:
        try:
            if ctx.deferred:
                ctx.establish(loaded)
        finally:
            scm_rights.close_fds(fds)


def _send_context() -> SendContext:
    ctx: SendContext | None = getattr(_local, "send", None)
    if ctx is None:
        raise pickle.PicklingError("shmtensor segments and CUDA handles travel only on "
                                   "shmtensor channels")
    return ctx


def inflight_index(table_id: str, slot: int) -> int:
    """Index (among the message's fds) of the in-flight lock that will cover ``slot``."""
    ctx = _send_context()
    key = (table_id, slot % ofd_lease.SHARDS)
    entry = ctx.inflight.get(key)
    if entry is None:
        ctx.fds.append(-1)  # placeholder: SendContext.wire_fds makes the description
        entry = ctx.inflight[key] = (len(ctx.fds) - 1, [])
    entry[1].append(slot)
    return entry[0]


def keep_alive(obj) -> None:
    """Keep ``obj`` alive until the message being pickled has been sent."""
    _send_context().keep.append(obj)


def attach_fd(fd: int) -> int:
    """Send ``fd`` with the message being pickled: its index.  The caller keeps ``fd`` open
    until the message is sent (what the reducer passes to :func:`keep_alive` does)."""
    ctx = _send_context()
    ctx.fds.append(fd)
    return len(ctx.fds) - 1


def message_memo() -> dict:
    """A dict that lives as long as the message being pickled or unpickled: for work done
    once per message, whatever the number of arrays in it."""
    ctx = getattr(_local, "recv", None)
    return (ctx if ctx is not None else _send_context()).memo


def after_loading(fn) -> None:
    """Call ``fn()`` once the message being unpickled is loaded (or failed to load)."""
    _local.recv.after.append(fn)


def take_received_fd(i: int) -> int:
    """Keep the ``i``-th fd of the message being unpickled (it is not closed after loading)."""
    fd = received_fd(i)
    _local.recv.fds[i] = -1
    return fd


def received_lease(table_id: str, slot: int, lock_i: int) -> tuple[int, list]:
    """The in-flight description ``lock_i`` that covers ``slot`` of ``table_id`` in the
    message being unpickled, and the list to give ``ofd_lease.hold`` as ``deferred``: a new
    hold is made real when the message is loaded, by keeping that description itself when
    it covers this one slot alone."""
    ctx = _local.recv
    claims = ctx.claims.get(lock_i)
    if claims is None:
        claims = ctx.claims[lock_i] = set()
    claims.add((table_id, slot))
    return ctx.fds[lock_i], ctx.deferred


def received_fd(i: int) -> int:
    """The ``i``-th fd that came with the message being unpickled."""
    ctx: _RecvContext | None = getattr(_local, "recv", None)
    if ctx is None:
        raise pickle.UnpicklingError(
            "this pickle holds a shmtensor handle and can only be loaded from the shmtensor "
            "channel it was sent on")
    return ctx.fds[i]


def _reduce_segment(seg: Segment):
    ctx = _send_context()
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


_OURS = {np.ndarray: _reduce_ndarray, Segment: _reduce_segment,
         ExceptionWithTraceback: _reduce_exception_with_traceback}


def _cupy_reducers() -> dict:
    cp = sys.modules.get("cupy")
    if cp is None:
        return {}
    from .cuda import _ipc
    return {cp.ndarray: _ipc.reduce_cupy_array, cp.cuda.Event: _ipc.reduce_cupy_event}


def _lanes() -> dict:
    lanes = {np.ndarray: _numpy_lane_dumps}
    vmm, cp = sys.modules.get("shmtensor.cuda._vmm"), sys.modules.get("cupy")
    if vmm is not None and cp is not None:
        lanes[cp.ndarray] = vmm.lane_dumps
    return lanes


class _Pickler(pickle.Pickler):
    """The fast pickler: shmtensor's reducers ahead of multiprocessing's and copyreg's, in
    one plain dict (rebuilt when another library registers reducers or CuPy appears)."""

    dispatch_table: dict = {}
    lanes: dict = {}  # type -> f(obj): (payload, SendContext) without a pickler, or None
    _signature: tuple = ()

    @classmethod
    def refresh(cls) -> None:
        sig = (len(copyreg.dispatch_table), len(ForkingPickler._extra_reducers),
               "cupy" in sys.modules, "shmtensor.cuda._vmm" in sys.modules)
        if sig != cls._signature:
            table = dict(copyreg.dispatch_table)
            table.update(ForkingPickler._extra_reducers)
            table.update(_OURS)
            table.update(_cupy_reducers())
            cls.lanes = _lanes()
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
    prev = getattr(_local, "send", None)
    _local.send = ctx
    buf = io.BytesIO()
    try:
        pickler_cls(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    except BaseException:
        ctx.release()
        raise
    finally:
        _local.send = prev
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


class _RecvContext:
    __slots__ = ("fds", "after", "memo", "claims", "deferred")

    def __init__(self, fds: list[int]) -> None:
        self.fds = fds
        self.after: list = []
        self.memo: dict = {}
        self.claims: dict[int, set] = {}  # in-flight description's index -> slots it covers
        self.deferred: list = []          # holds to make real once loaded (ofd_lease.hold)

    def establish(self, loaded: bool) -> None:
        """Make the deferred holds real, keeping a description that covers one slot (only
        after a complete load: a failed one may not have claimed every slot it covers).
        Every entry is tried; the first error is raised after."""
        error = None
        for table_id, slot, fd in self.deferred:
            try:
                i = self.fds.index(fd)
                sole = loaded and len(self.claims.get(i, ())) == 1
                if ofd_lease.establish(table_id, slot, fd, sole):
                    self.fds[i] = -1  # kept: not closed by loads
            except Exception as e:  # e.g. no locks left: the load fails, nothing leaks
                error = error or e
        if error is not None:
            raise error


def loads(data, fds: list[int]):
    """Unpickle a message from a shmtensor channel; closes every fd it did not keep."""
    if not fds:
        return pickle.loads(data)
    if data and data[0] == 0:  # a lane: pickle data starts with PROTO (0x80)
        return _lane_loads(data, fds)
    ctx = _RecvContext(fds)
    prev = getattr(_local, "recv", None)
    _local.recv = ctx
    loaded = False
    try:
        obj = pickle.loads(data)
        loaded = True
        return obj
    finally:
        _local.recv = prev
        try:
            if ctx.deferred:
                ctx.establish(loaded)
        finally:
            for fn in ctx.after:
                fn()
            scm_rights.close_fds(fds)


_vmm = None  # shmtensor.cuda._vmm, imported by the first message that needs it


def _lane_loads(data, fds: list[int]):
    """A message sent without a pickler (see ``_Pickler.lanes``): one shared array."""
    global _vmm
    kind = bytes(data[:2])
    if kind == NUMPY_LANE:
        return _numpy_lane_loads(data, fds)
    if _vmm is None:
        from .cuda import _vmm
    if kind == _vmm.LANE:
        return _vmm.lane_loads(data, fds)
    scm_rights.close_fds(fds)
    raise pickle.UnpicklingError(f"unknown message kind {kind!r}: the sender runs another "
                                 "shmtensor version")


def _rebuild_segment(key, kind, size, table_id, slot, data_i, lock_i):
    lease_fd, deferred = received_lease(table_id, slot, lock_i)
    anchor, took = _segments.receive(key, kind, size, table_id, slot,
                                     received_fd(data_i) if data_i >= 0 else None, lease_fd,
                                     deferred)
    if took:
        take_received_fd(data_i)
    return anchor


def _rebuild_array(anchor, offset, shape, strides, dtype, readonly):
    a = np.ndarray(shape, np.dtype(dtype), buffer=anchor, offset=offset, strides=strides)
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
