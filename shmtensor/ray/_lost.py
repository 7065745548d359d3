"""Arrays lost with their node, told as Ray tells a lost object.

Imported only once Ray is: :class:`ArrayLostError` is a ``ray.exceptions.ObjectLostError``.
"""

from __future__ import annotations

import functools
from typing import Any

from ray.exceptions import ObjectLostError, OwnerDiedError, RaySystemError

from . import _host


class ArrayLostError(ObjectLostError):
    """A shared array's memory was on a node that died before this process read it.

    As Ray's ``ObjectLostError`` for an object stored only on a dead node: the handle that
    reached this process is whole, the memory it names went with the node."""

    def __init__(self, object_ref_hex: str, node_id: str, detail: str = "") -> None:
        super().__init__(object_ref_hex, None, "")
        self.node_id, self.detail = node_id, detail

    def __str__(self) -> str:
        where = f" ({self.detail})" if self.detail else ""
        return (f"Failed to retrieve object {self.object_ref_hex}: it holds a shmtensor "
                f"array whose memory was on node {self.node_id}{where}, and that node "
                "died before this process read it.  Like a Ray object stored only on a "
                "dead node it is lost: Ray re-runs a task whose result is lost when the "
                "task has retries (max_retries) and no copy of its result was fetched "
                "before; keep a copy (np.array(a)) of what must outlive its node.")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.object_ref_hex, self.node_id, self.detail)


class SenderGoneError(_host.SenderGone, OwnerDiedError):
    """:class:`SenderGone` as ``ray.get`` raises it: also Ray's ``OwnerDiedError`` (the
    sender owned the array's hold, as an owner holds its objects)."""

    def __init__(self, object_ref_hex: str, detail: str) -> None:
        OwnerDiedError.__init__(self, object_ref_hex, None, "")
        self.detail = detail

    def __str__(self) -> str:
        return f"Failed to retrieve object {self.object_ref_hex}: {self.detail}"

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.object_ref_hex, self.detail)


def _passed_through(exc: object, ref: Any) -> Exception | None:
    """The error ``ray.get`` raises for ``exc``, an error of our deserializer, or None."""
    if isinstance(exc, ArrayLostError):
        return exc
    if isinstance(exc, _host.SenderGone):
        return SenderGoneError(ref.hex() if ref is not None else "?", str(exc))
    return None


def unwrap_lost() -> None:
    """Make this process's ``ray.get`` raise a lost array's error (:class:`ArrayLostError`,
    :class:`SenderGoneError`) as such: Ray wraps any error of a deserializer in a
    ``RaySystemError``, which code catching ``ObjectLostError`` would miss.  Idempotent;
    wraps ``SerializationContext.deserialize_objects``."""
    from ray._private import serialization
    cls = serialization.SerializationContext
    original = cls.deserialize_objects
    if getattr(original, "_shmtensor", False):
        return

    @functools.wraps(original)
    def deserialize_objects(self: Any, serialized: Any, object_refs: Any,
                            *args: Any, **kwargs: Any) -> list[Any]:
        out: list[Any] = original(self, serialized, object_refs, *args, **kwargs)
        for i, o in enumerate(out):
            if isinstance(o, RaySystemError):
                ours = _passed_through(getattr(o, "client_exc", None),
                                       object_refs[i] if object_refs else None)
                if ours is not None:
                    out[i] = ours
        return out

    deserialize_objects._shmtensor = True  # type: ignore[attr-defined]  # marks ours
    setattr(cls, "deserialize_objects", deserialize_objects)  # Ray's method, wrapped
