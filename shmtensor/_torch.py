"""torch CPU tensors on shmtensor's channels: through segments, never torch's fd server.

An adapter (see :mod:`shmtensor._registry`): it registers reducers for ``torch.Tensor``,
``torch.nn.Parameter`` and ``torch.UntypedStorage`` once torch has been imported, and never
imports torch itself (``import shmtensor`` stays cheap).  On shmtensor's channels these take
the place of torch's own reducers (``torch.multiprocessing.reductions``), which would move a
CPU storage into torch's shared memory and hand its fd over through a resource-sharer thread.

* A storage whose memory lies in a segment (``torch.from_numpy(shmtensor.zeros(...))``, a
  tensor received from a channel) crosses as a handle to it: no copy, writes visible both
  ways, and released when the last tensor on it dies, as a numpy array on a segment is.
* A storage in torch's shared memory (``share_memory_()``, file_descriptor strategy) sends
  its fd with the message (no resource-sharer thread): shared both ways, as with torch's
  own channels.  One shared by name (torch's file_system strategy) is copied.
* Any other CPU storage is copied once into a recycled segment or slab, or pickled inline
  under the inline threshold, as numpy's arrays are.
* A tensor crosses as its storage plus offset, shape, strides, dtype and ``requires_grad``,
  so views of one storage in one message arrive as views of one storage (the pickle memo
  sends the storage once).  A small view of a much larger storage that is not shared is
  compacted (only its elements are copied), as numpy's views are, unless that storage is
  already in the message.  Conjugate and negative views are resolved.
* Everything else (CUDA and meta tensors, sparse, nested and quantized ones) goes to torch's
  own reducer; the parts of a sparse or nested tensor that are CPU tensors come back here.
  A subclass of ``torch.Tensor`` other than ``Parameter`` is pickled by torch's
  ``__reduce_ex__``, whose storage crosses here too.

In a DataLoader worker started by shmtensor's context, default collate allocates each batch
with ``_new_shared`` (torch shared memory, made fresh and freed for every batch, which the
batch would then be copied out of): there :func:`_new_shared` gives it a recycled segment
instead, so the batch is stacked straight into memory that crosses without a copy.
"""

from __future__ import annotations

import os
import sys
import threading
from types import ModuleType
from typing import TYPE_CHECKING, cast

from . import _registry

if TYPE_CHECKING:  # names for annotations only: this module never imports torch itself
    from collections.abc import Callable

    import numpy as np
    import torch
    from torch import Tensor, UntypedStorage

    from ._numpy import Reduction

# debug_info() counters: storages sent as a handle to a segment, as torch's shared-memory
# fd, copied into a segment, inline; storages received; collate batches made in segments
_counts = dict.fromkeys(("torch_storages_shared", "torch_storages_fd", "torch_storages_copied",
                         "torch_storages_inline", "torch_storages_received",
                         "torch_batches_in_segments"), 0)
_counts_lock = threading.Lock()


def _bump(key: str) -> None:
    with _counts_lock:
        _counts[key] += 1


def _stats() -> dict[str, int]:
    with _counts_lock:
        return dict(_counts)


def _after_fork_in_child() -> None:
    global _counts_lock
    _counts_lock = threading.Lock()


def _torch() -> ModuleType:
    torch = sys.modules.get("torch")
    if torch is None:
        import torch
    return cast(ModuleType, torch)  # the import above binds it when it was None


# --- sending ------------------------------------------------------------------------------

def reduce_storage(storage: UntypedStorage) -> Reduction:
    """A CPU ``UntypedStorage``: a handle to its segment, a copy in one, or inline bytes."""
    if storage.device.type != "cpu":  # CUDA, meta: torch's own (which refuses CUDA storages)
        from torch.multiprocessing.reductions import reduce_storage as torch_reduce
        # torch's reducer is unannotated
        return torch_reduce(storage)  # type: ignore[no-untyped-call,no-any-return]
    return _storage_out(storage)


def _storages_sent() -> set[int]:
    """ids of the storages already in the message being pickled (the message keeps them)."""
    from . import _wire
    memo = _wire.message_memo()
    sent = memo.get(_storages_sent)
    if sent is None:
        sent = memo[_storages_sent] = set()
    return sent


