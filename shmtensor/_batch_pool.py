"""Batch pools: a fixed set of shared slots that a producer fills again and again.

A data-loader worker makes batches of one shape over and over.  ``BatchPool`` gives it
``slots`` shared arrays of that shape, made once: ``acquire()`` returns a slot that no
process holds any more (the consumer dropped every view of the batch it got from it), and
waits when all slots are out: back-pressure, and zero new segments per batch in steady
state.  A slot is free again exactly when the lease protocol says so, including when the
consumer that held it has died.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Literal, cast

import numpy as np
from numpy.typing import DTypeLike

from shmtensor.ipc import ofd_lease, procfs

from . import _log, _segments, _strategy

__all__ = ["BatchPool"]


class BatchPool:
    """``slots`` reusable shared arrays of one ``shape`` and ``dtype``, for a producer that
    fills batches of one shape again and again (a data-loader worker).

    :meth:`acquire` returns a slot no process holds any more (every view of the batch sent
    from it is gone, including in a consumer that died), and waits while all are out:
    back-pressure, and no new segment per batch.  Make the pool in the process that fills
    it; send the arrays it hands out on shmtensor's queues, which send them as handles.

    :param shape: the shape of every batch (an int or a tuple of ints).
    :param dtype: their dtype (anything :class:`numpy.dtype` takes, without Python
        objects).
    :param slots: how many batches may be out at once, an int >= 1.
    :param order: ``"C"`` or ``"F"``, the memory layout of each batch.
    :raises TypeError: ``slots`` is not an int, or ``dtype`` holds Python objects.
    :raises ValueError: ``slots < 1``, a bad ``order``, or a bad sharing strategy setting.
    :raises ShmSpaceError: /dev/shm (or memory) cannot hold ``slots`` batches.

    Example::

        >>> import shmtensor, shmtensor.multiprocessing as smp
        >>> q = smp.SimpleQueue()
        >>> with shmtensor.BatchPool((32, 3), "float32", slots=2) as pool:
        ...     batch = pool.acquire()
        ...     batch[:] = 1.0
        ...     q.put(batch)       # crosses as a handle: no copy
        ...     del batch          # the slot is free once the consumer drops it too
        ...     float(q.get().sum())
        96.0
        >>> q.close()
    """

    def __init__(self, shape: int | Sequence[int], dtype: DTypeLike = np.float32,
                 slots: int = 4, order: Literal["C", "F"] = "C") -> None:
        from ._alloc import _shape
        if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)):
            raise TypeError(f"slots is a number of batch slots, an int >= 1; got "
                            f"{type(slots).__name__} {slots!r}")
        if slots < 1:
            raise ValueError(f"a BatchPool needs at least one slot, got slots={slots}")
        if order not in ("C", "F"):
            raise ValueError(f"order must be 'C' or 'F', got {order!r}")
        self.shape, self.dtype, self.order = _shape(shape), np.dtype(dtype), order
        if self.dtype.hasobject:
            raise TypeError(f"dtype {self.dtype} holds Python objects, which cannot live in "
                            "shared memory: use a numeric or structured dtype without objects")
        nbytes = self.dtype.itemsize * int(np.prod(self.shape, dtype=np.int64))
        kind = _strategy.get_sharing_strategy()
        # one file for every slot (one fd, one mapping per slot), one lease per slot
        self._segments = _segments.acquire_many(nbytes, kind, slots)
        self._next = 0
        self._pid = os.getpid()
        self._warned = False  # acquire() warned that it waits

    @property
    def slots(self) -> int:
        """How many slots the pool has (0 once closed)."""
        return len(self._segments)

    def _free(self, seg: _segments.Segment) -> bool:
        return not seg.alive() and not _segments.held_anywhere(ofd_lease.own_table(), seg.slot)

    def try_acquire(self) -> np.ndarray | None:
        """A free slot, without waiting.

        :returns: the slot as an array (holding its old contents), or None when every
            slot is out.
        :raises ValueError: the pool is closed.
        :raises RuntimeError: called in a process other than the one that made the pool."""
        if not self._segments:
            raise ValueError("this BatchPool is closed")
        if os.getpid() != self._pid:
            raise RuntimeError("this BatchPool was made in another process (pid "
                               f"{self._pid}): create the BatchPool inside the worker that "
                               "fills it")
        n = len(self._segments)
        for i in range(n):
            seg = self._segments[(self._next + i) % n]
            if self._free(seg):
                self._next = (self._next + i + 1) % n
                # the cast: numpy's stubs give the ndarray constructor's result as Any
                return cast("np.ndarray", np.ndarray(self.shape, self.dtype, buffer=seg.anchor(),
                                                     order=self.order))
        return None

    def acquire(self, timeout: float | None = None, *,
                warn_after: float | None = 5.0) -> np.ndarray:
        """A free slot as an array (holding its old contents), waiting while every slot is
        out (polling the slots' leases 0.1 ms to 5 ms apart).

        :param timeout: seconds to wait; None (the default) waits forever.
        :param warn_after: seconds of waiting after which the ``shmtensor`` logger warns,
            once per pool, how many slots this process's views hold, how many other
            processes hold, and which processes map the pool; None never warns.
        :returns: the slot's array.
        :raises TimeoutError: ``timeout`` passed with every slot still out.
        :raises ValueError: the pool is closed.
        :raises RuntimeError: called in a process other than the one that made the pool."""
        a = self.try_acquire()
        if a is not None:
            return a
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        warn_at = None if warn_after is None or self._warned else start + warn_after
        delay = 1e-4
        while True:
            time.sleep(delay)
            delay = min(delay * 2, 5e-3)
            a = self.try_acquire()
            if a is not None:
                return a
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(
                    f"all {self.slots} slots of this BatchPool are still held after {timeout}s "
                    f"({self._holders()}): the consumer keeps references to old batches (drop "
                    "them), or give the pool more slots")
            if warn_at is not None and now >= warn_at:
                warn_at, self._warned = None, True
                _log.warning(
                    "shmtensor: BatchPool.acquire() has waited %.1fs for a free slot: all %d "
                    "slots are out (%s). A slot is free once every view of its batch is gone: "
                    "the consumer keeps old batches (drop them, or copy what it keeps), or give "
                    "the pool more slots. acquire() goes on waiting; this is said once per "
                    "pool.", now - start, self.slots, self._holders())

    def _holders(self) -> str:
        """Who holds the slots, for a message: this process's views, other processes' holds,
        and the processes that map the pool (a mapping may outlive a hold: a receiver keeps
        idle segments mapped for reuse)."""
        table = ofd_lease.own_table()
        here = sum(1 for seg in self._segments if seg.alive())
        elsewhere = sum(1 for seg in self._segments
                        if not seg.alive() and _segments.held_anywhere(table, seg.slot))
        name = _segments.file_of(self._segments[0].key)[0] if self._segments else None
        try:
            use = procfs.scan().get(name) if name is not None else None
        except OSError:
            use = None
        pids = sorted((use.mapped_by | use.fd_held_by) - {os.getpid()}) if use else []
        mapped = (f"processes mapping it: {', '.join(map(str, pids))}" if pids
                  else "no other process maps it")
        return (f"{here} held by views in this process (pid {os.getpid()}), {elsewhere} "
                f"by other processes; {mapped}")

    def close(self) -> None:
        """Give the slots back for reuse as ordinary segments; views still alive stay valid.
        Closing twice does nothing.  ``with BatchPool(...) as pool:`` closes on exit."""
        segs, self._segments = self._segments, []
        for seg in segs:
            _segments.unpin(seg)

    def __enter__(self) -> "BatchPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"BatchPool(shape={self.shape}, dtype={self.dtype}, slots={self.slots})"
