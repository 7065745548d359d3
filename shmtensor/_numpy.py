"""numpy arrays on shmtensor's channels: how they cross a process boundary and are rebuilt.

Installed as an adapter (see :mod:`shmtensor._registry`) once numpy is imported, so a
process that never handles an array never imports numpy.  A plain ``pickle.dumps`` of the
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

import math
import os
import pickle
import struct
from collections.abc import Callable
from ctypes import addressof, c_char
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt

from shmtensor.ipc import ofd_lease, scm_rights

from . import _channel, _log, _registry, _segments, _stats, _strategy, _wire
from ._reductions import NUMPY_LANE, PLAIN_LANE
from ._segments import FD, Segment
from ._wire import LaneContext, attach_fd, inflight_index, keep_alive, received_lease
from ._wire import Payload

# What a reducer of this package returns: the rebuild function and its arguments
Reduction = tuple[Callable[..., Any], tuple[Any, ...]]


def _dt(dt: np.dtype[Any]) -> str | np.dtype[Any]:
    """A dtype as a message names it: its string when that says all of it, else itself."""
    if dt.metadata:  # equal (and hashed equal) to the dtype without it: never looked up
        return dt
    name = _dt_names.get(dt)
    if name is None:
        if dt.fields is not None or dt.subdtype is not None:
            return dt
        name = dt.str
        if len(_dt_names) < 256:
            _dt_names[dt] = name
    return name


_dt_names: dict[np.dtype[Any], str] = {}  # a few, never evicted


def _ptr(a: np.ndarray) -> int:
    """The address of ``a``'s first element.  A ctypes view of its buffer is the quick
    way; an array that exports none as that asks (read-only, not C-contiguous, empty)
    takes numpy's array interface, which builds a dict of all of its layout."""
    try:
        return addressof(c_char.from_buffer(cast(Any, a)))  # (stubs miss its buffer)
    except (TypeError, ValueError, BufferError):
        return cast(int, a.__array_interface__["data"][0])


def _reduce_ndarray(a: np.ndarray) -> tuple[Any, ...]:
    if a.dtype.hasobject:
        _log.once("numpy-object", _log.INFO,
                  "shmtensor: an array of dtype %s was pickled by value (numpy's own "
                  "reduction): Python objects cannot live in shared memory. Use a numeric or "
                  "structured dtype to share it. (Reported once per process.)", a.dtype)
        return cast("tuple[Any, ...]", a.__reduce_ex__(pickle.HIGHEST_PROTOCOL))  # a tuple
    seg = _segments.segment_of(a)
    if seg is not None:
        if seg.kind != FD or seg.fd is not None:
            _stats.bump("arrays_sent_shared")
            return _reduce_on(a, seg, not a.flags.writeable)
        _log.once("numpy-reshare-copied", _log.INFO,
                  "shmtensor: a received shared array was sent on by copy, not as a handle: "
                  "this process did not keep the segment's memfd (it keeps at most %d "
                  "received ones, an eighth of its fd limit up to 256). Raise `ulimit -n`, or "
                  "use the file_system strategy, to forward more without copies. (Reported "
                  "once per process.)", ofd_lease.kept_budget())
    base = a.base
    if isinstance(base, np.ndarray) and seg is None:
        root = base
        while isinstance(root.base, np.ndarray):
            root = root.base
        # a subclass's root would be reduced through a view like this one again (see
        # view_as): such a view is sent by value
        if (type(root) is np.ndarray and (root.flags.c_contiguous or root.flags.f_contiguous)
                and root.dtype.hasobject is False
                and root.nbytes <= max(2 * a.nbytes, _strategy.get_inline_threshold())):
            return _rebuild_view, (root, _ptr(a) - _ptr(root), a.shape, a.strides, _dt(a.dtype),
                                   not a.flags.writeable)
    return _reduce_root(a)


def _reduce_root(a: np.ndarray) -> tuple[Any, ...]:
    """An array sent by value: inline when small, else copied once into a segment."""
    if a.nbytes < _strategy.get_inline_threshold():
        _stats.bump("arrays_sent_inline")
        # numpy 2.4 pickles a strided array with its bytes but loses a non-native byte
        # order on the way ('>i4' arrives as int32): a contiguous copy keeps it, and
        # costs little under the inline threshold.
        src = a if a.flags.c_contiguous or a.flags.f_contiguous else np.ascontiguousarray(a)
        rv = cast("tuple[Any, ...]", src.__reduce_ex__(pickle.HIGHEST_PROTOCOL))  # a tuple
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
    order: Literal["C", "F"] = "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"
    dst = np.ndarray(a.shape, a.dtype, buffer=anchor, offset=offset, order=order)
    np.copyto(dst, a, casting="no")
    _stats.bump("arrays_sent_copied")
    _log.once("numpy-copied", _log.DEBUG,
              "shmtensor: a plain array of %d bytes was copied into shared memory to be sent "
              "(arrays of the inline threshold or more that are not shared already are "
              "copied once). Make it with shmtensor.empty/zeros, or a BatchPool, to send it "
              "without a copy. (Reported once per process.)", a.nbytes)
    # anchor is a segment's: segment_of finds it
    return _reduce_on(dst, cast(Segment, _segments.segment_of(anchor)), not a.flags.writeable,
                      True)


