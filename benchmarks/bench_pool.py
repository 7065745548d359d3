"""``Pool.map`` over 32 arrays of 32 MB (float64, 1 GB in all), two workers.

Contenders (:mod:`benchmarks._pool_peers`): shmtensor's spawn ``ctx.Pool`` with the arrays
pre-shared (``share_memory``) and not shared (plain numpy: each is copied once into a
segment), the stdlib's spawn ``Pool`` (pickles every array through a pipe), ``joblib``
on loky (memmaps every array over 1 MB), loky's own executor, mpire's ``WorkerPool``, and
Ray with the arrays pre-put in its object store and as plain task arguments.  Beside them
the compute floor: the serial sum of the same arrays in this process, divided by the
workers, and the same sums on two threads of this process (what two cores give for a
memory-bound sum, with no process boundary).

Every contender is started first (pools, workers, Ray's ``ray.put``; each warmed with one
small map), then the rounds run interleaved: each round times one map of every function
of every contender, in turn.  Only the map calls are timed; each result is checked.  A
row's time is the median of its rounds; its first round is shown too (the first map of
real arrays on a started pool: the workers map each array for the first time).
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from . import _report
from ._pool_peers import (ALL, FUNCTIONS, WORKERS, Contender, Joblib, Loky,
                          Mpire, RayPlain, RayPrePut, SerialFloor, ShmtensorPool,
                          ShmtensorShared, StdlibPool, ThreadFloor)
from ._report import MB, Section, ratio, target, time_label

ARRAYS, NBYTES = 32, 32 * MB
STDLIB, JOBLIB = StdlibPool.label, Joblib.label
SHM_PLAIN, SHM_SHARED = ShmtensorPool.label, ShmtensorShared.label
FLOOR = f"compute floor (serial / {WORKERS})"


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


def progress(text: str) -> None:
    print(f"  pool map     {text}", file=sys.stderr, flush=True)


def start_all(arrays: list[np.ndarray]) -> tuple[list[Contender], dict[str, str]]:
    """Every contender that can run, started; and why the others are skipped."""
    started, skipped = [], {}
    for cls in ALL:
        contender = cls(arrays)
        why = contender.missing()
        if why is None:
            try:
                contender.start()
            except Exception as e:  # one broken peer must not hide the others' numbers
                why = f"failed to start: {type(e).__name__}: {e}"
        if why is not None:
            skipped[cls.label] = why
            progress(f"{cls.label}: skipped ({why})")
            continue
        started.append(contender)
    return started, skipped


def measure_all(rounds: int) -> tuple[list[dict], dict[str, str]]:
    """One row per (function, contender): every round's time and their median."""
    arrays = make_inputs()
    contenders, skipped = start_all(arrays)
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for r in range(rounds):
            for fn in FUNCTIONS:
                # scale in place doubles the inputs: put them back before the next function
                for c in contenders:
                    if fn not in c.functions:
                        continue
                    t0 = time.perf_counter()
                    result = c.call(fn)
                    elapsed = time.perf_counter() - t0
                    check(fn, result)
                    del result
                    if fn == "scale in place":
                        restore(c)
                    times.setdefault((fn, c.label), []).append(elapsed)
                    progress(f"round {r + 1} {fn:<14} {c.label:<34} {time_label(elapsed):>10}")
    finally:
        for c in contenders:
            c.close()
    rows = []
    for (fn, label), ts in times.items():
        rows.append({"function": fn, "peer": label, "median_s": statistics.median(ts),
                     "first_s": ts[0], "rounds_s": ts})
        if label == SerialFloor.label:
            rows.append({"function": fn, "peer": FLOOR,
                         "median_s": statistics.median(ts) / WORKERS,
                         "first_s": ts[0] / WORKERS, "rounds_s": [t / WORKERS for t in ts]})
    return rows, skipped


