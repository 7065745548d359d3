"""Interprocess CUDA events: ordering a receiver's stream after a sender's work, and
:class:`IpcEvent`, the events users send themselves.

Each send records one event of a per-device *ring* on the sender's current stream and
carries its handle; the receiver's stream waits on it (the host never waits).  Re-recording
an event another process is still waiting on costs ~0.1 ms per send, so the ring keeps
``RING`` of them apart.  A receiver opens each sender's ring event once and keeps up to
``RING_OPENED_LIMIT`` of them, closing the oldest first.

An event a user sends crosses by its IPC handle, which must be asked under the context of
the event's device: asked under another, the driver (580) crashes the process, and no call
names an event's context.  So from the moment CuPy is imported (or shmtensor, if CuPy came
first) every ``cupy.cuda.Event`` records the device it was made on (:func:`record_devices`).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, cast

from shmtensor.ipc import cuda_ipc

from .. import _wire
from . import _device

RING = 64
RING_OPENED_LIMIT = 4096


class _Events:
    """Owner of this process's ring events and of the events it opened; one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # device -> [(event, handle)], up to RING
        self.rings: dict[int, list[tuple[Any, bytes]]] = {}
        self.next: dict[int, int] = {}     # device -> ring index to record next
        self.own: dict[bytes, Any] = {}    # handle -> this process's ring event
        self.opened: "OrderedDict[bytes, int]" = OrderedDict()  # others' ring events, LRU
        self.user: dict[bytes, int] = {}   # handle -> opened pointer (IpcEvent objects)


_ev = _Events()


def order(cp: Any, device: int) -> bytes | None:
    """Order the current stream's queued work before the receiver's use: the handle of a
    ring event recorded on it (or None after synchronizing the stream, when no interprocess
    event is to be had).  Once per message and stream."""
    stream = cp.cuda.get_current_stream()
    memo = _wire.message_memo()
    key = ("cuda-order", device, stream.ptr)
    if key in memo:
        return cast("bytes | None", memo[key])
    handle = memo[key] = order_now(cp, device, stream)
    return handle


def order_now(cp: Any, device: int, stream: Any) -> bytes | None:
    """:func:`order` for a message that carries one array (no memo needed).  The event is
    recorded whether or not the stream has work queued: asking first (``stream.done``) costs
    as much as recording, and a stream that just made the array it sends is rarely idle."""
    e = _ev
    with e.lock:
        ring = e.rings.get(device)
        if ring is None:
            ring = e.rings[device] = []
        i = e.next.get(device, 0)
        if i >= len(ring):
            try:
                ev = cp.cuda.Event(block=False, disable_timing=True, interprocess=True)
                handle = bytes(cp.cuda.runtime.ipcGetEventHandle(ev.ptr))
                ring.append((ev, handle))
                e.own[handle] = ev
            except Exception:  # out of event resources: reuse what there is, or synchronize
                if not ring:
                    stream.synchronize()
                    return None
                i = 0
        ev, handle = ring[i]
        e.next[device] = (i + 1) % RING
    ev.record(stream)
    return handle


def wait_sent(cp: Any, event_handle: bytes, deferred: _wire.Deferred | None) -> None:
    """Make the current stream wait for the sender's ring event of a received array: once
    per message and stream (a pickled message's arrays, ``deferred`` given, share it), or
    at once (a one-array message, whose only wait this is)."""
    if deferred is None:
        stream_wait(cp, event_handle, cp.cuda.get_current_stream().ptr)
    else:
        wait(cp, event_handle)


def wait(cp: Any, event_handle: bytes) -> None:
    """Make the current stream wait for a sender's ring event (the host does not wait);
    once per message and stream."""
    memo = _wire.message_memo()
    stream = cp.cuda.get_current_stream().ptr
    key = ("cuda-wait", event_handle, stream)
    if key in memo:
        return
    memo[key] = True
    stream_wait(cp, event_handle, stream)


def stream_wait(cp: Any, event_handle: bytes, stream: int) -> None:
    """Make ``stream`` wait for a sender's ring event, unless its work is done already.

    Asking first (``eventQuery``, which does not wait) and waiting only when the work is
    still queued made a relay of small arrays ~18% faster on an H100: a consumer behind
    its producer mostly finds the work done, and a stream wait on another process's event
    costs more than the question.  (Either way the answer is about the event's latest
    record, which the ring keeps ``RING`` sends away from this message's.)"""
    e = _ev
    own = e.own.get(event_handle)
    if own is not None:  # sent to ourselves
        if cp.cuda.runtime.eventQuery(own.ptr) != 0:
            cp.cuda.runtime.streamWaitEvent(stream, own.ptr)
        return
    with e.lock:  # no other thread closes it between the lookup and the wait
        ev = e.opened.get(event_handle)
        if ev is None:
            ev = e.opened[event_handle] = cp.cuda.runtime.ipcOpenEventHandle(event_handle)
            if len(e.opened) > RING_OPENED_LIMIT:  # senders come and go: close the
                _, old = e.opened.popitem(last=False)  # first opened
                cp.cuda.runtime.eventDestroy(old)  # waits already queued on it complete
        if cp.cuda.runtime.eventQuery(ev) != 0:
            cp.cuda.runtime.streamWaitEvent(stream, ev)