def _reduce_on(a: np.ndarray, seg: Segment, readonly: bool, copied: bool = False) -> Reduction:
    """``copied``: ``a`` is a copy made only to send a plain array (see _rebuild_array)."""
    args = (seg, _ptr(a) - seg.address, a.shape, a.strides, _dt(a.dtype), readonly)
    return _rebuild_array, (args + (True,) if copied else args)


# A message that is one array goes without a pickler.  A shared one (its memory a segment
# that can travel): NUMPY_LANE and a plain pickle of the segment's and the view's fields,
# and its fds (the segment's memfd, if it is one, then the in-flight description of its
# lease, which the receiver keeps as its hold).  A plain contiguous one under the inline
# threshold, of a dtype its string names: PLAIN_LANE, its flags, shape, strides and dtype
# string, then its bytes in memory order.  Anything else takes the pickler.

_PLAIN_HEAD = struct.Struct("<2sBBB")  # kind, read-only, ndim, length of the dtype string
_shapes = [struct.Struct(f"<{2 * n}q") for n in range(65)]  # numpy allows 64 dimensions


def lane_dumps(a: np.ndarray) -> tuple[bytes, _wire.SendContext] | None:
    """``a`` alone as a message ``(payload, context)``, or None for the pickler."""
    seg = _segments.segment_of(a)
    if seg is None:
        return _plain_dumps(a)
    if (seg.kind == FD and seg.fd is None) or a.dtype.hasobject:
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
            LaneContext(anchor, seg.fd if seg.kind == FD else None, seg.table_id, seg.slot,
                        _handle(seg) if seg.own and seg.kind == FD else None,
                        None if seg.own or seg.kind != FD or a.nbytes > _segments.SLAB_ITEM_MAX
                        else _forward(seg)))


def _handle(seg: Segment) -> tuple[int, int, int, int, int] | None:
    """An own memfd's (fd, inode, lease shard's fd, its inode, size or 0 for a slab): see
    ``LaneContext.handle``.  Not a BatchPool's slot's: the sender keeps the memory until
    the reader took the message, which would keep the slot from coming back when the
    reader lets go (so would a slot of its shared file).  Not a received segment's: its
    sender's hold is the only thing that keeps the memory in flight (see
    docs/channel-design.md, "What was built")."""
    fd = seg.fd
    table = ofd_lease.own_table()
    if fd is None or seg.pinned or seg.file is not None or seg.table_id != table.id:
        return None
    if not seg.ino:
        seg.ino = os.fstat(fd).st_ino
    shard_fd, shard_ino = table.shard(seg.slot)
    return fd, seg.ino, shard_fd, shard_ino, 0 if seg.slab else seg.size


def _forward(seg: Segment) -> tuple[int, int, int, int, int]:
    """A received memfd's (fd, inode, description of its lease file, its inode, 0), -1
    and 0 where this process has none: see ``LaneContext.forward``.  Only for arrays a
    slab may hold (up to ``SLAB_ITEM_MAX``): one sent back without fds that its maker never
    takes reaches another reader only while the maker, or this process, still has the
    memory, and a larger one gains little by going without fds."""
    fd = -1 if seg.fd is None else seg.fd
    if fd >= 0 and not seg.ino:
        seg.ino = os.fstat(fd).st_ino
    return (fd, seg.ino, *ofd_lease.holder(seg.table_id, seg.slot), 0)


# a record without fds keeps its array's anchor until taken: let go of those taken before
# a segment is chosen, so that one is reused; a reader that stops calling get lets go of
# what it kept for memory its writers freed, on the sweeper thread's passes; and memory
# sent back to this process without fds stays while its record waits
def _prune_channels() -> None:
    _channel.prune_all()


def _sweep_channels() -> bool:
    return _channel.sweep_all()


def _names_own(table_id: str, slot: int) -> bool | None:
    return _channel.names_own(table_id, slot)


# (looked up when called: this adapter may be installed while _channel is being imported)
_segments.releasers.append(_prune_channels)
_segments.sweepers.append(_sweep_channels)
_segments.namers.append(_names_own)


