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

import numpy as np

from shmtensor.ipc import ofd_lease

from . import _segments, _strategy

__all__ = ["BatchPool"]


class BatchPool:
    """``slots`` reusable shared arrays of one ``shape`` and ``dtype`` (see module docs)."""

    def __init__(self, shape, dtype=np.float32, slots: int = 4, order: str = "C") -> None:
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

    @property
    def slots(self) -> int:
        return len(self._segments)

    def _free(self, seg: _segments.Segment) -> bool:
        return not seg.alive() and not ofd_lease.own_table().is_held(seg.slot)

    def try_acquire(self) -> np.ndarray | None:
        """A free slot as an array (its old contents), or None when every slot is out."""
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
                return np.ndarray(self.shape, self.dtype, buffer=seg.anchor(), order=self.order)
        return None

    def acquire(self, timeout: float | None = None) -> np.ndarray:
        """A free slot, waiting (polling its lease, 0.1 ms to 5 ms apart) while all are out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 1e-4
        while True:
            a = self.try_acquire()
            if a is not None:
                return a
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"all {self.slots} slots of this BatchPool are still held after {timeout}s: "
                    "the consumer keeps references to old batches (drop them), or give the "
                    "pool more slots")
            time.sleep(delay)
            delay = min(delay * 2, 5e-3)

    def close(self) -> None:
        """Give the slots back for reuse as ordinary segments (views still alive stay valid)."""
        segs, self._segments = self._segments, []
        for seg in segs:
            _segments.unpin(seg)

    def __enter__(self) -> "BatchPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"BatchPool(shape={self.shape}, dtype={self.dtype}, slots={self.slots})"
