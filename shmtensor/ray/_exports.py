"""Exports: this process's holds on memory it handed to Ray, one per Ray *pin*.

Each array serialized for Ray gets a pin: a tiny Ray object (``ray.put(None)``) owned by
this process and carried inside the serialized form.  Ray counts references to the pin
exactly as to the object that contains it (a ``ray.put`` result, a task's argument or
return value, borrowers in other workers, other objects that contain it), and drops it
when the last one is gone.  While the pin lives, this process keeps the export: an open
lease description (the memory's slot read-locked, so its creator cannot reuse it) and, for
a memfd segment, a duplicate of the memfd (how receivers on this host reach it, through
``/proc/PID/fd``).  When Ray says the pin went out of scope
(``add_object_out_of_scope_callback``; with an older Ray, a thread polls this process's
reference table) the export is closed; if this process dies, the kernel closes it.  For
``GRACE`` after its serialization the export keeps a reference to its pin itself (see
there), and the pins are made ahead by a helper thread (``ray.put`` costs ~1 ms).

A CUDA export also keeps the CuPy memory itself, and a lease slot that receivers hold
while they map it: after its pin is gone it *drains* until no receiver holds the slot.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Hashable
from functools import partial
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

from shmtensor.ipc import ofd_lease

if TYPE_CHECKING:
    from ray import ObjectRef

    Pin = ObjectRef[None]  # a ray.put(None): see the module docstring

POLL_MIN = 0.02
POLL_MAX = 0.5
# How long an export keeps its own reference to its pin.  Between the end of the
# serialization and Ray registering what it produced (a task's submitted arguments), a pin
# can be absent from the reference table (seen under a two-node cluster): a new pin is not
# judged by the table until this much time has passed.
GRACE = 1.0
USE_CALLBACK = True  # False: poll even where Ray offers the callback (tests the fallback)


class Export:
    """What one pin keeps alive here: fds to close, an object to keep, a slot receivers
    may hold after the pin is gone (then kept until nobody holds it)."""

    __slots__ = ("fds", "keep", "slot", "done", "pin", "until", "watched", "ident")

    def __init__(self, fds: list[int], keep: object = None, slot: int | None = None,
                 done: Callable[[], object] | None = None) -> None:
        self.fds, self.keep, self.slot, self.done = fds, keep, slot, done
        self.pin: Pin | None = None  # our own reference to the pin during GRACE (see add)
        self.until = 0.0
        self.watched = False  # Ray calls us back when the pin goes (else: polled)
        # what it exports, when serializations of it share it (reuse)
        self.ident: Hashable | None = None

    def finish(self) -> None:
        """Let go of the kept object (the memory returns to its allocator)."""
        self.keep = None
        done, self.done = self.done, None
        if done is not None:
            done()


_lock = threading.Lock()
_live: dict[bytes, Export] = {}    # pin id (hex, as Ray's reference table keys it) -> export
_draining: list[Export] = []       # pins gone, slot still held by a receiver
_thread: threading.Thread | None = None
_wake = threading.Event()


# Pins made ahead of need by a helper thread: ``ray.put`` costs ~1 ms (a round trip to the
# object store), which would otherwise be paid in every serialization.
PINS_AHEAD = 4
_pins: list[Pin] = []          # ready pins, all of one Ray session
_pins_session: list[object] = [None]
_pin_wake = threading.Event()
_pin_thread: threading.Thread | None = None


def _session() -> object:
    """This process's connection to Ray (its core worker), None when there is none."""
    from ray._private import worker
    return getattr(worker.global_worker, "core_worker", None)


def new_pin() -> Pin:
    """A fresh ObjectRef owned by this process, to stand for one serialization."""
    global _pin_thread
    import ray
    session = _session()
    pin = None
    with _lock:
        if _pins_session[0] is session and _pins:
            pin = _pins.pop()
        if _pin_thread is None:
            _pin_thread = threading.Thread(target=_make_pins, daemon=True,
                                           name="shmtensor-ray-pins")
            _pin_thread.start()
    _pin_wake.set()
    return pin if pin is not None else ray.put(None)