def held_attach(data: Payload, seg_fd: Callable[[], int],
                lease: Callable[[], int]) -> tuple[np.ndarray, tuple[Any, ...]]:
    """The segment of a :func:`lane_dumps` message that came without fds (its reader was
    sent them once), held here: its anchor, and the view's fields for :func:`held_load`.
    ``seg_fd`` and ``lease`` give the segment's memfd and a description of its lease
    file, each asked for only where this process lacks it (both the caller's)."""
    (key, kind, size, table_id, slot, *view) = pickle.loads(memoryview(data)[len(NUMPY_LANE):])
    if kind != FD:
        raise pickle.UnpicklingError(f"a shared array of kind {kind!r} came without fds")
    return _segments.attach_held(key, kind, size, table_id, slot, seg_fd, lease), tuple(view)


def held_load(anchor: np.ndarray, view: tuple[Any, ...]) -> np.ndarray:
    """The array of a message :func:`held_attach` attached."""
    offset, shape, strides, dtype, readonly = view
    return _rebuild_array(anchor, offset, shape, strides, _dtype(dtype), readonly)


def _dtype(dtype: Any) -> np.dtype[Any]:
    dt = _dtypes.get(dtype) if type(dtype) is str else None
    if dt is None:
        dt = np.dtype(dtype)
        if type(dtype) is str and len(_dtypes) < 256:
            _dtypes[dtype] = dt
    return dt


def _plain_dumps(a: np.ndarray) -> tuple[bytes, _wire.SendContext] | None:
    """A plain array by value, as the pickler would send it inline, or None (over the
    threshold: copied into a segment; a dtype its string does not name)."""
    dt = a.dtype
    if dt.metadata is not None:  # equal to the dtype without it: never looked up
        return None
    name = _dtype_names.get(dt)
    if name is None:
        if type(_dt(dt)) is not str or dt.hasobject or not dt.itemsize:
            return None
        name = dt.str.encode()
        if len(_dtype_names) < 256:
            _dtype_names[dt] = name
    flags = a.flags
    if a.nbytes >= _strategy.get_inline_threshold() or not (
            flags.c_contiguous or flags.f_contiguous):
        return None  # a strided view goes as its root and its place in it (the pickler)
    _stats.bump("arrays_sent_inline")
    # memory order, which the strides address: C unless only F-contiguous
    data = a.tobytes("C" if flags.c_contiguous else "F")
    return b"".join((_PLAIN_HEAD.pack(PLAIN_LANE, not flags.writeable, a.ndim, len(name)),
                     _shapes[a.ndim].pack(*a.shape, *a.strides), name, data)), _wire.NO_FDS


# dtype strings of lane messages -> numpy dtypes, and for plain ones both ways (a few
# each, never evicted)
_dtypes: dict[str, np.dtype[Any]] = {}
_dtype_names: dict[np.dtype[Any], bytes] = {}
_named_dtypes: dict[bytes, np.dtype[Any]] = {}


def lane_loads(data: Payload, fds: list[int]) -> np.ndarray:
    """The array of a :func:`lane_dumps` message; closes every fd it does not keep.
    A shared one's in-flight description covers its one slot, so it may itself become the
    hold (``_segments.receive`` given the fd list as the lease), with nothing deferred."""
    try:
        if data[1:2] == b"P":
            return _plain_loads(data, fds)
        (key, kind, size, table_id, slot, offset, shape, strides, dtype,
         readonly) = pickle.loads(memoryview(data)[len(NUMPY_LANE):])
        if len(fds) != (2 if kind == FD else 1):
            raise pickle.UnpicklingError(f"a shared array came with {len(fds)} fds")
        # what the segment keeps leaves ``fds`` as it is taken: the finally closes the rest
        anchor = _segments.receive(key, kind, size, table_id, slot, fds, fds)[0]
        return _rebuild_array(anchor, offset, shape, strides, _dtype(dtype), readonly)
    finally:
        scm_rights.close_fds(fds)


def _plain_loads(data: Payload, fds: list[int]) -> np.ndarray:
    """The array of a plain lane message: its bytes in a buffer of its own, writeable
    unless it was sent read-only (as numpy's pickle of it would arrive).  Nothing of the
    header is trusted: the bytes must be exactly the array's, and its strides those of a
    C- or F-ordered block (any on an axis of length 1), so the array addresses only them
    (numpy's own check of given strides can overflow, and checks nothing for an empty
    buffer); an array of no items has no buffer."""
    try:
        _, readonly, ndim, n = _PLAIN_HEAD.unpack_from(data)
        layout = _shapes[ndim].unpack_from(data, _PLAIN_HEAD.size)
        at = _PLAIN_HEAD.size + 16 * ndim
        name = bytes(data[at:at + n])
        dt = _named_dtypes.get(name)
        if dt is None:
            dt = np.dtype(name.decode())
            if dt.hasobject:  # numpy would read the bytes as object pointers
                raise TypeError(f"dtype {dt} holds Python objects")
            if len(_named_dtypes) < 256:
                _named_dtypes[name] = dt
        shape, strides = layout[:ndim], layout[ndim:]
        if readonly > 1 or min(shape, default=0) < 0 or len(data) - at - n != (
                dt.itemsize * math.prod(shape)):
            raise ValueError("its header does not describe its bytes")
        if 0 in shape:  # no item: no buffer, nothing addressed
            a: np.ndarray = np.ndarray(shape, dt, strides=strides)
        elif _addresses_a_block(shape, strides, dt.itemsize):
            a = np.ndarray(shape, dt, bytearray(memoryview(data)[at + n:]), 0, strides)
        else:
            raise ValueError("its strides do not address its bytes")
    # (numpy parses some dtype strings as Python literals: SyntaxError)
    except (struct.error, IndexError, ValueError, TypeError, UnicodeDecodeError,
            SyntaxError) as e:
        raise pickle.UnpicklingError(f"a malformed array message ({e}): the sender is not "
                                     "this shmtensor version's, or the channel was written "
                                     "by something else") from None
    if fds:
        raise pickle.UnpicklingError(f"a plain array came with {len(fds)} fds")
    if readonly:
        a.flags.writeable = False
    return a


