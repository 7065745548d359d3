"""A data loader like ``examples/dataloader.py``: workers make batches, the parent takes them.

On shmtensor's context each worker fills the slots of a :class:`shmtensor.BatchPool` (a
slot is free again once the parent drops the batch); on the stdlib's it makes a fresh
array per batch, pickled through the queue's pipe.  Runs in spawned children too: imports
only numpy, the stdlib and shmtensor.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass

import numpy as np

import shmtensor as st

from ._harness import stop_processes

BATCH, DTYPE = (32, 256, 256), np.dtype(np.float32)  # 8 MB a batch
SLOTS = 3
GET_TIMEOUT = 120.0


def fill(out: np.ndarray, index: int) -> None:
    """The 'dataset': a cheap, checkable fill of every element."""
    out[...] = index


def worker(rank: int, nworkers: int, nbatches: int, out, use_pool: bool) -> None:
    """Make batches ``rank, rank + nworkers, ...``; then send this process's counters."""
    pool = st.BatchPool(BATCH, DTYPE, slots=SLOTS) if use_pool else None
    for index in range(rank, nbatches, nworkers):
        batch = pool.acquire() if pool is not None else np.empty(BATCH, DTYPE)
        fill(batch, index)
        out.put((index, batch))
        del batch  # the slot is the parent's until it drops the batch
    out.put((None, st.debug_info()))


@dataclass
class LoaderRun:
    batches: int
    steady_batches_per_s: float
    clock_started_at: int        # batches taken before the steady-state clock started
    segments_created: int        # by all workers together


def run_loader(ctx, nworkers: int, nbatches: int, use_pool: bool, skip: int) -> LoaderRun:
    """Take ``nbatches`` batches, touching one element of each.  The clock starts once every
    worker has delivered a batch and at least ``skip`` batches were taken (start-up, which
    spawns workers one after another, is left out) and stops at the last batch."""
    out = ctx.Queue(maxsize=2 * nworkers)
    procs = [ctx.Process(target=worker, args=(r, nworkers, nbatches, out, use_pool),
                         daemon=True) for r in range(nworkers)]
    for p in procs:
        p.start()
    stamps, infos, seen, start = [], [], set(), None
    try:
        while len(infos) < nworkers:
            index, batch = _get(out, procs)
            if index is None:
                infos.append(batch)
                continue
            if batch[1, 5, 5] != index:
                raise AssertionError(f"batch {index} holds {batch[1, 5, 5]}")
            del batch
            stamps.append(time.perf_counter())
            seen.add(index % nworkers)
            if start is None and len(seen) == nworkers and len(stamps) > skip:
                start = len(stamps) - 1
    finally:
        stop_processes(procs)
    if start is None or start == len(stamps) - 1:
        raise RuntimeError(f"{nbatches} batches are too few to reach a steady state")
    rate = (len(stamps) - 1 - start) / (stamps[-1] - stamps[start])
    return LoaderRun(len(stamps), rate, start, sum(i.get("segments_created", 0) for i in infos))


def _get(out, procs):
    """The next item; raises when it takes over ``GET_TIMEOUT`` or a worker has failed."""
    deadline = time.monotonic() + GET_TIMEOUT
    while True:
        try:
            return out.get(timeout=0.5)
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                raise RuntimeError(f"loader stalled (worker exit codes {failed})") from None


# --- the peers' loaders, over the same "dataset" -------------------------------------------

class NumpyBatches:
    """The dataset as a map-style source of fresh numpy batches: item ``i`` is a batch
    filled with ``i`` (what ``worker`` makes, without a BatchPool).  Serves torch's
    ``Dataset`` protocol and grain's ``RandomAccessDataSource`` alike."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        batch = np.empty(BATCH, DTYPE)
        fill(batch, int(index))
        return batch


def torch_loader(nworkers: int, nbatches: int):
    """``torch.utils.data.DataLoader`` over :class:`NumpyBatches` with its defaults (fork
    on Linux; each item a batch, ``batch_size=None``, so numpy becomes a torch tensor in
    the worker and crosses through torch's shared memory)."""
    from torch.utils.data import DataLoader
    return DataLoader(NumpyBatches(nbatches), batch_size=None, num_workers=nworkers)


def grain_loader(nworkers: int, nbatches: int):
    """grain's multiprocessing ``DataLoader`` over :class:`NumpyBatches`, in order."""
    import logging
    logging.getLogger("absl").setLevel(logging.ERROR)  # "Failed to load jax profiler"
    import grain.python as gp
    sampler = gp.IndexSampler(nbatches, shard_options=gp.NoSharding(), shuffle=False,
                              num_epochs=1, seed=0)
    return gp.DataLoader(data_source=NumpyBatches(nbatches), sampler=sampler,
                         worker_count=nworkers)


def run_iterable(loader, nbatches: int, skip: int) -> LoaderRun:
    """Iterate ``loader``, checking each batch's index (one element read), and time from
    batch ``skip`` to the last (start-up, which forks or spawns the workers, is left out)."""
    stamps = []
    for index, batch in enumerate(loader):
        if float(batch[1, 5, 5]) != index:
            raise AssertionError(f"batch {index} holds {batch[1, 5, 5]}")
        del batch
        stamps.append(time.perf_counter())
    if len(stamps) != nbatches or skip >= nbatches - 1:
        raise RuntimeError(f"got {len(stamps)} of {nbatches} batches (skip {skip})")
    rate = (len(stamps) - 1 - skip) / (stamps[-1] - stamps[skip])
    return LoaderRun(len(stamps), rate, skip, 0)