def _make_pins() -> None:
    """Keep PINS_AHEAD pins ready (under Ray's connect/shutdown lock, never waited for)."""
    global _pin_thread
    import ray
    while True:
        if not _pin_wake.wait(5.0):
            with _lock:
                _pin_thread = None
            return
        _pin_wake.clear()
        while True:
            lock = _ray_lock()
            if lock is not None and not lock.acquire(blocking=False):
                break
            try:
                if not ray.is_initialized():
                    stale = None
                    with _lock:
                        stale, _pins[:] = list(_pins), []
                    del stale
                    break
                session = _session()
                with _lock:
                    if _pins_session[0] is not session:
                        stale, _pins[:] = list(_pins), []
                        _pins_session[0] = session
                    if len(_pins) >= PINS_AHEAD:
                        break
                try:
                    pin = ray.put(None)
                except Exception:
                    break
                with _lock:
                    if _pins_session[0] is session:
                        _pins.append(pin)
            finally:
                if lock is not None:
                    lock.release()


_by_ident: dict[Hashable, Export] = {}  # exports open to reuse (their pin still ours)


def reuse(ident: Hashable) -> tuple[Pin, Export] | tuple[None, None]:
    """``(pin, export)`` of a live export of ``ident`` whose pin this process still holds
    (within GRACE of its last use; the grace starts again), else ``(None, None)``."""
    with _lock:
        e = _by_ident.get(ident)
        if e is None or e.pin is None or not e.fds:
            return None, None
        e.until = time.monotonic() + GRACE
        return e.pin, e


def add(pin: Pin, export: Export, ident: Hashable | None = None) -> None:
    """Keep ``export`` while Ray references ``pin`` (an ObjectRef this process owns);
    with ``ident``, later serializations of the same thing may share it (:func:`reuse`)."""
    global _thread
    pin_key = pin.hex().encode()
    export.pin, export.until = pin, time.monotonic() + GRACE
    with _lock:
        _live[pin_key] = export
        if ident is not None:
            export.ident = ident
            _by_ident[ident] = export
        if _thread is None:
            _thread = threading.Thread(target=_poll, daemon=True, name="shmtensor-ray-exports")
            _thread.start()
    from ray._private import worker
    # core_worker: set on the worker as it connects, not declared on its class
    watch = getattr(worker.global_worker.core_worker,  # type: ignore[attr-defined]
                    "add_object_out_of_scope_callback", None)
    if watch is not None and USE_CALLBACK:  # told, not polled (our reference holds it now)
        export.watched = bool(watch(pin, partial(_out_of_scope, pin_key)))


def _out_of_scope(pin_key: bytes, _object_id: bytes) -> None:
    """Ray's callback (its own thread): every reference to the pin is gone."""
    with _lock:
        export = _live.pop(pin_key, None)
    if export is not None and not _close(export):
        with _lock:
            _draining.append(export)


def count() -> int:
    with _lock:
        return len(_live) + len(_draining)


_BUSY: set[bytes] = set()  # a sentinel, compared by identity: ask again later


def _ray_lock() -> threading.RLock | None:
    """Ray's connect/shutdown lock, where this Ray has one."""
    from ray._private import worker
    return cast("threading.RLock | None", getattr(worker, "_connect_or_shutdown_lock", None))


