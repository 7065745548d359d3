"""``Pool``: the stdlib's process pool on shmtensor channels, that notices dead workers.

Tasks and results cross on shmtensor SimpleQueues (channels: a ring in shared memory), so
arrays go zero-copy; functions go by name as with the stdlib (a ``__main__`` function is
the worker's own, with its globals), and lambdas and closures, which the stdlib cannot
send, by value (cloudpickle).  The pool puts and gets on its queues (the stdlib's sends
and receives on their pipes' ends), and its worker handler waits on the change notifier
only (the stdlib's also wakes for every result, which nothing needs: an emptied cache
notifies).  A worker killed while it reads or writes a queue holds none of its locks
(the ring's are robust), so ``terminate()`` never waits on one.
A worker's exception is raised in the caller as itself, with the worker's traceback as
``__cause__``, or as a :class:`RemoteError` naming its type when that type cannot be
rebuilt here.

The stdlib's pool waits forever when a worker dies mid-task.  Here a watcher thread wakes
on every worker's exit (every worker the pool ever started, replacements included, until
the pool is terminated or closed and drained); a non-zero exit code while calls are
pending fails every pending call with :class:`WorkerLostError` (naming the pid and exit
code or signal) and marks the pool broken, so later calls fail at once too.  So does exit
code 0 while the pool runs without ``maxtasksperchild``: a worker then only leaves that way
when a task ends the process (``sys.exit()``, ``os._exit(0)``).  With ``maxtasksperchild``
such an exit looks like a worker retiring, and the call waits as in the stdlib.  A worker
that dies while the pool is idle is simply replaced by the stdlib's own worker handler.
"""

from __future__ import annotations

import signal
import threading
import time
import weakref
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import pool as _mpp
from multiprocessing.connection import wait
from queue import Empty
from typing import TYPE_CHECKING, Any, cast

from .. import _queues
from .._reductions import RemoteError

if TYPE_CHECKING:
    from collections.abc import Callable
    from multiprocessing.context import DefaultContext
    from multiprocessing.popen_fork import Popen
    from multiprocessing.process import BaseProcess
    from typing import Protocol

    from ._context import _ShmContext

    class _StdPool(_mpp.Pool):
        """The stdlib pool's private parts that this module uses (typeshed leaves them out)."""
        _ctx: _ShmContext  # the context that made the pool: see _ShmContext.Pool
        _state: str
        _cache: dict[int, Any]  # job -> its ApplyResult, MapResult or IMapIterator
        _processes: int
        _maxtasksperchild: int | None
        _inqueue: _queues.SimpleQueue
        _outqueue: _queues.SimpleQueue
        _change_notifier: _queues.SimpleQueue
        _quick_put: Callable[[object], None]
        _quick_get: Callable[[], object]

        def _check_running(self) -> None: ...

    class _PendingCall(Protocol):
        """A pending call of the stdlib's pool (ApplyResult, MapResult or IMapIterator):
        the private fields :func:`_fail` sets, each on the kind that has it."""
        _index: int               # IMapIterator
        _number_left: int         # MapResult, and below
        _success: bool
        _value: object
        _event: threading.Event
        _cache: dict[int, object]
        _job: int

        def _set(self, i: int, obj: tuple[bool, object]) -> None: ...
        def _set_length(self, length: int) -> None: ...  # IMapIterator

    class _Worker(BaseProcess):
        """A pool worker, with the stdlib's private popen (None until started), which
        typeshed leaves out."""
        _popen: Popen | None
else:
    _StdPool = _mpp.Pool

__all__ = ["Pool", "WorkerLostError", "RemoteError"]

class WorkerLostError(BrokenProcessPool):
    """A worker of a :func:`shmtensor.multiprocessing.Pool` died (a signal, ``os._exit``,
    a crash, running out of memory) while calls were pending.

    Raised by the ``get()`` of every call pending then, and by every later call on the
    pool, which is broken: close it and make a new one.  The message names the worker's
    pid and its exit code or signal.  A subclass of
    ``concurrent.futures.process.BrokenProcessPool``, so code that catches that for
    ``ProcessPoolExecutor`` catches this too."""


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"signal {-code} (exit code {code})"
    return f"exit code {code}"


def _fail(job: _PendingCall, err: BaseException) -> None:
    """Complete a pending call with ``err`` (in the watcher thread, while the result handler
    may be delivering a result to the same call)."""
    ready = getattr(job, "ready", None)
    if ready is not None and ready():
        return  # finished just before the crash was seen: keep its result
    try:
        if isinstance(job, _mpp.IMapIterator):  # its _set takes the iterator's lock
            job._set(job._index, (False, err))
            job._set_length(job._index)
        elif isinstance(job, _mpp.MapResult):
            # Not through _set: the result handler may be inside job._set, between its
            # decrement of _number_left and its test for 0, and setting the count under it
            # could leave the call never completed.  A result arriving now decrements a
            # count that cannot reach 0 again and finds the call failed.
            job._number_left = -(1 << 62)
            job._success = False
            job._value = err
            job._event.set()
            del job._cache[job._job]  # as _set does: an emptied cache tells the pool
        else:
            job._set(0, (False, err))
    except KeyError:  # the result handler completed it meanwhile
        pass


