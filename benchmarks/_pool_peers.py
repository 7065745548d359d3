"""The contenders of the Pool.map section: each starts its pool once, then maps on demand.

Every contender has the same shape (:class:`Contender`): ``start`` (untimed: the pool, its
workers, and whatever the contender puts in place before a map, such as Ray's ``ray.put``),
``call(function)`` (one timed map, returning the results in order) and ``close``.  The
section runs them round by round, interleaved, so a machine whose speed drifts moves them
alike.  A contender whose package cannot be imported is reported as skipped.

Ray, mpire and loky are imported only by their contenders; ``total`` and ``scale_in_place``
come from :mod:`benchmarks._peers`, importable by every worker.
"""

from __future__ import annotations

import importlib
import multiprocessing
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

import shmtensor as st
import shmtensor.multiprocessing as smp

from ._peers import scale_in_place, total

WORKERS = 2
FUNCTIONS: dict[str, Callable] = {"sum": total, "scale in place": scale_in_place}
WARM = [np.ones(16)] * WORKERS
RAY_OBJECT_STORE_BYTES = 3 << 30  # 1 GB pre-put + 1 GB passed per round, with room


class Contender:
    """One way of applying a function to every array on ``WORKERS`` workers."""

    label = ""
    module: str | None = None            # the package it needs (None: always there)
    functions: tuple[str, ...] = tuple(FUNCTIONS)
    parallel = True                       # False: a floor, not a pool

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = arrays

    def missing(self) -> str | None:
        """Why this contender cannot run here (its package does not import), or None."""
        if self.module is None:
            return None
        try:
            importlib.import_module(self.module)
        except Exception as e:  # ImportError, or a wheel whose libraries do not load
            return f"{self.module} not importable ({type(e).__name__}: {e})"
        return None

    def start(self) -> None:
        pass

    def call(self, function: str) -> list:
        raise NotImplementedError

    def close(self) -> None:
        pass


class SerialFloor(Contender):
    """The compute floor: a serial ``a.sum()`` of the same arrays in this process (pages
    already mapped); the section divides it by ``WORKERS``."""

    label = "numpy serial (floor x workers)"
    functions = ("sum",)
    parallel = False

    def call(self, function: str) -> list:
        return [total(a) for a in self.arrays]


class ThreadFloor(Contender):
    """The same sums on ``WORKERS`` threads of this process: no process boundary, no
    mapping, so what two cores of this machine give for a memory-bound sum."""

    label = f"numpy, {WORKERS} threads in-process"
    functions = ("sum",)
    parallel = False

    def start(self) -> None:
        self.ex = ThreadPoolExecutor(WORKERS)

    def call(self, function: str) -> list:
        return list(self.ex.map(total, self.arrays, chunksize=1))

    def close(self) -> None:
        self.ex.shutdown()


class _MpPool(Contender):
    """A multiprocessing-style pool of a given context."""

    def context(self):
        raise NotImplementedError

    def start(self) -> None:
        self.pool = self.context().Pool(WORKERS)
        self.pool.map(total, WARM)

    def call(self, function: str) -> list:
        return self.pool.map(FUNCTIONS[function], self.arrays)

    def close(self) -> None:
        self.pool.close()
        self.pool.join()


class StdlibPool(_MpPool):
    label = "multiprocessing.Pool"

    def context(self):
        return multiprocessing.get_context("spawn")


class ShmtensorPool(_MpPool):
    """shmtensor's spawn ``Pool`` over the plain arrays (each copied once into a segment)."""

    label = "shmtensor Pool, not shared"

    def context(self):
        return smp.get_context("spawn")


class ShmtensorShared(ShmtensorPool):
    """shmtensor's ``Pool`` over shared copies of the arrays, made once in ``start``."""

    label = "shmtensor Pool, pre-shared"

    def start(self) -> None:
        self.plain, self.arrays = self.arrays, [st.share_memory(a) for a in self.arrays]
        super().start()

    def close(self) -> None:
        super().close()
        self.arrays = self.plain
        st.empty_cache()