def _judge() -> tuple[list[bytes], set[bytes] | None]:
    """Ends the grace of pins past it and lists the pins to judge, then reads Ray's
    reference table (None: Ray is gone; ``_BUSY``: it is connecting or shutting down).

    Both under Ray's own connect/shutdown lock, taken without waiting: Ray's core worker
    ends the process when asked anything, or when an ObjectRef is dropped, while it shuts
    down."""
    from ray._private import worker
    lock = _ray_lock()
    if lock is not None and not lock.acquire(blocking=False):
        return [], _BUSY
    try:
        now = time.monotonic()
        dropped: list[Pin] = []
        candidates: list[bytes] = []
        with _lock:  # listed before Ray's table is read: a pin added meanwhile is not judged
            for key, e in _live.items():
                if e.pin is None:
                    candidates.append(key)  # a watched one only counts once Ray is gone
                elif now > e.until:
                    dropped.append(e.pin)  # from the next poll on, Ray's table decides
                    e.pin = None
                    if e.ident is not None and _by_ident.get(e.ident) is e:
                        del _by_ident[e.ident]  # not ours to nest any more
        del dropped  # the ObjectRefs go here, under Ray's lock, outside ours
        w = worker.global_worker
        if not w.connected:
            return candidates, None
        with _lock:
            candidates = [k for k in candidates if k in _live and not _live[k].watched]
        if not candidates:
            return [], set()
        try:
            return candidates, set(
                w.core_worker.get_all_reference_counts())  # type: ignore[attr-defined]  # see add
        except Exception:  # disconnected meanwhile
            return candidates, None
    finally:
        if lock is not None:
            lock.release()


def _close(export: Export) -> bool:
    """Close the export's fds; True when it is finished (nothing left to drain)."""
    with _lock:
        if export.ident is not None and _by_ident.get(export.ident) is export:
            del _by_ident[export.ident]
    for fd in export.fds:
        try:
            os.close(fd)
        except OSError:
            pass
    export.fds = []
    if export.slot is None:
        export.finish()
        return True
    return False


def release_gone() -> int:
    """One poll: let go of the exports whose pins Ray no longer has; returns how many."""
    candidates, keys = _judge()
    if keys is _BUSY:
        return 0
    released = []
    with _lock:
        for key in candidates:
            if (keys is None or key not in keys) and key in _live:
                released.append(_live.pop(key))
    for export in released:
        if not _close(export):
            with _lock:
                _draining.append(export)
    if _draining:
        table = ofd_lease.own_table()
        with _lock:
            # a draining export has a slot (see _close)
            still = [e for e in _draining if table.is_held(cast(int, e.slot))]
            done = [e for e in _draining if not table.is_held(cast(int, e.slot))]
            _draining[:] = still
        for e in done:
            e.finish()
    return len(released)


def _poll() -> None:
    """Ends pins' grace, releases what Ray no longer references (where Ray does not call
    back), drains CUDA exports; exits when nothing is held (``add`` starts it again)."""
    global _thread
    delay = POLL_MIN
    while True:
        _wake.wait(delay)
        _wake.clear()
        try:
            released = release_gone()
        except Exception:
            if sys.is_finalizing():
                return
            released = 0  # a failed poll must not strand the exports: try again later
        delay = POLL_MIN if released else min(POLL_MAX, delay * 2)
        with _lock:
            if not _live and not _draining:
                _thread = None
                return


def _after_fork_in_child() -> None:
    """The parent's exports are the parent's: the child closes its copies of their fds
    (the descriptions, and so the locks, stay open in the parent)."""
    global _lock, _thread, _pin_thread
    _lock = threading.Lock()
    _thread = _pin_thread = None
    _pins.clear()
    _by_ident.clear()
    for e in list(_live.values()) + _draining:
        for fd in e.fds:
            try:
                os.close(fd)
            except OSError:
                pass
    _live.clear()
    _draining.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def wait_released(timeout: float) -> bool:
    """Poll until this process holds no export (tests, benchmarks); True when none is left."""
    deadline = time.monotonic() + timeout
    while count():
        release_gone()
        if not count():
            break
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_MIN)
    return True


