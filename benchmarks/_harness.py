"""Timing harnesses: a spawned producer feeding the parent through a queue, joblib's round
trip, and the memcpy floor.  Each returns the median round's time per array, in seconds;
:func:`median_session` repeats one in fresh processes and keeps the median session."""

from __future__ import annotations

import multiprocessing
import statistics
import time
from dataclasses import dataclass
from queue import Empty
from typing import Callable

import numpy as np

import shmtensor as st

from . import _peers

SHARED = "shared"
STARTUP_TIMEOUT = 300.0  # the first item waits for the child to start (torch imports slowly)
MAX_IN_FLIGHT_BYTES = 256 << 20


@dataclass(frozen=True)
class Peer:
    """One contender: how its producer makes items, which context it runs in, how to take."""

    scenario: str     # "not shared" or "shared"
    label: str        # shown in the table
    maker: str        # key of _peers.MAKERS
    context: str      # "stdlib", "shmtensor" or "torch"
    take: Callable = _peers.take

    def bytes_moved(self, nbytes: int) -> int:
        """Bytes copied per array: none when the array already lives in shared memory."""
        return 0 if self.scenario == SHARED else nbytes


def spawn_context(kind: str):
    """The spawn context of ``kind``: the stdlib's, shmtensor's, or torch's (its reducers)."""
    if kind == "shmtensor":
        import shmtensor.multiprocessing as smp
        return smp.get_context("spawn")
    if kind == "torch":
        import torch.multiprocessing
        return torch.multiprocessing.get_context("spawn")
    return multiprocessing.get_context("spawn")


def queue_maxsize(moved: int) -> int:
    """Bound the items queued so a producer that runs ahead holds at most ~256 MB of copies."""
    return max(2, min(64, MAX_IN_FLIGHT_BYTES // max(moved, 1)))


@dataclass
class Timing:
    per_array_s: float
    n: int
    producer_info: dict


def median_session(run: Callable[[], Timing], sessions: int) -> Timing:
    """The median of ``sessions`` runs.  Each queue run is a fresh producer, and how the
    scheduler places its threads on two cores moves a µs-scale session by up to ~1.7x."""
    timings = sorted((run() for _ in range(sessions)), key=lambda t: t.per_array_s)
    mid = timings[len(timings) // 2]
    return Timing(mid.per_array_s, sum(t.n for t in timings), mid.producer_info)


def time_queue(peer: Peer, nbytes: int, n: int, rounds: int, warmup: int) -> Timing:
    """Median over ``rounds`` of (time from one get to the get ``n`` items later) / ``n``,
    after ``warmup`` untimed items, with the producer in a spawned child."""
    ctx = spawn_context(peer.context)
    q, done = ctx.Queue(queue_maxsize(peer.bytes_moved(nbytes))), ctx.Event()
    proc = ctx.Process(target=_peers.produce, daemon=True,
                       args=(peer.maker, nbytes, warmup + n * rounds, q, done))
    proc.start()
    try:
        _warm_up(q, peer.take, warmup, proc)
        stamps = _timed_gets(q, peer.take, n * rounds)
        info = q.get(timeout=STARTUP_TIMEOUT)
    finally:
        done.set()
        _reap(proc, q)
        st.empty_cache()  # unmap the dead producer's segments that this process still caches
    per_round = [(stamps[(r + 1) * n] - stamps[r * n]) / n for r in range(rounds)]
    return Timing(statistics.median(per_round), n * rounds, info)


def _warm_up(q, take, warmup: int, proc) -> None:
    """Take the untimed items, giving up if the producer dies or stays silent too long."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    for _ in range(warmup):
        while True:
            try:
                take(q, timeout=0.5)
                break
            except Empty:
                if not proc.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"producer gave nothing (exit code {proc.exitcode})")


def _timed_gets(q, take, count: int) -> list[float]:
    """Timestamps before the first and after each of ``count`` gets."""
    clock = time.perf_counter
    stamps = [clock()]
    append = stamps.append
    for _ in range(count):
        take(q)
        append(clock())
    return stamps


def _reap(proc, q) -> None:
    """Wait for the producer to exit (kill it after a minute), then close the queue."""
    if not _exited(proc, 60):
        proc.kill()
        _exited(proc, 10)
    q.close()
    q.join_thread()


def _exited(proc, timeout: float) -> bool:
    """Poll the child's pid rather than ``join`` its sentinel pipe: under torch's file_system
    strategy the torch_shm_manager it starts inherits that pipe and keeps it open."""
    deadline = time.monotonic() + timeout
    while proc.is_alive():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def time_joblib(nbytes: int, n: int, rounds: int) -> Timing:
    """joblib.Parallel (loky, 2 workers, memmapping from 1 MB) applying ``total`` to ``n``
    arrays: a round trip to a pool of workers, not a queue; median round / ``n``."""
    from joblib import Parallel, delayed
    from joblib.externals.loky import get_reusable_executor

    pool = _peers.source_pool(nbytes)
    arrays = [pool[i % _peers.POOL] for i in range(n)]
    per_round = []
    try:
        with Parallel(n_jobs=2, backend="loky", max_nbytes="1M") as parallel:
            parallel(delayed(_peers.total)(a) for a in pool)  # start workers, map the pool
            for _ in range(rounds):
                t0 = time.perf_counter()
                parallel(delayed(_peers.total)(a) for a in arrays)
                per_round.append((time.perf_counter() - t0) / n)
    finally:
        get_reusable_executor().shutdown(wait=True)
    return Timing(statistics.median(per_round), n * rounds, {})


def time_memcpy(nbytes: int, rounds: int) -> Timing:
    """``np.copyto`` between two arrays whose pages are already mapped: the floor."""
    src = _peers.source_array(nbytes)
    dst = _peers.source_array(nbytes, 0)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return Timing(statistics.median(times), rounds, {})


def stop_processes(procs, timeout: float = 30) -> None:
    """Join ``procs``; kill any that is still there after ``timeout`` in all."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def check_exit_codes(procs, what: str) -> None:
    """Raise if any of ``procs`` (joined) exited with an error: a failed child's numbers
    are not numbers."""
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"{what} failed (exit codes {bad})")
