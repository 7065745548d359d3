"""``ProcessPoolExecutor`` whose task arguments and results both cross through shared memory.

The stdlib's executor takes its result queue from its context (``mp_context.SimpleQueue()``,
shmtensor's when given shmtensor's context) but makes its call queue itself: a
``multiprocessing.queues.Queue`` subclass on a pipe (``_SafeQueue``), so task arguments
would be pickled by value.  :func:`adopt_call_queue` turns that queue, before its first
use, into a shmtensor queue with the same hook: an argument that cannot be pickled, or a
send that fails (no fd left, ...), fails its own future and the executor goes on, as in the
stdlib.  :class:`ProcessPoolExecutor` adopts its queue when it is made; a shmtensor
context's ``Process`` adopts the queue of a stdlib executor given that context (the
executor starts its first worker before it queues any call), so
``concurrent.futures.ProcessPoolExecutor(mp_context=ctx)`` is whole too.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import process as _cfp
from multiprocessing.context import BaseContext
from typing import Any

from ._queues import _on_channel, _ShmQueue

__all__ = ["ProcessPoolExecutor", "adopt_call_queue"]


class _CallQueue(_ShmQueue, _cfp._SafeQueue):
    """The executor's call queue on shmtensor's channel.  Every failure is the failure of
    one call: its future gets the exception (``_SafeQueue``'s hook), so nothing is left
    for a later ``put`` or ``close`` to raise in the executor's manager thread."""

    _keep_objects = True       # a send that fails must find its call item's future
    _raise_later = False       # ... and is reported there, not by the next put()

    def put(self, obj: object, block: bool = True, timeout: float | None = None) -> None:
        try:
            super().put(obj, block, timeout)
        except (OSError, MemoryError) as e:  # no fd or shared memory for an argument
            if not isinstance(obj, _cfp._CallItem):
                raise
            self._on_queue_feeder_error(e, obj)


def adopt_call_queue(queue: object) -> bool:
    """Make a stdlib executor's call queue (``_SafeQueue``) shmtensor's, in place, if it has
    not been used yet: the same object (the executor and its manager thread hold it) with
    a socket instead of its pipe.  Rarely needed by hand: :class:`ProcessPoolExecutor`,
    and a shmtensor context given to the stdlib's executor, call it.

    :param queue: an executor's ``_call_queue``.
    :returns: True if ``queue`` is (now) a shmtensor call queue; False if it is another
        kind of queue, or was used or closed already (it is then left as it was)."""
    if type(queue) is _CallQueue:
        return True
    q: Any = queue  # the stdlib queue's private attributes, which typeshed does not list
    if type(queue) is not _cfp._SafeQueue or q._thread is not None or q._closed:
        return False
    q.__class__ = _CallQueue
    _on_channel(q)
    return True


class ProcessPoolExecutor(_cfp.ProcessPoolExecutor):
    """``concurrent.futures.ProcessPoolExecutor`` on shmtensor's queues: an array argument
    or result crosses through shared memory (a shared array comes back as the same memory).

    The arguments are the stdlib's; ``mp_context`` defaults to shmtensor's context for the
    default start method (for spawn when ``max_tasks_per_child`` is given, as in the
    stdlib).  A worker that dies breaks the executor with ``BrokenProcessPool``, as in
    the stdlib.  For asyncio, ``loop.run_in_executor(executor, fn, *args)`` awaits a call.

    :param max_workers: the number of workers (default: the CPUs available).
    :param mp_context: a start method's context; a stdlib one works too (its result queue
        then carries arrays by value).
    :param initializer: called as ``initializer(*initargs)`` in each worker as it starts.
    :param initargs: its arguments.
    :param max_tasks_per_child: tasks a worker runs before it is replaced (None: no limit).

    Example::

        >>> import numpy as np
        >>> from shmtensor.futures import ProcessPoolExecutor
        >>> with ProcessPoolExecutor(2) as ex:
        ...     float(ex.submit(np.sum, np.ones(1 << 20)).result())
        1048576.0
    """

    def __init__(self, max_workers: int | None = None,
                 mp_context: BaseContext | None = None,
                 initializer: Callable[..., object] | None = None,
                 initargs: tuple[Any, ...] = (), *,
                 max_tasks_per_child: int | None = None) -> None:
        from .multiprocessing import get_context
        if mp_context is None:
            mp_context = get_context("spawn" if max_tasks_per_child is not None else None)
        more = {} if max_tasks_per_child is None else {"max_tasks_per_child": max_tasks_per_child}
        super().__init__(max_workers, mp_context, initializer, initargs, **more)
        adopt_call_queue(vars(self)["_call_queue"])  # private: typeshed does not list it