# A task's result is owned by its caller.  When the result is a handle, the memory it
# names lives on the worker's node while Ray's object (the handle) lives elsewhere: Ray
# would neither see the memory lost with that node (so never re-run the task) nor keep
# the copy its prefetch made.  So a task's result made on a node other than the driver's
# *carries* the array's bytes besides the handle, as Ray's own serialized array (out of
# band, into the object store): Ray stores, moves, prefetches, spills and reconstructs it
# as a plain array, and a receiver on another host (or on the sender's, once the sender
# is gone) reads it from there.  On the driver's node nothing is carried: its death ends
# the job, and with it every owner of its objects.
#
# The owner of a result is its caller, which Ray does not tell a worker; the driver
# (every task's caller, unless tasks call tasks) stands for it.  Misjudging it where a
# task on another node calls a task on this one costs a copy, never data.
#
# Only results carry: a task's arguments and ray.put are owned by the process that
# serializes them (they die with it anyway).  Ray serializes a result in its compiled
# task loop (no Python frame of Ray's API below the serializer), arguments under
# remote_function/actor ``_remote`` (``_actor_method_call``), puts under
# ``worker.put_object``: seen from inside the serializer, those frames tell them apart.
# A Ray that renames them makes its arguments and puts carry too: a copy, never data.
_NOT_RESULTS = {("remote_function.py", "_remote"), ("actor.py", "_remote"),
                ("actor.py", "_actor_method_call"), ("worker.py", "put_object")}
_MAX_DEPTH = 64
_driver_nodes: dict[str, str | None] = {}  # job id -> the node of its driver (None: unknown)


def is_result() -> bool:
    """Whether the serialization under way in this thread is a task's result (see above)."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            break
        code = frame.f_code
        if (os.path.basename(code.co_filename), code.co_name) in _NOT_RESULTS:
            return False
        frame = frame.f_back
    return True


def driver_node(job: str) -> str | None:
    """The node id of job ``job``'s driver (Ray's job table, asked once), None if unknown."""
    if job not in _driver_nodes:
        from ray._private import worker
        node = None
        try:
            gcs: Any = getattr(worker.global_worker, "gcs_client")  # set as it connects
            jobs = gcs.get_all_job_info(
                job_or_submission_id=job, skip_submission_job_info_field=True,
                skip_is_running_tasks_field=True)
            for job_id, info in jobs.items():
                if job_id.hex() == job:
                    node = info.driver_address.node_id.hex() or None
        except Exception:
            pass  # unknown: results carry their bytes (a copy, never data)
        _driver_nodes[job] = node
    return _driver_nodes[job]


def carry() -> bool:
    """Whether a shared array serialized here, now, carries its bytes besides its handle:
    in a worker, for a task's result, off the driver's node (see above)."""
    import ray
    from ray._private import worker
    if getattr(worker.global_worker, "mode", None) != worker.WORKER_MODE:
        return False
    if not is_result():
        return False
    ctx = ray.get_runtime_context()
    return driver_node(ctx.get_job_id()) != ctx.get_node_id()


def from_reduction(red: tuple[Any, ...]) -> Any:
    """The object a ``__reduce_ex__`` tuple stands for."""
    obj = red[0](*red[1])
    if len(red) > 2 and red[2] is not None:
        obj.__setstate__(red[2])
    return obj


def deserializer(rebuild: Callable[[Any, Callable[[], Any] | None], object]
                 ) -> Callable[[tuple[Any, ...]], object]:
    """Ray's deserializer for a payload ``("p", reduction)`` (by value) or ``("s", handle,
    pin[, reduction])``: ``rebuild(handle, carried)``, where ``carried()`` gives the bytes
    the payload carries (its array by value, see :func:`carry`), or is None."""
    def deserialize(payload: tuple[Any, ...]) -> object:
        if payload[0] == "p":
            return from_reduction(payload[1])
        red = payload[3] if len(payload) > 3 else None
        return rebuild(payload[1], None if red is None else partial(from_reduction, red))
    return deserialize