def _storage_out(storage: UntypedStorage) -> Reduction:
    from . import _segments, _strategy, _wire
    _storages_sent().add(id(storage))
    nbytes = storage.nbytes()
    ptr = storage.data_ptr()
    if nbytes:
        seg = _segments.segment_at(ptr)
        if (seg is not None and ptr + nbytes <= seg.address + seg.size and seg.alive()
                and (seg.kind != _segments.FD or seg.fd is not None)):
            _bump("torch_storages_shared")
            return _rebuild_storage, (seg, ptr - seg.address, nbytes)
        fd = _torch_shared_fd(storage)
        if fd is not None:  # torch shared memory (share_memory_()): its fd, in the message
            _wire.keep_alive(storage)  # which keeps the fd open until sent
            _bump("torch_storages_fd")
            return _rebuild_storage_fd, (_wire.attach_fd(fd), nbytes)
    src = _bytes_of(storage)
    if nbytes < _strategy.get_inline_threshold():
        _bump("torch_storages_inline")
        return _rebuild_storage_inline, (src.tobytes(),)
    anchor, offset = _room(nbytes)
    _wire.keep_alive(anchor)  # until sent: nobody else may reuse the segment before then
    anchor[offset:offset + nbytes] = src
    _bump("torch_storages_copied")
    from . import _log
    _log.once("torch-copied", _log.DEBUG,
              "shmtensor: a torch storage of %d bytes that is not in shared memory was copied "
              "into a segment to be sent. share_memory_() on the tensor, or a "
              "shmtensor-backed tensor (torch.from_numpy(shmtensor.empty(...))), sends it "
              "without a copy. (Reported once per process.)", nbytes)
    return _rebuild_storage, (_segments.segment_of(anchor), offset, nbytes)


def _torch_shared_fd(storage: UntypedStorage) -> int | None:
    """The fd of a storage in torch's shared memory (file_descriptor strategy), else None.
    (One shared by name, torch's file_system strategy, is copied: its name is torch's
    shared-memory manager's to keep.)"""
    if not storage.is_shared():
        return None
    try:
        # a private method, absent from torch's stubs
        return storage._get_shared_fd()  # type: ignore[attr-defined,no-any-return]
    except (RuntimeError, AttributeError):
        return None


def _bytes_of(storage: UntypedStorage) -> np.ndarray:
    """The storage's bytes as a numpy uint8 array over its memory (no copy)."""
    torch = _torch()
    return cast("np.ndarray", torch.empty(0, dtype=torch.uint8).set_(storage).numpy())


def _room(nbytes: int) -> tuple[np.ndarray, int]:
    """``nbytes`` of an own segment nobody holds (recycled when one is free): its anchor and
    the offset, as numpy's arrays get them (a slab's room up to 1 MiB)."""
    from . import _segments, _strategy
    kind = _strategy.get_sharing_strategy()
    if nbytes <= _segments.SLAB_ITEM_MAX:
        return _segments.carve(nbytes, kind)
    return _segments.acquire(nbytes, kind)[1], 0


_NON_LEAF = ("Cowardly refusing to serialize non-leaf tensor which requires_grad, since "
             "autograd does not support crossing process boundaries.  If you just want to "
             "transfer the data, call detach() on the tensor before serializing (e.g., "
             "putting it on the queue).")


def reduce_tensor(t: Tensor) -> Reduction:
    """A CPU strided tensor: its storage (see :func:`reduce_storage`) and its place in it."""
    torch = _torch()
    if (t.device.type != "cpu" or t.layout is not torch.strided or t.is_nested
            or t.is_quantized):
        from torch.multiprocessing.reductions import reduce_tensor as torch_reduce
        # torch's reducer is unannotated
        return torch_reduce(t)  # type: ignore[no-untyped-call,no-any-return]
    if t.requires_grad and not t.is_leaf:
        raise RuntimeError(_NON_LEAF)
    torch.utils.hooks.warn_if_has_hooks(t)
    if t.is_conj() or t.is_neg():
        t = t.detach().resolve_conj().resolve_neg()
    storage = t.untyped_storage()
    item = t.element_size()
    span = _extent(t) * item
    sent = _storages_sent()
    if (id(storage) not in sent and storage.nbytes() > max(2 * span, _inline_threshold())
            and not _is_shared(storage)):
        return _compact(t, span)
    return _rebuild_tensor, (type(t), storage, t.storage_offset(), tuple(t.shape),
                             t.stride(), t.dtype, t.requires_grad)


def _extent(t: Tensor) -> int:
    """Elements from the tensor's first to its last one, inclusive (0 when empty)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _inline_threshold() -> int:
    from . import _strategy
    return _strategy.get_inline_threshold()


def _is_shared(storage: UntypedStorage) -> bool:
    """Whether the storage crosses without a copy: on a segment, or torch's by fd."""
    from . import _segments
    return storage.nbytes() > 0 and (_segments.segment_at(storage.data_ptr()) is not None
                                     or _torch_shared_fd(storage) is not None)


