"""Arrays born in shared memory: plain ``numpy.ndarray`` objects whose memory is a segment."""

from __future__ import annotations

import math
import operator

import numpy as np

from . import _segments, _strategy

__all__ = ["empty", "zeros", "ones", "full", "empty_like", "zeros_like", "share_memory",
           "is_shared"]


def _shape(shape) -> tuple[int, ...]:
    """``shape`` as a tuple of ints, refused in numpy's words when it is not one."""
    if type(shape) is tuple and all(type(n) is int and n >= 0 for n in shape):
        return shape  # the common case, checked cheaply
    try:
        shape = (operator.index(shape),)
    except TypeError:
        try:
            shape = tuple(operator.index(n) for n in shape)
        except TypeError:
            bad = shape if not hasattr(shape, "__iter__") else next(
                n for n in shape if not hasattr(type(n), "__index__"))
            raise TypeError(f"{type(bad).__name__!r} object cannot be interpreted as an "
                            "integer") from None
    if any(n < 0 for n in shape):
        raise ValueError("negative dimensions are not allowed")
    return shape


def _dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError(f"dtype {dtype} holds Python objects, which cannot live in shared "
                        "memory: use a numeric or structured dtype without objects")
    return dtype


_dtypes: dict = {}  # dtype argument -> checked np.dtype, for the hashable common ones


def empty(shape, dtype=float, order: str = "C") -> np.ndarray:
    """An uninitialised array in shared memory: carved from a slab when small, else a
    segment of its own (a recycled one when one is free)."""
    if type(shape) is int and shape >= 0:
        shape = (shape,)
    else:
        shape = _shape(shape)
    try:
        dt = _dtypes[dtype]
    except (KeyError, TypeError):
        dt = _dtype(dtype)
        try:
            if len(_dtypes) < 256:
                _dtypes[dtype] = dt
        except TypeError:  # unhashable dtype specification
            pass
    if order != "C" and order != "F":
        raise ValueError(f"order must be 'C' or 'F', got {order!r}")
    nbytes = dt.itemsize * math.prod(shape)
    kind = _strategy.get_sharing_strategy()
    if nbytes <= _segments.SLAB_ITEM_MAX:
        anchor, offset = _segments.carve(nbytes, kind)
        return np.ndarray(shape, dt, anchor, offset, order=order)
    _, anchor = _segments.acquire(nbytes, kind)
    return np.ndarray(shape, dt, anchor, order=order)


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