def count() -> int:
    return len(_ev.own)


class IpcEvent:
    """An interprocess CUDA event received from another process."""

    def __init__(self, ptr: int, handle: bytes) -> None:
        self.ptr, self.handle = ptr, handle

    def record(self, stream: Any = None) -> None:
        """Record the event on ``stream`` (default: the current stream)."""
        cp = _device.cupy()
        stream = stream or cp.cuda.get_current_stream()
        cp.cuda.runtime.eventRecord(self.ptr, stream.ptr)

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (default: current) wait for the event; the host does not wait."""
        cp = _device.cupy()
        stream = stream or cp.cuda.get_current_stream()
        cp.cuda.runtime.streamWaitEvent(stream.ptr, self.ptr)

    def synchronize(self) -> None:
        """Block the host until the work the event marks is done."""
        _device.cupy().cuda.runtime.eventSynchronize(self.ptr)

    def query(self) -> bool:
        """True when the work the event marks is done (the host does not wait)."""
        return cast(int, _device.cupy().cuda.runtime.eventQuery(self.ptr)) == 0

    def __reduce__(self) -> tuple[Callable[[bytes], IpcEvent], tuple[bytes]]:
        return _rebuild_event, (self.handle,)


_wrap_lock = threading.Lock()


def record_devices(cp: Any) -> None:
    """Make every ``cupy.cuda.Event`` made from now on record its device (the current one,
    right after creation) as its ``_shmtensor_device``.  Idempotent, and no driver call (CUDA
    stays uninitialised).  A CuPy whose ``Event`` cannot take it (not a plain class with a
    ``__dict__``; a module named ``cupy`` that is not CuPy) is left as it is: its events are
    sent as events made before shmtensor (:func:`_device_of`)."""
    try:
        classes = {cp.cuda.Event, cp.cuda.stream.Event}
        get_device = cp.cuda.runtime.getDevice
    except AttributeError:
        return
    with _wrap_lock:
        for cls in classes:
            init = cls.__dict__.get("__init__") if isinstance(cls, type) else None
            if (init is None or not cls.__dictoffset__
                    or getattr(init, "_shmtensor_records_device", False)):
                continue
            try:
                cls.__init__ = _recording_device(init, get_device)
            except TypeError:  # an extension type's attributes are read-only
                pass


def _recording_device(init: Callable[..., None], get_device: Callable[[], int]
                      ) -> Callable[..., None]:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._shmtensor_device = get_device()

    cast(Any, __init__)._shmtensor_records_device = True  # the mark record_devices reads
    return __init__


def _device_of(ev: Any) -> int:
    """The device whose context ``ev`` is of: the one it recorded, else (an event made
    before shmtensor tagged CuPy's) the one GPU in use in this process.  With several in
    use, it cannot be told, and guessing wrong crashes the process: refused."""
    device: int | None = getattr(ev, "_shmtensor_device", None)
    if device is not None:
        return device
    active = cuda_ipc.active_devices()
    if len(active) == 1:
        return active[0]
    if not active:  # no context: the event is not a CuPy event of a primary context
        return cast(int, _device.cupy().cuda.runtime.getDevice())
    raise cuda_ipc.CudaIpcError(
        "cannot send this CUDA event: its device was not recorded (it was made before "
        f"`import shmtensor`), and this process uses several GPUs ({active}). "
        "Asked for the handle of another GPU's event, the CUDA driver crashes the process, "
        "so shmtensor does not guess. Make the event after `import shmtensor` (shmtensor "
        "then records the device of each event made), or make a new one in its place.")


def reduce_event(ev: Any) -> tuple[Callable[[bytes], IpcEvent], tuple[bytes]]:
    """An interprocess event's handle, asked under its device's context on any thread."""
    _device.cupy()  # the fork error, before any driver call
    device = _device_of(ev)
    try:
        handle = cuda_ipc.event_handle(ev.ptr, device)
    except cuda_ipc.CudaIpcError as e:
        raise ValueError("only events made with cupy.cuda.Event(interprocess=True, "
                         f"disable_timing=True) can cross processes ({e})") from e
    return _rebuild_event, (handle,)


def _rebuild_event(handle: bytes) -> IpcEvent:
    cp = _device.cupy()
    e = _ev
    with e.lock:
        ptr = e.user.get(handle)
        if ptr is None:
            ptr = e.user[handle] = cp.cuda.runtime.ipcOpenEventHandle(handle)
    return IpcEvent(ptr, handle)