def _addresses_a_block(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Whether ``strides`` step through ``shape`` as a C- or F-ordered block of items of
    ``itemsize`` bytes (an axis of length 1 may have any stride: it is never stepped)."""
    for axes in (range(len(shape) - 1, -1, -1), range(len(shape))):
        step = itemsize
        for i in axes:
            if shape[i] != 1 and strides[i] != step:
                break
            step *= shape[i]
        else:
            return True
    return False


def _reduce_segment(seg: Segment) -> Reduction:
    ctx = _wire.send_context()
    ctx.keep.append(seg.anchor())
    i = inflight_index(seg.table_id, seg.slot)
    d = attach_fd(cast(int, seg.fd)) if seg.kind == FD else -1  # an FD segment sent has its fd
    return _rebuild_segment, (seg.key, seg.kind, seg.size, seg.table_id, seg.slot, d, i)


def _rebuild_segment(key: str, kind: str, size: int, table_id: str, slot: int, data_i: int,
                     lock_i: int) -> np.ndarray:
    lease_fd, deferred = received_lease(table_id, slot, lock_i)
    # the message's fd list: a kept memfd leaves it as the segment takes it
    fds = _wire.received_fds() if data_i >= 0 else None
    return _segments.receive(key, kind, size, table_id, slot, fds, lease_fd, deferred,
                             max(data_i, 0))[0]


def _rebuild_array(anchor: np.ndarray, offset: int, shape: tuple[int, ...],
                   strides: tuple[int, ...] | None, dtype: npt.DTypeLike, readonly: bool,
                   copied: bool = False) -> np.ndarray:
    """A received array on shared memory.  One the sender ``copied`` there only to send it
    (a plain array, not a shared one) is a value: where the channel keeps values (a
    manager's server), it becomes a private copy, so that what the server hands out later
    is copied again, as the stdlib's manager does, and never a view two readers write."""
    if offset < 0:  # numpy checks the end of the view only
        raise ValueError(f"a shared array at offset {offset} of its memory: a corrupt message")
    a: np.ndarray = np.ndarray(shape, np.dtype(dtype), buffer=anchor, offset=offset,
                               strides=strides)
    if copied and _wire.private_values():
        a = a.copy(order="K")  # the segment's hold goes with the view
    if readonly:
        a.flags.writeable = False
    _stats.bump("arrays_received")
    return a


def _rebuild_readonly(fn: Callable[..., np.ndarray], args: tuple[Any, ...],
                      state: tuple[Any, ...] | None = None) -> np.ndarray:
    """numpy's own reduction of a read-only array (which arrives writeable), read-only."""
    a = fn(*args)
    if state is not None:
        a.__setstate__(state)
    a.flags.writeable = False
    return a


def _rebuild_view(root: np.ndarray, offset: int, shape: tuple[int, ...],
                  strides: tuple[int, ...], dtype: npt.DTypeLike, readonly: bool) -> np.ndarray:
    flat = root.ravel(order="K").view(np.uint8) if root.size else np.empty(0, np.uint8)
    if 0 in shape:
        a = np.empty(shape, np.dtype(dtype))
    else:
        a = np.ndarray(shape, np.dtype(dtype), buffer=flat, offset=offset, strides=strides)
    if readonly:
        a.flags.writeable = False
    return a


def view_as(a: np.ndarray, cls: type) -> np.ndarray:
    """``a``'s memory as an instance of ``cls``: how a subclass of ndarray is sent as an
    ndarray and rebuilt as itself (see ``_registry.register``)."""
    return a.view(cls)


# Importing this module installs it (``_reductions`` imports it once numpy is imported).
_registry.register(np.ndarray, _reduce_ndarray, lane_dumps, view_as)
_registry.register(Segment, _reduce_segment)
