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

import multiprocessing as _mp
from multiprocessing import *  # noqa: F401,F403 - the drop-in re-exports every name
from multiprocessing import __all__ as _mp_all

from .._strategy import (get_all_sharing_strategies, get_sharing_strategy,
                         set_sharing_strategy)
from . import _managers  # noqa: F401 - registers the "shmtensor" serializer
from ._context import (ForkContext, ForkServerContext, Process, SpawnContext,
                       get_context)
from .._reductions import RemoteError
from ._spawn import (ProcessContext, ProcessException, ProcessExitedException,
                     ProcessRaisedException, ProcessTimeoutError, spawn, start_processes)

__all__ = sorted(set(_mp_all) | {
    "get_context", "set_sharing_strategy", "get_sharing_strategy",
    "get_all_sharing_strategies", "ForkContext", "SpawnContext", "ForkServerContext",
    "spawn", "start_processes", "ProcessContext", "ProcessException", "ProcessRaisedException",
    "ProcessExitedException", "ProcessTimeoutError", "WorkerLostError", "RemoteError"})


def __getattr__(name: str):
    # the pool's module (and concurrent.futures under it) loads with the first pool, so a
    # spawned child that never makes one does not import it
    if name == "WorkerLostError":
        from ._pool import WorkerLostError
        return WorkerLostError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def Queue(maxsize: int = 0):
    """A ``multiprocessing.Queue`` that moves arrays through shared memory."""
    return get_context().Queue(maxsize)


def JoinableQueue(maxsize: int = 0):
    return get_context().JoinableQueue(maxsize)


def SimpleQueue():
    return get_context().SimpleQueue()


def Pipe(duplex: bool = True):
    return get_context().Pipe(duplex)


def Pool(processes=None, initializer=None, initargs=(), maxtasksperchild=None):
    return get_context().Pool(processes, initializer, initargs, maxtasksperchild)


def Manager():
    return get_context().Manager()


del _mp
