"""numpy arrays through Ray: shared ones as handles to their segment, others as Ray does.

Ray picks a serializer by exact class, and every shared array is a plain ``np.ndarray``,
so the reducer registered for ``np.ndarray`` looks at each array: one whose memory is a
shmtensor segment becomes a small handle (an export of this process, see
:mod:`._exports`); any other is reduced as numpy reduces it for pickle protocol 5, which
is what Ray does without us (its data goes out of band into the object store and is read
there zero-copy, read-only).

A handle is rebuilt on the sender's host as a view of the same segment, writable both
ways: the receiver reopens the sender's lease description and memfd through
``/proc/PID/fd`` (a named segment by its name) and holds the segment's lease as any
shmtensor receiver does.  On another host the data comes by value, into a shared segment
of the receiver's host (so it crosses that host zero-copy from then on): the bytes the
payload carries (a task's result made off the driver's node carries them, through Ray's
object store: see ``_exports.carry``), else from the agent of the sender's node
(:mod:`._agent`: over TCP, else through Ray's object store).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np

from shmtensor import _alloc, _segments
from shmtensor.ipc import ofd_lease, posix_shm

from . import _agent, _exports, _host

if TYPE_CHECKING:
    from ._exports import Pin

FD, FS = _segments.FD, _segments.FS


class Handle(NamedTuple):
    """What a shared array is to Ray: where its memory is, and how to view it."""

    host: str
    node_id: str
    pid: int
    lease_fd: int   # the sender's lease description (its /proc/PID/fd number)
    seg_fd: int     # the sender's duplicate of the memfd, -1 for a named segment
    key: str
    kind: str
    size: int
    table_id: str
    slot: int
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: np.dtype[Any]
    writeable: bool


# Received memfds that the segment module did not keep (its budget was spent): a process
# that forwards the array needs one to export.  Closed when the segment's anchor dies.
_kept_lock = threading.Lock()
_kept: dict[str, int] = {}


def _drop_kept(key: str, fd: int) -> None:
    with _kept_lock:
        if _kept.get(key) == fd:
            del _kept[key]
    try:
        os.close(fd)
    except OSError:
        pass


def _memfd_of(seg: _segments.Segment) -> int | None:
    if seg.fd is not None:
        return seg.fd
    with _kept_lock:
        return _kept.get(seg.key)


def _plain(a: np.ndarray) -> tuple[Any, ...]:
    return cast("tuple[Any, ...]", a.__reduce_ex__(5))  # a tuple


def serialize(a: np.ndarray) -> tuple[Any, ...]:
    """Ray's serializer for ``np.ndarray``: ``("s", handle, pin[, numpy's own reduction])``
    for a shared array this process can export (the reduction where it must carry its
    bytes, see ``_exports.carry``), else ``("p", numpy's own reduction)``."""
    seg = _segments.segment_of(a) if a.base is not None else None
    if seg is not None:
        exported = export(a, seg)
        if exported is not None:
            return (*exported, _plain(a)) if _exports.carry() else exported
    return ("p", _plain(a))


def export(a: np.ndarray, seg: _segments.Segment) -> tuple[str, Handle, Pin] | None:
    """Hold ``seg`` for as long as Ray references the returned handle's pin; None when this
    process cannot hand ``seg`` on by reference (Ray not connected, no memfd kept).

    Serializations of one segment within ``_exports.GRACE`` of each other share one export
    and one pin: it then lives while any Ray object holding any of them does."""
    import ray
    if not ray.is_initialized():
        return None
    memfd = _memfd_of(seg) if seg.kind == FD else None
    if seg.kind == FD and memfd is None:
        return None
    ident = (seg.table_id, seg.slot, seg.key)
    # (pin, export) or (None, None): export is made below when pin is None
    pin, export = cast("tuple[Pin | None, _exports.Export]", _exports.reuse(ident))
    if pin is None:
        fds = [ofd_lease.inflight_fd(seg.table_id, [seg.slot])]
        try:
            if memfd is not None:
                fds.append(os.dup(memfd))
            pin = _exports.new_pin()
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        export = _exports.Export(fds)
        _exports.add(pin, export, ident)
    lease = export.fds[0]
    ctx = ray.get_runtime_context()
    handle = Handle(_host.host_id(), ctx.get_node_id(), os.getpid(), lease,
                     export.fds[1] if memfd is not None else -1, seg.key, seg.kind, seg.size,
                     seg.table_id, seg.slot,
                     a.__array_interface__["data"][0] - seg.address, a.shape, a.strides,
                     a.dtype, a.flags.writeable)
    return ("s", handle, pin)


def attach(h: Handle) -> np.ndarray:
    """A view of the handle's memory in this process, holding its lease (same host only)."""
    lease_src = _host.open_peer_fd(h.pid, h.lease_fd, f"{posix_shm.PREFIX}_{h.table_id}_lease")
    mapfd = None
    try:
        if h.kind == FD:
            mapfd = _host.open_peer_fd(h.pid, h.seg_fd, f"memfd:{_segments.file_of(h.key)[0]}")
        anchor, took = _segments.receive(h.key, h.kind, h.size, h.table_id, h.slot, mapfd,
                                         lease_src)
    except BaseException:
        if mapfd is not None:
            os.close(mapfd)
        raise
    finally:
        os.close(lease_src)
    if mapfd is not None and not took:
        seg = _segments.segment_of(anchor)
        keep = seg is not None and seg.fd is None
        if keep:
            with _kept_lock:
                keep = h.key not in _kept
                if keep:
                    _kept[h.key] = mapfd
        if keep:
            weakref.finalize(anchor, _drop_kept, h.key, mapfd).atexit = False
        else:
            os.close(mapfd)
    out: np.ndarray = np.ndarray(h.shape, h.dtype, anchor, h.offset, h.strides)
    if not h.writeable:
        out.flags.writeable = False
    return out


def rebuild(h: Handle, carried: Callable[[], np.ndarray] | None = None) -> np.ndarray:
    """The array a handle stands for: a view on the sender's host, else a copy by value
    (of the bytes the payload carried, or from the agent of the sender's node)."""
    if h.host == _host.host_id():
        try:
            return attach(h)
        except _host.NotReachable:
            pass  # same host by its identity, but not by /proc: by value
        except _host.SenderGone as e:
            if carried is None:
                raise _host.SenderGone(
                    f"shmtensor.ray: the array sent by pid {h.pid} cannot be attached: {e}.  "
                    "A shared array sent through Ray stays reachable while its sender lives "
                    "(as a Ray object whose owner died is lost): keep the sending actor "
                    "alive until receivers have it, or send a copy (np.array(a))") from None
    out = _alloc.empty(h.shape, h.dtype)
    if carried is not None:
        np.copyto(out, carried())
    else:
        _agent.fetch_into(h.node_id, h, out)
    if not h.writeable:
        out.flags.writeable = False
    return out


deserialize = _exports.deserializer(rebuild)  # Ray's deserializer: by value, or rebuild()
