"""The peers under test: what a producer child puts on its queue, and how the parent takes it.

Everything here runs in spawned children too, so it imports only numpy, the stdlib and
shmtensor at module level; torch is imported by the makers that need it.  Every maker is a
context manager that prepares its arrays before the first ``put`` and yields ``item(i)``,
the object to put as item ``i``.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from multiprocessing.shared_memory import SharedMemory

import numpy as np

import shmtensor as st

POOL = 2  # distinct source arrays a producer cycles through
DTYPE = np.dtype(np.float64)
ALWAYS_INLINE, NEVER_INLINE = 1 << 40, 0  # inline thresholds that force one path


def source_array(nbytes: int, value: float = 1) -> np.ndarray:
    """A plain numpy array of ``nbytes``, every page touched."""
    return np.full(nbytes // DTYPE.itemsize, value, DTYPE)


def source_pool(nbytes: int) -> list[np.ndarray]:
    """``POOL`` distinct source arrays."""
    return [source_array(nbytes, i + 1) for i in range(POOL)]


@contextmanager
def plain_arrays(nbytes: int):
    """Plain numpy arrays (not shared): the queue decides how they cross."""
    pool = source_pool(nbytes)
    yield lambda i: pool[i % POOL]


@contextmanager
def plain_with_threshold(nbytes: int, threshold: int):
    """Plain arrays, sent by a producer whose inline threshold forces one path: pickled
    into the message (``ALWAYS_INLINE``) or copied into a segment (``NEVER_INLINE``)."""
    st.set_inline_threshold(threshold)
    with plain_arrays(nbytes) as item:
        yield item


@contextmanager
def shmtensor_shared(nbytes: int):
    """One array born in shared memory (``st.zeros``), sent again and again."""
    a = st.zeros(nbytes // DTYPE.itemsize, DTYPE)
    yield lambda i: a


def _torch(strategy: str):
    import torch
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy(strategy)
    return torch


@contextmanager
def torch_fresh(nbytes: int, strategy: str):
    """A new ``torch.from_numpy`` tensor per item: each ``put`` moves it to shared memory."""
    torch = _torch(strategy)
    pool = source_pool(nbytes)
    yield lambda i: torch.from_numpy(pool[i % POOL])


@contextmanager
def torch_preshared(nbytes: int):
    """One tensor moved to shared memory once (``share_memory_()``), sent again and again."""
    torch = _torch("file_descriptor")
    t = torch.from_numpy(source_array(nbytes)).share_memory_()
    yield lambda i: t


@contextmanager
def shared_memory_blocks(nbytes: int):
    """``POOL`` filled SharedMemory blocks; each item is a (name, shape, dtype) handle."""
    blocks = [SharedMemory(create=True, size=nbytes) for _ in range(POOL)]
    try:
        for i, block in enumerate(blocks):
            np.frombuffer(block.buf, DTYPE).fill(i + 1)
        handles = [(b.name, (nbytes // DTYPE.itemsize,), DTYPE.str) for b in blocks]
        yield lambda i: handles[i % POOL]
    finally:
        for block in blocks:
            block.close()
            block.unlink()


MAKERS = {
    "plain": plain_arrays,
    "plain_inline": lambda nbytes: plain_with_threshold(nbytes, ALWAYS_INLINE),
    "plain_segment": lambda nbytes: plain_with_threshold(nbytes, NEVER_INLINE),
    "shmtensor_shared": shmtensor_shared,
    "torch_fd": lambda nbytes: torch_fresh(nbytes, "file_descriptor"),
    "torch_fs": lambda nbytes: torch_fresh(nbytes, "file_system"),
    "torch_fd_preshared": torch_preshared,
    "shared_memory": shared_memory_blocks,
}


def produce(maker: str, nbytes: int, count: int, q, done) -> None:
    """Child process: put ``count`` items, then this process's shmtensor counters; then
    stay alive until the parent has taken everything (torch's fd strategy needs the sender)."""
    with MAKERS[maker](nbytes) as item:
        for i in range(count):
            q.put(item(i))
        q.put(st.debug_info())
        done.wait()


def take(q, timeout: float | None = None) -> None:
    """Parent: take one array and drop it."""
    q.get(timeout=timeout)


def _attach(name: str) -> SharedMemory:
    if sys.version_info >= (3, 13):
        return SharedMemory(name, track=False)
    # Before 3.13 attaching registers the name with the resource tracker.  Under spawn the
    # producer shares this process's tracker, which keeps one entry per name: registering
    # again is harmless, and unregistering here would make the producer's unlink complain.
    return SharedMemory(name)


def take_shared_memory(q, timeout: float | None = None) -> None:
    """Parent: take a SharedMemory handle, attach, wrap it as an array, let go of both."""
    name, shape, dtype = q.get(timeout=timeout)
    block = _attach(name)
    a = np.ndarray(shape, dtype, buffer=block.buf)
    del a
    block.close()


def total(a: np.ndarray) -> float:
    """The function pool workers (joblib's, ``Pool.map``'s) apply to each array."""
    return float(a.sum())


def scale_in_place(a: np.ndarray) -> np.ndarray:
    """Double ``a`` where it lies and return it (a shared array comes back as itself)."""
    a *= 2
    return a