class Joblib(Contender):
    """``joblib.Parallel`` on loky: a fresh ``Parallel(...)(...)`` call per map on the reused
    executor (new data every call, its usual case); inputs over 1 MB are memmapped."""

    label = "joblib loky"
    module = "joblib"
    MMAP_MODE = {"sum": "r", "scale in place": "r+"}  # 'r' (default) maps read-only

    def start(self) -> None:
        from joblib import Parallel, delayed
        self.Parallel, self.delayed = Parallel, delayed
        Parallel(n_jobs=WORKERS, backend="loky")(delayed(total)(a) for a in WARM)

    def call(self, function: str) -> list:
        fn = self.delayed(FUNCTIONS[function])
        return self.Parallel(n_jobs=WORKERS, backend="loky",
                             mmap_mode=self.MMAP_MODE[function])(fn(a) for a in self.arrays)

    def close(self) -> None:
        from joblib.externals.loky import get_reusable_executor
        get_reusable_executor().shutdown(wait=True)


class Loky(Contender):
    """loky's own reusable executor (the standalone package): arguments pickled through
    its call queue, results back the same way."""

    label = "loky executor"
    module = "loky"
    functions = ("sum",)

    def start(self) -> None:
        import loky
        self.ex = loky.get_reusable_executor(max_workers=WORKERS)
        list(self.ex.map(total, WARM))

    def call(self, function: str) -> list:
        return list(self.ex.map(FUNCTIONS[function], self.arrays))

    def close(self) -> None:
        self.ex.shutdown(wait=True)


class Mpire(Contender):
    """mpire's ``WorkerPool`` (its default start method, fork), kept alive between maps;
    each array goes to a worker through mpire's task queues."""

    label = "mpire WorkerPool"
    module = "mpire"
    functions = ("sum",)

    def start(self) -> None:
        from mpire import WorkerPool
        self.pool = WorkerPool(n_jobs=WORKERS, keep_alive=True)
        self.pool.map(total, [(a,) for a in WARM])

    def call(self, function: str) -> list:
        return self.pool.map(FUNCTIONS[function], [(a,) for a in self.arrays],
                             concatenate_numpy_output=False)

    def close(self) -> None:
        self.pool.stop_and_join()
        self.pool.terminate()


class _Ray(Contender):
    """Ray on this machine (``ray.init(num_cpus=WORKERS)``), one task per array."""

    module = "ray"
    functions = ("sum",)   # objects from Ray's store are read-only: no scale in place
    users = 0               # Ray is started once for both Ray contenders

    def start(self) -> None:
        import ray
        if not ray.is_initialized():
            # address="local": a cluster of its own, never one already running here
            ray.init(address="local", num_cpus=WORKERS, include_dashboard=False,
                     log_to_driver=False,
                     object_store_memory=RAY_OBJECT_STORE_BYTES, configure_logging=False)
        _Ray.users += 1
        self.ray = ray
        self.task = ray.remote(total)
        ray.get([self.task.remote(a) for a in WARM])

    def close(self) -> None:
        _Ray.users -= 1
        if _Ray.users == 0:
            self.ray.shutdown()


class RayPrePut(_Ray):
    """The arrays already in Ray's object store (``ray.put`` once, in ``start``): each task
    gets a reference and its worker reads the array from the store, zero-copy."""

    label = "Ray, pre-put (ray.put once)"

    def start(self) -> None:
        super().start()
        self.refs = [self.ray.put(a) for a in self.arrays]
        self.ray.get([self.task.remote(r) for r in self.refs])  # as the others: warm

    def call(self, function: str) -> list:
        return self.ray.get([self.task.remote(r) for r in self.refs])

    def close(self) -> None:
        del self.refs
        super().close()


class RayPlain(_Ray):
    """The plain arrays as task arguments: Ray puts each into its store on every call."""

    label = "Ray, plain arrays"

    def call(self, function: str) -> list:
        return self.ray.get([self.task.remote(a) for a in self.arrays])


SHARED_CONTENDERS = (SerialFloor, ThreadFloor, ShmtensorShared, RayPrePut)
PLAIN_CONTENDERS = (StdlibPool, Joblib, Loky, Mpire, RayPlain, ShmtensorPool)
ALL = SHARED_CONTENDERS + PLAIN_CONTENDERS
