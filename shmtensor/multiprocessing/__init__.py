"""Drop-in ``multiprocessing`` whose Queue, Pipe, Pool, Process and Manager carry numpy
arrays through shared memory.

Every public name of :mod:`multiprocessing` is here.  The channel factories and
:func:`get_context` return shmtensor's versions; everything else is the stdlib's own object.
Importing this module changes nothing the stdlib already had: code that keeps using the
stdlib's queues pickles exactly as before.  It adds one name, the ``"shmtensor"``
serializer of ``multiprocessing.managers.listener_client``, so that a proxy of
:func:`Manager` works in every process that imports this package (and, since the name
pickles as its own registration, in a child that never did).
"""

from __future__ import annotations

from typing import TYPE_CHECKING as _TYPE_CHECKING

import multiprocessing as _mp
from multiprocessing import *  # noqa: F401,F403 - the drop-in re-exports every name
from multiprocessing import __all__ as _mp_all

from .._strategy import (get_all_sharing_strategies, get_sharing_strategy,
                         set_sharing_strategy)
from . import _managers  # noqa: F401 - registers the "shmtensor" serializer
from . import _context
# the drop-in's own objects over the stdlib's of the same names (so typed differently)
from ._context import (ForkContext, ForkServerContext, SpawnContext)
from ._context import Process, get_context  # type: ignore[assignment]
from .._reductions import RemoteError
from ._spawn import (ProcessContext, ProcessException, ProcessExitedException,
                     ProcessRaisedException, ProcessTimeoutError, spawn, start_processes)

__all__ = sorted(set(_mp_all) | {
    "get_context", "set_sharing_strategy", "get_sharing_strategy",
    "get_all_sharing_strategies", "ForkContext", "SpawnContext", "ForkServerContext",
    "spawn", "start_processes", "ProcessContext", "ProcessException", "ProcessRaisedException",
    "ProcessExitedException", "ProcessTimeoutError", "WorkerLostError", "RemoteError"})


if _TYPE_CHECKING:  # names for annotations only: this module's namespace is multiprocessing's
    from collections.abc import Callable, Iterable
    from typing import Any

    from .. import _queues
    from .._connection import Connection
    from . import _pool
    from ._pool import WorkerLostError as WorkerLostError


def __getattr__(name: str) -> Any:
    # the pool's module (and concurrent.futures under it) loads with the first pool, so a
    # spawned child that never makes one does not import it
    if name == "WorkerLostError":
        from ._pool import WorkerLostError
        return WorkerLostError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


# The factories below replace the stdlib's of the same names, star-imported above (the
# no-redef ignores).
def Queue(maxsize: int = 0) -> _queues.Queue:  # type: ignore[no-redef]
    """A ``multiprocessing.Queue`` of the default context whose messages carry arrays
    through shared memory: a shared array crosses as a handle, a plain one is copied once
    (inline under the threshold).

    :param maxsize: the most items it holds before ``put`` blocks; 0 (the default) has no
        limit.
    :returns: the queue, with the stdlib queue's methods (``put``, ``get``, ``close``,
        ``join_thread``, ...).
    :raises ValueError: ``SHMTENSOR_RECEIVE_SPIN_US`` holds a bad value (the queue's
        reader is made with it).

    Example::

        >>> import shmtensor, shmtensor.multiprocessing as smp
        >>> q = smp.Queue()
        >>> q.put(shmtensor.ones(4))
        >>> q.get(timeout=10).tolist()
        [1.0, 1.0, 1.0, 1.0]
        >>> q.close(); q.join_thread()
    """
    return _context.get_context().Queue(maxsize)


def JoinableQueue(maxsize: int = 0) -> _queues.JoinableQueue:  # type: ignore[no-redef]
    """A :func:`Queue` with ``task_done()`` and ``join()``, as
    ``multiprocessing.JoinableQueue``.

    :param maxsize: the most items it holds before ``put`` blocks; 0 has no limit.
    :returns: the queue."""
    return _context.get_context().JoinableQueue(maxsize)


def SimpleQueue() -> _queues.SimpleQueue:  # type: ignore[no-redef]
    """A ``multiprocessing.SimpleQueue`` (no feeder thread, ``put`` sends at once) whose
    messages carry arrays through shared memory.

    :returns: the queue (``put``, ``get``, ``empty``, ``close``)."""
    return _context.get_context().SimpleQueue()


def Pipe(duplex: bool = True) -> tuple[Connection, Connection]:  # type: ignore[no-redef]
    """A pair of connected :class:`multiprocessing.connection.Connection` s whose
    ``send``/``recv`` carry arrays through shared memory, as ``multiprocessing.Pipe``.

    :param duplex: both ends send and receive (True, the default); with False the first
        end only receives and the second only sends.
    :returns: ``(conn1, conn2)``."""
    return _context.get_context().Pipe(duplex)


def Pool(  # type: ignore[no-redef]
        processes: int | None = None, initializer: Callable[..., object] | None = None,
        initargs: Iterable[Any] = (), maxtasksperchild: int | None = None) -> _pool.Pool:
    """A ``multiprocessing.Pool`` of the default context whose tasks and results carry
    arrays through shared memory, and that fails fast when a worker dies.

    Functions go by name as with the stdlib; lambdas and closures, which the stdlib cannot
    send, go by value (cloudpickle).  A worker's exception is raised in the caller as
    itself (or as :class:`RemoteError` when its type cannot be rebuilt there).

    :param processes: the number of workers (default: ``os.process_cpu_count()``).
    :param initializer: called as ``initializer(*initargs)`` in each worker as it starts.
    :param initargs: its arguments.
    :param maxtasksperchild: tasks a worker runs before it is replaced (None: no limit).
    :returns: the pool; use it as a context manager, or ``close()`` and ``join()`` it.
    :raises WorkerLostError: (from a pending call's ``get()``, and from later calls) a
        worker died while calls were pending.

    Example::

        >>> import shmtensor.multiprocessing as smp
        >>> with smp.Pool(2) as pool:
        ...     pool.map(abs, [-1, -2, 3])
        [1, 2, 3]
    """
    return _context.get_context().Pool(processes, initializer, initargs, maxtasksperchild)


def Manager() -> _managers.SyncManager:  # type: ignore[no-redef]
    """A started ``multiprocessing.managers.SyncManager`` whose connections carry arrays
    through shared memory (over AF_UNIX; over TCP they are pickled by value).

    :returns: the manager; ``shutdown()`` it, or use it as a context manager."""
    return _context.get_context().Manager()


del _mp
