"""``Pool.map`` over 32 arrays of 32 MB (float64, 1 GB in all), two workers, spawn.

Contenders: shmtensor's ``ctx.Pool`` with the arrays pre-shared (``share_memory``) and not
shared (plain numpy: each is copied once into a segment), the stdlib's spawn ``Pool``
(pickles every array through a pipe) and ``joblib.Parallel`` on loky (dumps every array
over 1 MB to a memmap file that its workers map).  Each pool is started and warmed with
one small map first; only the map calls are timed, the median of ``rounds`` counting.

joblib caches its dumps by object identity within one ``Parallel`` context, so each timed
joblib call is a fresh ``Parallel(...)(...)`` on the reused loky executor (new data every
call, its usual case); re-sending the very same objects in one context is shown too.
"""

from __future__ import annotations

import multiprocessing
import statistics
import sys
import time
from typing import Callable

import numpy as np

import shmtensor as st
import shmtensor.multiprocessing as smp

from . import _report
from ._peers import scale_in_place, total
from ._report import MB, Section, ratio, target, time_label

ARRAYS, NBYTES, WORKERS = 32, 32 * MB, 2
WARM = [np.ones(16)] * WORKERS
FUNCTIONS = {"sum": total, "scale in place": scale_in_place}
STDLIB, JOBLIB = "multiprocessing.Pool", "joblib loky"
SHM_PLAIN, SHM_SHARED = "shmtensor Pool, not shared", "shmtensor Pool, pre-shared"
JOBLIB_AGAIN = "joblib loky, same objects again"
JOBLIB_MMAP_MODE = {"sum": "r", "scale in place": "r+"}  # 'r' (default) is read-only


