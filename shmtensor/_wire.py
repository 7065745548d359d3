"""What travels with a message besides its pickle bytes, while it is pickled or unpickled.

A reducer (numpy's in :mod:`shmtensor._reductions`, CuPy's in :mod:`shmtensor.cuda`, any
registered through :mod:`shmtensor._registry`) runs inside one message's *send context*:
it attaches fds, keeps objects alive until the message is sent, and names the lease slots
the message's in-flight lock must cover.  A rebuild function runs inside the matching
*receive context*: it finds those fds and the lease descriptions that cover its slots.
This module owns both contexts (one per thread, set by the pickling code) and nothing else,
so the core and the CUDA code import it without importing each other.
"""

from __future__ import annotations

import math
import pickle
import threading
from collections.abc import Hashable
from typing import Any, TypeAlias, cast

from shmtensor.ipc import ofd_lease, scm_rights

current = threading.local()  # .send: SendContext, .recv: RecvContext of this thread's message

# A message's bytes as a channel's reader hands them over (a large one is read into a
# bytearray), for the loaders.
Payload: TypeAlias = bytes | bytearray
# Holds that a message being loaded made real only once it is loaded: (lease table id,
# slot, the in-flight description's fd), appended by ``ofd_lease.hold``.
Deferred: TypeAlias = list[tuple[str, int, int]]


class SendContext:
    """What one outgoing message needs besides its bytes: fds to attach and refs to keep.

    In-flight lock descriptions are made by :meth:`wire_fds`, right before the send, so a
    message waiting in a queue's buffer costs no fd (its anchors keep the holds meanwhile);
    a slot this process holds by a description of its own travels with a ``dup`` of that
    one, which the message owns like a fresh one.
    """

    __slots__ = ("fds", "owned", "keep", "inflight", "memo", "__weakref__")

    handle: tuple[int, int, int, int, int] | None = None  # see LaneContext
    forward: tuple[int, int, int, int, int] | None = None  # see LaneContext

    def __init__(self) -> None:
        self.fds: list[int] = []
        self.owned: list[int] = []   # in-flight lock descriptions: closed once sent
        self.keep: list[object] = []  # anchors that must outlive the send
        # (table, file) -> fd index, slots
        self.inflight: dict[tuple[str, int], tuple[int, list[int]]] = {}
        self.memo: dict[Hashable, Any] = {}  # what reducers did once for the whole message

    def wire_fds(self) -> list[int]:
        """The fds to send: segment fds plus one fresh in-flight description per lease
        table file (see ``ofd_lease.SHARDS``)."""
        for (table_id, _), (i, slots) in self.inflight.items():
            if self.fds[i] < 0:
                fd = ofd_lease.sendable(table_id, slots[0]) if len(set(slots)) == 1 else -1
                if fd < 0:
                    fd = ofd_lease.inflight_fd(table_id, slots)
                self.owned.append(fd)
                self.fds[i] = fd
        return self.fds

    def release(self) -> None:
        owned, self.owned = self.owned, []
        if owned:
            scm_rights.close_fds(owned)
        self.keep = []
        self.fds = []

    def __del__(self) -> None:
        # never sent, nor released (nothing, if __init__ was cut short before ``owned``)
        if getattr(self, "owned", None):
            self.release()


class _NoFds(SendContext):
    """The context of a message sent without a pickler that carries nothing but its bytes
    (a plain array's): one, shared, that nothing changes."""

    __slots__ = ()

    def wire_fds(self) -> list[int]:
        return []

    def release(self) -> None:
        pass


NO_FDS: SendContext = _NoFds()


class LaneContext(SendContext):
    """The context of a message sent without a pickler (see ``_Pickler.lanes``): the data
    fd, if any (``fd`` None: none), then one in-flight description of one lease slot,
    made when the message is sent.  ``keep`` keeps the data fd open until then.

    ``handle``: for memory this process made in a memfd, (its fd, its inode, the fd and
    inode of its lease shard, its size or 0 for a slab), or (-1, 0, the shard's fd and
    inode, 0) for memory in no file (a CUDA IPC allocation, which the payload's handle
    names), by which a channel may send the message without fds to a reader that has them
    (``_channel.Channel.post``); ``keep`` is then the anchor that holds the memory until
    that reader holds it.

    ``forward``: for memory another process made, which this one received and sends on,
    the same 5 fields (this process's fds of the memfd and of a description of the lease
    file, -1 where it has none), by which a channel whose sole reader is the memory's
    maker sends it back without fds (see ``Channel.post``)."""

    __slots__ = ("table_id", "slot", "handle", "forward")

    def __init__(self, keep: object, fd: int | None, table_id: str, slot: int,
                 handle: tuple[int, int, int, int, int] | None = None,
                 forward: tuple[int, int, int, int, int] | None = None) -> None:
        self.keep = [keep]
        self.fds = [-1] if fd is None else [fd, -1]
        self.owned = []
        self.table_id, self.slot, self.handle, self.forward = table_id, slot, handle, forward

    def wire_fds(self) -> list[int]:
        fds = self.fds
        if fds[-1] < 0:
            fd = ofd_lease.sendable(self.table_id, self.slot)
            if fd < 0:
                fd = ofd_lease.inflight_fd(self.table_id, (self.slot,))
            self.owned.append(fd)
            fds[-1] = fd
        return fds