# Every worker each pool ever started, by the pool's task queue, so that a replacement that
# starts and dies between two looks of the watcher is still seen.
_workers: weakref.WeakKeyDictionary[object, list[_Worker]] = weakref.WeakKeyDictionary()


def _watch(pool_ref: weakref.ref[Pool], inqueue: object) -> None:
    """Wake on any worker's exit; a non-zero exit with calls pending breaks the pool."""
    try:
        _watch_loop(pool_ref, inqueue)
    finally:
        _workers.pop(inqueue, None)  # let the workers' Process objects (and fds) go


def _watch_loop(pool_ref: weakref.ref[Pool], inqueue: object) -> None:
    handled: set[int] = set()
    while True:
        pool = pool_ref()
        if pool is None or pool._state == _mpp.TERMINATE or pool._broken is not None:
            return
        if pool._state == _mpp.CLOSE and not pool._cache:
            return
        # recorded at creation: skip those not started yet
        workers = [w for w in _workers.get(inqueue, ()) if w._popen is not None]
        del pool  # wait without keeping the pool alive
        alive = [w.sentinel for w in workers if _exit_code(w) is None]
        try:
            if alive and wait(alive, timeout=0.2):
                time.sleep(0.02)  # an exit: let the pool's own thread read its code
            elif not alive:
                time.sleep(0.05)
        except (OSError, ValueError):  # a sentinel closed under us: look at exit codes
            time.sleep(0.05)
        pool = pool_ref()
        if pool is None:
            return
        for w in workers:
            code = _exit_code(w)
            if code is None or id(w) in handled:
                continue
            handled.add(id(w))
            if pool._cache and pool._state != _mpp.TERMINATE and (
                    code != 0 or _quit_early(pool)):
                pool._break(w.pid, code)
                return
        live = _workers.get(inqueue)
        if live is not None and len(live) > 2 * max(1, pool._processes):
            # forget the dead already looked at (never one this pass has not seen)
            live[:] = [w for w in live if id(w) not in handled]
            handled = set()
        del pool


def _exit_code(w: _Worker) -> int | None:
    """``w``'s exit code once the pool's own thread has read it (``_join_exited_workers``
    polls every worker ~10 times a second), without polling here: two threads polling one
    forkserver child race for the single status its sentinel carries, and the loser
    records exit code 255 over the real one (``popen_forkserver.Popen.poll``)."""
    return w._popen.returncode  # type: ignore[union-attr]  # a started one: it has a popen


def _quit_early(pool: Pool) -> bool:
    """A worker that exited 0 left mid-work: nothing retires a worker of a running pool
    without ``maxtasksperchild`` (close and terminate change the state first)."""
    return pool._state == _mpp.RUN and not pool._maxtasksperchild


class Pool(_StdPool):
    """``multiprocessing.Pool`` on shmtensor channels that fails fast when a worker dies
    (see :func:`shmtensor.multiprocessing.Pool`, which makes one)."""

    def _setup_queues(self) -> None:
        self._inqueue = self._ctx.SimpleQueue()
        self._outqueue = self._ctx.SimpleQueue()
        self._quick_put = self._inqueue.put
        self._quick_get = self._outqueue.get

    def _get_sentinels(self) -> list[Any]:
        return [self._change_notifier._reader]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._broken: WorkerLostError | None = None
        super().__init__(*args, **kwargs)
        self._watcher = threading.Thread(target=_watch, args=(weakref.ref(self), self._inqueue),
                                         daemon=True, name="shmtensor-pool-watcher")
        self._watcher.start()

    @staticmethod
    def Process(  # type: ignore[override]  # the context's own Process class, not only mp's
            ctx: DefaultContext | _ShmContext, *args: Any, **kwds: Any) -> BaseProcess:
        proc = cast("_Worker", ctx.Process(*args, **kwds))
        inqueue = kwds["args"][0] if "args" in kwds else None
        if inqueue is not None:
            _workers.setdefault(inqueue, []).append(proc)
        return proc

    @staticmethod
    def _help_stuff_finish(inqueue: _queues.SimpleQueue, task_handler: threading.Thread,
                           size: int) -> None:
        """The stdlib's: tasks dropped while the task handler may wait for room to put
        (their arrays let go of with them); the workers are terminated next."""
        while task_handler.is_alive():
            try:
                inqueue.get(timeout=0.05)  # a worker may hold the read lock a moment
            except Empty:
                if inqueue.empty():
                    return  # room to put: the task handler finishes by itself
            except Exception:  # a task that does not load, or was lost: dropped all the same
                pass
            time.sleep(0)

    def _break(self, pid: int | None, code: int) -> None:
        why = _describe(code) + (" (a task ended the process: sys.exit() or os._exit(0)?)"
                                 if code == 0 else "")
        err = WorkerLostError(
            f"pool worker pid {pid} died with {why} while {len(self._cache)} "
            "call(s) were pending: their results are lost and the pool is broken; close it "
            "and create a new Pool")
        self._broken = err
        for job in list(self._cache.values()):
            _fail(job, err)

    def _check_running(self) -> None:
        super()._check_running()
        if self._broken is not None:
            raise WorkerLostError(str(self._broken))