def _compact(t: Tensor, nbytes: int) -> Reduction:
    """A small view of a large storage that is not shared: its elements alone, copied once
    into a storage of their own (over a segment, or inline when small)."""
    torch = _torch()
    if nbytes < _inline_threshold():
        c = t.detach().clone(memory_format=torch.contiguous_format)
    else:
        from . import _wire
        anchor, offset = _room(nbytes)
        _wire.keep_alive(anchor)
        c = torch.from_numpy(anchor[offset:offset + nbytes]).view(t.dtype).view(t.shape)
        c.copy_(t.detach())
        _bump("torch_storages_copied")
    return _rebuild_tensor, (type(t), c.untyped_storage(), 0, tuple(c.shape), c.stride(),
                             t.dtype, t.requires_grad)


# --- receiving (these functions' import paths are part of the wire format) -----------------

def _rebuild_storage(anchor: np.ndarray, offset: int, nbytes: int) -> UntypedStorage:
    """A storage over ``nbytes`` of a segment's anchor: its life keeps the anchor's."""
    _bump("torch_storages_received")
    return cast("UntypedStorage", _torch().from_numpy(anchor[offset:offset + nbytes])
                .untyped_storage())


def _rebuild_storage_fd(data_i: int, nbytes: int) -> UntypedStorage:
    """A storage in torch shared memory, mapped from the fd that came with the message
    (torch duplicates it; the message's copy is closed after loading)."""
    from . import _wire
    _bump("torch_storages_received")
    return cast("UntypedStorage", _torch().UntypedStorage._new_shared_fd_cpu(
        _wire.received_fd(data_i), nbytes))


def _rebuild_storage_inline(data: bytes) -> UntypedStorage:
    torch = _torch()
    if not data:
        return cast("UntypedStorage", torch.UntypedStorage(0))
    return cast("UntypedStorage", torch.UntypedStorage.from_buffer(data, dtype=torch.uint8))


def _rebuild_tensor(cls: type[Tensor], storage: UntypedStorage, offset: int,
                    shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype,
                    requires_grad: bool) -> Tensor:
    torch = _torch()
    t: Tensor = torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
    if cls is torch.nn.Parameter:
        # the `is` above narrows torch.nn.Parameter (Any here) to cls's type, type[Tensor],
        # whose constructor takes no requires_grad: the call is Parameter's
        return torch.nn.Parameter(  # type: ignore[call-overload,no-any-return]
            t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


# --- DataLoader workers: batches made in segments -------------------------------------------

# torch's UntypedStorage._new_shared (the bound classmethod)
_torch_new_shared: Callable[..., UntypedStorage] | None = None


def _new_shared(size: int, *, device: str | torch.device = "cpu") -> UntypedStorage:
    """``UntypedStorage._new_shared`` while torch is imported: in a DataLoader worker that
    shmtensor's context started (whose batches go on shmtensor's queue), a CPU storage over
    a recycled segment, which crosses without a copy; anywhere else torch's own."""
    if _in_shmtensor_worker() and _torch().device(device).type == "cpu":
        anchor, offset = _room(size)
        _bump("torch_batches_in_segments")
        return cast("UntypedStorage", _torch().from_numpy(anchor[offset:offset + size])
                    .untyped_storage())
    # set by _install before it installs this function
    return cast("Callable[..., UntypedStorage]", _torch_new_shared)(size, device=device)


def _in_shmtensor_worker() -> bool:
    """A DataLoader worker (``get_worker_info``) whose process shmtensor's context started:
    its data queue is that context's (a forked grandchild's process is not)."""
    import multiprocessing

    from torch.utils.data import get_worker_info
    if get_worker_info() is None:
        return False
    return type(multiprocessing.current_process()).__module__.startswith("shmtensor.")


def _install() -> None:
    """torch was imported: its CPU tensors and storages cross by these reducers."""
    global _torch_new_shared
    import numpy  # noqa: F401 - storages cross on segments, whose reducer is numpy's adapter:
    _registry.install_pending()  # in before torch's first message is pickled
    torch = _torch()
    _registry.register(torch.Tensor, reduce_tensor)
    _registry.register(torch.nn.Parameter, reduce_tensor)
    _registry.register(torch.UntypedStorage, reduce_storage)
    if _torch_new_shared is None and "_new_shared" in vars(torch.storage._StorageBase):
        _torch_new_shared = torch.UntypedStorage._new_shared
        torch.UntypedStorage._new_shared = staticmethod(_new_shared)


_registry.register_lazy("torch", _install)
_registry.register_stats(_stats)
os.register_at_fork(after_in_child=_after_fork_in_child)