def make_inputs() -> list[np.ndarray]:
    """``ARRAYS`` plain arrays of ``NBYTES``; array ``i`` is filled with ``i + 1``."""
    return [np.full(NBYTES // 8, i + 1.0) for i in range(ARRAYS)]


def check(function: str, result: list) -> None:
    """Make sure a map did the work: the right sums, or one array back per input."""
    if function == "sum":
        expected = [NBYTES // 8 * (i + 1.0) for i in range(ARRAYS)]
        if list(result) != expected:
            raise AssertionError(f"wrong sums: {list(result)[:3]}...")
    elif len(result) != ARRAYS or result[0].shape != (NBYTES // 8,):
        raise AssertionError("scale: wrong number or shape of arrays back")


def time_calls(function: str, call: Callable[[], list], rounds: int) -> list[float]:
    """Wall time of ``rounds`` calls; each result is checked, then dropped."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - t0)
        check(function, result)
        del result
    return times


def progress(function: str, peer: str, times: list[float]) -> None:
    print(f"  pool map     {function:<14} {peer:<32} "
          f"{time_label(statistics.median(times)):>10}", file=sys.stderr, flush=True)


def map_all(pool, arrays: list[np.ndarray], peer: str, rounds: int) -> dict[str, list[float]]:
    """Every function mapped over ``arrays`` on a started ``pool``, after a small warm-up."""
    pool.map(total, WARM)
    times = {}
    for name, fn in FUNCTIONS.items():
        times[name] = time_calls(name, lambda: pool.map(fn, arrays), rounds)
        progress(name, peer, times[name])
    return times


def stdlib_times(arrays: list[np.ndarray], rounds: int) -> dict:
    with multiprocessing.get_context("spawn").Pool(WORKERS) as pool:
        return {STDLIB: map_all(pool, arrays, STDLIB, rounds)}


def shmtensor_times(arrays: list[np.ndarray], rounds: int) -> dict:
    """One shmtensor pool: the plain arrays, then shared copies of them (freed after)."""
    with smp.get_context("spawn").Pool(WORKERS) as pool:
        times = {SHM_PLAIN: map_all(pool, arrays, SHM_PLAIN, rounds)}
        st.empty_cache()  # the idle segments the plain arrays were copied into
        shared = [st.share_memory(a) for a in arrays]
        times[SHM_SHARED] = map_all(pool, shared, SHM_SHARED, rounds)
        del shared
    st.empty_cache()
    return times


def joblib_times(arrays: list[np.ndarray], rounds: int) -> dict:
    """A fresh ``Parallel`` call per round on loky's reused executor; then the same objects
    again and again in one ``Parallel`` context (a hit in joblib's dump cache)."""
    from joblib import Parallel, delayed
    from joblib.externals.loky import get_reusable_executor

    def call(fn, mode):
        return Parallel(n_jobs=WORKERS, backend="loky", mmap_mode=mode)(
            delayed(fn)(a) for a in arrays)

    Parallel(n_jobs=WORKERS, backend="loky")(delayed(total)(a) for a in WARM)
    times = {}
    for name, fn in FUNCTIONS.items():
        times[name] = time_calls(name, lambda: call(fn, JOBLIB_MMAP_MODE[name]), rounds)
        progress(name, JOBLIB, times[name])
    with Parallel(n_jobs=WORKERS, backend="loky") as parallel:
        parallel(delayed(total)(a) for a in arrays)  # dumps them once
        again = {"sum": time_calls("sum", lambda: parallel(delayed(total)(a) for a in arrays),
                                   rounds)}
        progress("sum", JOBLIB_AGAIN, again["sum"])
    get_reusable_executor().shutdown(wait=True)
    return {JOBLIB: times, JOBLIB_AGAIN: again}


def measure_all(rounds: int, have_joblib: bool) -> list[dict]:
    """One row per (function, peer): every round's time and their median."""
    arrays = make_inputs()
    times = stdlib_times(arrays, rounds)
    if have_joblib:
        times |= joblib_times(arrays, rounds)
    times |= shmtensor_times(arrays, rounds)
    rows = [{"function": fn, "peer": peer, "median_s": statistics.median(ts), "rounds_s": ts}
            for peer, by_fn in times.items() for fn, ts in by_fn.items()]
    order = list(FUNCTIONS)
    return sorted(rows, key=lambda r: order.index(r["function"]))  # stable: peers in order


def pool_targets(rows: list[dict]) -> list[dict]:
    """Per function and shmtensor variant: >= 5x the stdlib pool, >= 1.5x joblib."""
    t = {(r["function"], r["peer"]): r["median_s"] for r in rows}
    targets = []
    for fn in FUNCTIONS:
        for shm in (SHM_SHARED, SHM_PLAIN):
            for peer, limit in ((STDLIB, 5), (JOBLIB, 1.5)):
                targets.append(target(f"{fn}: {peer} time / {shm} time",
                                      ratio(t.get((fn, peer)), t.get((fn, shm))), ">=", limit,
                                      section="pool"))
    return targets


def pool_table(rows: list[dict]) -> str:
    rows_out = [(r["function"], r["peer"], time_label(r["median_s"]),
                 time_label(min(r["rounds_s"])), time_label(max(r["rounds_s"])),
                 len(r["rounds_s"])) for r in rows]
    return _report.format_rows(("function", "peer", "median", "best", "worst", "rounds"),
                               rows_out, left=2)


def run(rounds: int, have_joblib: bool) -> Section:
    rows = measure_all(rounds, have_joblib)
    return Section(
        key="pool_map",
        title=f"Pool.map over {ARRAYS} arrays of {NBYTES // MB} MB float64 "
              f"({WORKERS} workers, spawn): time per map call",
        table=pool_table(rows),
        targets=pool_targets(rows),
        data={"arrays": ARRAYS, "array_bytes": NBYTES, "workers": WORKERS, "rows": rows,
              "joblib_mmap_mode": JOBLIB_MMAP_MODE},
        notes=["joblib's scale-in-place runs with mmap_mode='r+' (its default 'r' maps the "
               "inputs read-only: a *= 2 raises)",
               f"'{JOBLIB_AGAIN}': the same array objects again in one Parallel context, "
               "which joblib serves from its dump cache (not redone)"])
