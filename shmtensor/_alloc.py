"""Arrays born in shared memory: plain ``numpy.ndarray`` objects whose memory is a segment."""

from __future__ import annotations

import math
import operator
from typing import Any, Literal, TypeGuard, cast

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from . import _segments, _strategy

__all__ = ["empty", "zeros", "ones", "full", "empty_like", "zeros_like", "share_memory",
           "is_shared"]


def _shape(shape: Any) -> tuple[int, ...]:
    """``shape`` (whatever the caller passed) as a tuple of ints, refused in numpy's words
    when it is not one."""
    if type(shape) is tuple:  # the common case, checked cheaply
        for n in shape:
            if type(n) is not int or n < 0:
                break
        else:
            return shape
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
    return cast("tuple[int, ...]", shape)  # made of operator.index() results above


def _dtype(dtype: DTypeLike) -> np.dtype[Any]:
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError(f"dtype {dtype} holds Python objects, which cannot live in shared "
                        "memory: use a numeric or structured dtype without objects")
    return dtype


# dtype argument -> checked np.dtype, for the hashable common ones
_dtypes: dict[object, np.dtype[Any]] = {}


def empty(shape: int | tuple[int, ...], dtype: DTypeLike = float,
          order: Literal["C", "F"] = "C") -> np.ndarray:
    """An uninitialised array in shared memory, like :func:`numpy.empty`.

    The result is a plain ``numpy.ndarray`` whose memory is shared: it crosses every
    shmtensor channel as a handle, and the receiver's writes are seen here.  Arrays up to
    1 MiB are carved from a shared slab; larger ones get a segment of their own (a recycled
    one when one is free).

    :param shape: an int or a tuple of ints.
    :param dtype: any numpy dtype without Python objects.
    :param order: ``"C"`` or ``"F"``.
    :raises ShmSpaceError: the memory cannot be reserved (a full /dev/shm, a memory
        cgroup's limit); the message says how much is free and what to do.
    :raises TypeError: an object dtype, or a shape that is not integers.

    >>> import shmtensor
    >>> a = shmtensor.empty((2, 3), dtype="int32")
    >>> a.shape, shmtensor.is_shared(a)
    ((2, 3), True)
    """
    if type(shape) is int and shape >= 0:
        shape = (shape,)
    else:
        shape = _shape(shape)
    try:
        # a dtype with metadata is equal, and hashed equal, to the one without: it is
        # neither looked up nor a key, or one would answer for the other
        if isinstance(dtype, np.dtype) and dtype.metadata:
            raise KeyError(dtype)
        dt = _dtypes[dtype]
    except (KeyError, TypeError):
        dt = _dtype(dtype)
        try:
            if len(_dtypes) < 256 and not dt.metadata:
                _dtypes[dtype] = dt
        except TypeError:  # unhashable dtype specification
            pass
    if order != "C" and order != "F":
        raise ValueError(f"order must be 'C' or 'F', got {order!r}")
    nbytes = dt.itemsize * math.prod(shape)
    kind = _strategy.get_sharing_strategy()
    # the casts below: numpy's stubs give the ndarray constructor's result as Any
    if nbytes <= _segments.SLAB_ITEM_MAX:
        anchor, offset = _segments.carve(nbytes, kind)
        return cast("np.ndarray", np.ndarray(shape, dt, anchor, offset, order=order))
    _, anchor = _segments.acquire(nbytes, kind)
    return cast("np.ndarray", np.ndarray(shape, dt, anchor, order=order))


def zeros(shape: int | tuple[int, ...], dtype: DTypeLike = float,
          order: Literal["C", "F"] = "C") -> np.ndarray:
    """An array of zeros in shared memory, like :func:`numpy.zeros` (see :func:`empty`).

    >>> import shmtensor
    >>> shmtensor.zeros(3).tolist()
    [0.0, 0.0, 0.0]
    """
    a = empty(shape, dtype, order)
    a.fill(0)
    return a


def ones(shape: int | tuple[int, ...], dtype: DTypeLike = float,
         order: Literal["C", "F"] = "C") -> np.ndarray:
    """An array of ones in shared memory, like :func:`numpy.ones` (see :func:`empty`).

    >>> import shmtensor
    >>> shmtensor.ones(2, dtype="int8").tolist()
    [1, 1]
    """
    a = empty(shape, dtype, order)
    a.fill(1)
    return a


def full(shape: int | tuple[int, ...], fill_value: object, dtype: DTypeLike | None = None,
         order: Literal["C", "F"] = "C") -> np.ndarray:
    """An array filled with ``fill_value`` in shared memory, like :func:`numpy.full`; the
    dtype is ``fill_value``'s when not given (see :func:`empty`).

    >>> import shmtensor
    >>> shmtensor.full(2, 7).tolist()
    [7, 7]
    """
    if dtype is None:
        dtype = np.array(fill_value).dtype
    a = empty(shape, dtype, order)
    a.fill(fill_value)
    return a


def _like_order(a: np.ndarray) -> Literal["C", "F"]:
    return "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"


def empty_like(a: ArrayLike, dtype: DTypeLike | None = None) -> np.ndarray:
    """An uninitialised shared array with ``a``'s shape, dtype (unless given) and memory
    order (C, or Fortran when ``a`` is only Fortran-contiguous).  See :func:`empty`."""
    a = np.asanyarray(a)
    return empty(a.shape, a.dtype if dtype is None else dtype, _like_order(a))


def zeros_like(a: ArrayLike, dtype: DTypeLike | None = None) -> np.ndarray:
    """A shared array of zeros shaped like ``a`` (see :func:`empty_like`).

    >>> import numpy as np, shmtensor
    >>> shmtensor.zeros_like(np.ones((2, 2), order="F")).flags.f_contiguous
    True
    """
    a = np.asanyarray(a)
    return zeros(a.shape, a.dtype if dtype is None else dtype, _like_order(a))


def is_shared(a: object) -> TypeGuard[np.ndarray]:
    """True when ``a`` is a numpy array (or a view of one) whose memory is a shmtensor
    segment: it crosses processes as a handle, not as a copy.

    >>> import numpy as np, shmtensor
    >>> shmtensor.is_shared(shmtensor.zeros(4)[1:]), shmtensor.is_shared(np.zeros(4))
    (True, False)
    """
    return isinstance(a, np.ndarray) and _segments.segment_of(a) is not None


def share_memory(a: ArrayLike) -> np.ndarray:
    """``a`` itself when it is already shared, else a copy of it in shared memory with the
    same shape, dtype and memory order.  Copy once, then send it as often as needed.

    >>> import numpy as np, shmtensor
    >>> b = shmtensor.share_memory(np.arange(3))
    >>> shmtensor.is_shared(b), shmtensor.share_memory(b) is b
    (True, True)
    """
    if is_shared(a):
        return a
    a = np.asarray(a)
    out = empty_like(a)
    np.copyto(out, a, casting="no")
    return out
