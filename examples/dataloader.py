"""A data loader on shared memory: workers fill batch slots, the trainer reads them in place.

Each worker owns a :class:`shmtensor.BatchPool` of a few batch-shaped shared slots.  It
fills a free slot and puts it on a shmtensor Queue; the trainer gets a view of the slot
(no copy), and the slot goes back to its worker the moment the trainer drops the batch.
When every slot is out the worker waits: back-pressure instead of unbounded memory.
The same loader on the stdlib's context pickles every batch through a pipe.

Run it with ``scripts/demo`` (or ``python examples/dataloader.py`` inside the venv).
"""

from __future__ import annotations

import multiprocessing
import queue
import sys
import time
import traceback

import numpy as np

import shmtensor
import shmtensor.multiprocessing as smp
from shmtensor.testing import LeakError, leak_checker

BATCH = (32, 256, 256)  # 32 single-channel 256x256 float32 images: 8 MiB a batch


def make_batch(out: np.ndarray, index: int) -> None:
    """The 'dataset': a cheap, checkable fill (a real loader decodes and augments here)."""
    out[...] = index
    out[:, 0, 0] = np.arange(out.shape[0])


def worker(rank: int, nworkers: int, nbatches: int, out, use_pool: bool,
           fill=make_batch) -> None:
    try:
        pool = shmtensor.BatchPool(BATCH, np.float32, slots=3) if use_pool else None
        for index in range(rank, nbatches, nworkers):
            batch = pool.acquire() if pool is not None else np.empty(BATCH, np.float32)
            fill(batch, index)
            out.put((index, batch))
            del batch
        out.put((None, shmtensor.debug_info() if use_pool else {}))
    except Exception as e:  # the trainer re-raises it, with this traceback
        out.put((WorkerError, (rank, type(e), traceback.format_exc())))


class WorkerError(Exception):
    """Marks a worker's failure on the queue (never raised itself)."""


def reraise(rank: int, exc_type: type, tb: str) -> None:
    """Raise a worker's exception in the trainer, as torch's DataLoader does: the same type
    where it can be built from a message, with the worker's traceback in the message."""
    msg = f"Caught {exc_type.__name__} in data loader worker {rank}.\nOriginal {tb}"
    try:
        err = exc_type(msg)
    except Exception:
        err = RuntimeError(msg)
    raise err


class Loader:
    """Iterate over ``nbatches`` batches made by ``nworkers`` processes of context ``ctx``."""

    def __init__(self, ctx, nworkers: int, nbatches: int, fill=make_batch) -> None:
        self.ctx, self.nworkers, self.nbatches, self.fill = ctx, nworkers, nbatches, fill
        self.worker_info: list[dict] = []

    def __iter__(self):
        use_pool = isinstance(self.ctx, smp.SpawnContext)
        out = self.ctx.Queue(maxsize=2 * self.nworkers)
        procs = [self.ctx.Process(target=worker, args=(r, self.nworkers, self.nbatches, out,
                                                       use_pool, self.fill), daemon=True)
                 for r in range(self.nworkers)]
        for p in procs:
            p.start()
        done = 0
        try:
            while done < self.nworkers:
                try:
                    index, batch = out.get(timeout=1.0)
                except queue.Empty:
                    self._check_alive(procs)
                    continue
                if index is WorkerError:
                    reraise(*batch)
                if index is None:
                    done += 1
                    self.worker_info.append(batch)
                    continue
                yield index, batch
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.terminate()
                    p.join(5)

    @staticmethod
    def _check_alive(procs) -> None:
        for rank, p in enumerate(procs):
            if p.exitcode not in (None, 0):
                raise RuntimeError(f"data loader worker {rank} (pid {p.pid}) exited "
                                   f"unexpectedly with exit code {p.exitcode}")


def progress(label: str, n: int, nbatches: int, rate: float, startup: float) -> str:
    return (f"  {label:<18} {n:4d}/{nbatches} batches  {rate:7.1f} batches/s  "
            f"(first batch after {startup:.2f} s)")


def run(ctx, nworkers: int, nbatches: int, label: str) -> tuple[float, Loader]:
    """Batches per second from the first batch to the last (the workers' start-up is
    shown apart: a long training run does not feel it).  On a terminal the line updates
    in place; in a log it is written once, when the loader is done."""
    live = sys.stdout.isatty()
    loader = Loader(ctx, nworkers, nbatches)
    t0 = time.perf_counter()
    first = last = None
    n = 0
    for index, batch in loader:
        assert batch[1, 5, 5] == index and batch[7, 0, 0] == 7  # the trainer 'uses' it
        n += 1
        last = time.perf_counter()
        if first is None:
            first = last
        del batch
        if live and (n % 10 == 0 or n == nbatches):
            rate = (n - 1) / (last - first) if n > 1 else 0.0
            print("\r" + progress(label, n, nbatches, rate, first - t0), end="", flush=True)
    rate = (n - 1) / (last - first)
    print(("\r" if live else "") + progress(label, n, nbatches, rate, first - t0))
    return rate, loader


def main(nworkers: int = 4, nbatches: int = 200) -> int:
    mib = int(np.prod(BATCH)) * 4 / (1 << 20)
    shape = "x".join(map(str, BATCH))
    print(f"data loader: {nworkers} worker processes make {nbatches} batches of {shape} float32 "
          f"({mib:g} MiB each) for\nthis process, once with the stdlib's spawn context and once "
          "with shmtensor's.\nbatches/s counts from the first batch to the last (the workers' "
          "start-up is shown apart);\nspeed-up = shmtensor's batches/s / the stdlib's.\n")
    try:
        with leak_checker(timeout=10):
            std_rate, _ = run(multiprocessing.get_context("spawn"), nworkers, nbatches,
                              "stdlib context")
            shm_rate, loader = run(smp.get_context("spawn"), nworkers, nbatches,
                                   "shmtensor context")
            made = sum(i.get("segments_created", 0) for i in loader.worker_info)
            print(f"\nspeed-up: {shm_rate / std_rate:.1f}x.  The stdlib pickled every batch "
                  f"through a pipe; shmtensor's\nworkers made {made} segments for {nbatches} "
                  f"batches ({made // nworkers} each: their BatchPool slots, reused),\nand this "
                  "process read each batch in place.")
        print("leak report: clean (no segments, fds or processes left behind)")
        return 0
    except LeakError as e:
        print(f"leak report: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