def restore(c: Contender) -> None:
    """Undo ``scale in place``: its inputs were doubled where they lie (joblib's memmaps
    are copies, and its r+ writes do not reach the inputs)."""
    if isinstance(c, Joblib):
        return
    for i, a in enumerate(c.arrays):
        a.fill(i + 1.0)


def pool_targets(rows: list[dict], skipped: dict[str, str]) -> list[dict]:
    """The issue's targets (floor, Ray, mpire, loky) and the earlier ones (stdlib, joblib)."""
    t = {(r["function"], r["peer"]): r["median_s"] for r in rows}

    def over(fn: str, peer: str, shm: str) -> float | None:
        return ratio(t.get((fn, peer)), t.get((fn, shm)))

    targets = [
        target(f"sum: {SHM_SHARED} time / {FLOOR}", over("sum", SHM_SHARED, FLOOR), "<=", 1.5,
               section="pool"),
        target(f"sum: {RayPrePut.label} time / {SHM_SHARED} time",
               over("sum", RayPrePut.label, SHM_SHARED), ">=", 1.2, section="pool"),
        target(f"sum: {Mpire.label} time / {SHM_SHARED} time",
               over("sum", Mpire.label, SHM_SHARED), ">=", 15, section="pool"),
        target(f"sum: {Loky.label} time / {SHM_SHARED} time",
               over("sum", Loky.label, SHM_SHARED), ">=", 15, section="pool"),
        target(f"sum: {RayPlain.label} time / {SHM_PLAIN} time",
               over("sum", RayPlain.label, SHM_PLAIN), ">=", 2, section="pool"),
    ]
    for fn in FUNCTIONS:
        for shm in (SHM_SHARED, SHM_PLAIN):
            for peer, limit in ((STDLIB, 5), (JOBLIB, 1.5)):
                targets.append(target(f"{fn}: {peer} time / {shm} time", over(fn, peer, shm),
                                      ">=", limit, section="pool"))
    for tg in targets:  # a target whose peer was skipped says so
        for label, why in skipped.items():
            if label in tg["name"]:
                tg["name"] += f" [skipped: {why}]"
    return targets


def pool_table(rows: list[dict], skipped: dict[str, str]) -> str:
    out = [(r["function"], r["peer"], time_label(r["median_s"]), time_label(r["first_s"]),
            time_label(min(r["rounds_s"])), time_label(max(r["rounds_s"])),
            len(r["rounds_s"])) for r in rows]
    out += [("-", label, "skipped", "-", "-", "-", 0) for label in skipped]
    return _report.format_rows(("function", "peer", "median", "first", "best", "worst",
                                "rounds"), out, left=2)


def run(rounds: int, have_joblib: bool = True) -> Section:
    """``have_joblib`` is kept for the caller; every contender checks its own import."""
    rows, skipped = measure_all(rounds)
    order = list(FUNCTIONS)
    rows.sort(key=lambda r: order.index(r["function"]))  # stable: contenders in order
    return Section(
        key="pool_map",
        title=f"Pool.map over {ARRAYS} arrays of {NBYTES // MB} MB float64 "
              f"({WORKERS} workers): time per map call, contenders interleaved by round",
        table=pool_table(rows, skipped),
        targets=pool_targets(rows, skipped),
        data={"arrays": ARRAYS, "array_bytes": NBYTES, "workers": WORKERS, "rows": rows,
              "skipped": skipped, "joblib_mmap_mode": Joblib.MMAP_MODE},
        notes=["joblib's scale-in-place runs with mmap_mode='r+' (its default 'r' maps the "
               "inputs read-only: a *= 2 raises)",
               f"'{ThreadFloor.label}': the sums on {WORKERS} threads of one process, arrays "
               "mapped: what this machine's cores give a memory-bound sum in parallel",
               "Ray, loky and mpire run the sum only (Ray's stored arrays are read-only)"])


if __name__ == "__main__":  # this section alone: python -m benchmarks.bench_pool [ROUNDS]
    print(run(int(sys.argv[1]) if len(sys.argv) > 1 else 3).render())