class RecvContext:
    """What one incoming message's rebuild functions share; ``private``: arrays that the
    sender copied into shared memory only to send them arrive as private copies (a
    manager's server keeps values, as the stdlib's does, not views others can write)."""

    __slots__ = ("fds", "memo", "claims", "deferred", "private")

    def __init__(self, fds: list[int], private: bool = False) -> None:
        self.fds = fds
        self.private = private
        self.memo: dict[Hashable, Any] = {}
        # in-flight description's index -> the (table id, slot)s it covers
        self.claims: dict[int, set[tuple[str, int]]] = {}
        self.deferred: Deferred = []  # holds to make real once loaded (ofd_lease.hold)

    def establish(self, loaded: bool) -> None:
        """Make the deferred holds real, keeping a description that covers one slot (only
        after a complete load: a failed one may not have claimed every slot it covers).
        Every entry is tried; the first error is raised after."""
        error = None
        for table_id, slot, fd in self.deferred:
            try:
                i = self.fds.index(fd)
                sole = loaded and len(self.claims.get(i, ())) == 1
                # kept, it leaves self.fds in the same step (not closed by loads)
                ofd_lease.establish(table_id, slot, self.fds, sole, i)
            except Exception as e:  # e.g. no locks left: the load fails, nothing leaks
                error = error or e
        if error is not None:
            try:
                raise error
            finally:
                error = None  # no cycle through this frame: the loaded objects die now


def send_context() -> SendContext:
    ctx: SendContext | None = getattr(current, "send", None)
    if ctx is None:
        raise pickle.PicklingError("shmtensor segments and CUDA handles travel only on "
                                   "shmtensor channels")
    return ctx


def inflight_index(table_id: str, slot: int) -> int:
    """Index (among the message's fds) of the in-flight lock that will cover ``slot``."""
    ctx = send_context()
    key = (table_id, slot % ofd_lease.SHARDS)
    entry = ctx.inflight.get(key)
    if entry is None:
        ctx.fds.append(-1)  # placeholder: SendContext.wire_fds makes the description
        entry = ctx.inflight[key] = (len(ctx.fds) - 1, [])
    entry[1].append(slot)
    return entry[0]


def keep_alive(obj: object) -> None:
    """Keep ``obj`` alive until the message being pickled has been sent."""
    send_context().keep.append(obj)


def attach_fd(fd: int) -> int:
    """Send ``fd`` with the message being pickled: its index.  The caller keeps ``fd`` open
    until the message is sent (what the reducer passes to :func:`keep_alive` does)."""
    ctx = send_context()
    ctx.fds.append(fd)
    return len(ctx.fds) - 1


def message_memo() -> dict[Hashable, Any]:
    """A dict that lives as long as the message being pickled or unpickled: for work done
    once per message, whatever the number of arrays in it."""
    ctx: RecvContext | None = getattr(current, "recv", None)
    return (ctx if ctx is not None else send_context()).memo


def received_lease(table_id: str, slot: int, lock_i: int) -> tuple[int, Deferred]:
    """The in-flight description ``lock_i`` that covers ``slot`` of ``table_id`` in the
    message being unpickled, and the list to give ``ofd_lease.hold`` as ``deferred``: a new
    hold is made real when the message is loaded, by keeping that description itself when
    it covers this one slot alone."""
    ctx: RecvContext = current.recv
    claims = ctx.claims.get(lock_i)
    if claims is None:
        claims = ctx.claims[lock_i] = set()
    claims.add((table_id, slot))
    return ctx.fds[lock_i], ctx.deferred


def lane_fields(data: Payload, fds: list[int], want: int, what: str) -> tuple[Any, ...]:
    """The fields of a lane message (a 2-byte kind, then a plain pickle), once it is known
    to have come with ``want`` fds."""
    if len(fds) != want:
        raise pickle.UnpicklingError(f"{what} came with {len(fds)} fds, not {want}")
    return cast("tuple[Any, ...]", pickle.loads(memoryview(data)[2:]))


def check_view(offset: int, shape: tuple[int, ...], strides: tuple[int, ...] | None,
               itemsize: int, size: int) -> None:
    """``ValueError`` unless a received view (``strides`` None: C order) lies within the
    ``size`` bytes of its memory: a corrupt or hostile message could name one outside it,
    which CuPy never checks (nor numpy a negative offset)."""
    if strides is None:
        strides = tuple(itemsize * math.prod(shape[i + 1:]) for i in range(len(shape)))
    lo = hi = offset
    if all(n > 0 for n in shape):
        for n, stride in zip(shape, strides):
            if stride < 0:
                lo += stride * (n - 1)
            else:
                hi += stride * (n - 1)
        hi += itemsize
    if (offset < 0 or lo < 0 or hi > size or len(strides) != len(shape)
            or any(n < 0 for n in shape)):
        raise ValueError(f"a received array (offset {offset}, shape {shape}, strides "
                         f"{strides}) lies outside its memory of {size} bytes: a corrupt "
                         "message")


def received_fd(i: int) -> int:
    """The ``i``-th fd that came with the message being unpickled."""
    return received_fds()[i]


def received_fds() -> list[int]:
    """The fds that came with the message being unpickled: the list itself, from which a
    rebuild takes (-1) what it keeps, in the same step as it keeps it."""
    ctx: RecvContext | None = getattr(current, "recv", None)
    if ctx is None:
        raise pickle.UnpicklingError(
            "this pickle holds a shmtensor handle and can only be loaded from the shmtensor "
            "channel it was sent on")
    return ctx.fds


def private_values() -> bool:
    """True while a message is loaded whose copied arrays must arrive as private copies."""
    ctx: RecvContext | None = getattr(current, "recv", None)
    return ctx is not None and ctx.private
