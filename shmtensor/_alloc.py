"""Arrays born in shared memory: plain ``numpy.ndarray`` objects whose memory is a segment."""

from __future__ import annotations

import operator

import numpy as np

from . import _recycler, _segments, _strategy

__all__ = ["empty", "zeros", "ones", "full", "empty_like", "zeros_like", "share_memory",
           "is_shared"]


def _shape(shape) -> tuple[int, ...]:
    try:
        shape = (operator.index(shape),)
    except TypeError:
        shape = tuple(operator.index(n) for n in shape)
    if any(n < 0 for n in shape):
        raise ValueError(f"negative dimensions are not allowed: {shape}")
    return shape


def empty(shape, dtype=float, order: str = "C") -> np.ndarray:
    """An uninitialised array in shared memory (a recycled segment when one is free)."""
    shape, dtype = _shape(shape), np.dtype(dtype)
    if order not in ("C", "F"):
        raise ValueError(f"order must be 'C' or 'F', got {order!r}")
    if dtype.hasobject:
        raise TypeError(f"dtype {dtype} holds Python objects, which cannot live in shared "
                        "memory: use a numeric or structured dtype without objects")
    nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    seg = _recycler.acquire(nbytes, _strategy.get_sharing_strategy())
    return np.ndarray(shape, dtype, buffer=seg.anchor(), order=order)


def zeros(shape, dtype=float, order: str = "C") -> np.ndarray:
    a = empty(shape, dtype, order)
    a.fill(0)
    return a


def ones(shape, dtype=float, order: str = "C") -> np.ndarray:
    a = empty(shape, dtype, order)
    a.fill(1)
    return a


def full(shape, fill_value, dtype=None, order: str = "C") -> np.ndarray:
    if dtype is None:
        dtype = np.array(fill_value).dtype
    a = empty(shape, dtype, order)
    a.fill(fill_value)
    return a


def _like_order(a: np.ndarray) -> str:
    return "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"


def empty_like(a, dtype=None) -> np.ndarray:
    a = np.asanyarray(a)
    return empty(a.shape, a.dtype if dtype is None else dtype, _like_order(a))


def zeros_like(a, dtype=None) -> np.ndarray:
    a = np.asanyarray(a)
    return zeros(a.shape, a.dtype if dtype is None else dtype, _like_order(a))


def is_shared(a) -> bool:
    """True when ``a``'s memory is a shmtensor segment (it crosses processes as a handle)."""
    return isinstance(a, np.ndarray) and _segments.segment_of(a) is not None


def share_memory(a) -> np.ndarray:
    """``a`` itself when already shared, else a copy of it in shared memory (same layout)."""
    if is_shared(a):
        return a
    a = np.asarray(a)
    out = empty_like(a)
    np.copyto(out, a, casting="no")
    return out
