"""Where ``Pool.map(sum)`` over pre-shared arrays spends its time beyond the compute.

Run as ``python -m benchmarks._profile_pool [ROUNDS]``.  Per round: the map's wall time,
and from each worker the time inside ``a.sum()``, its page faults (``getrusage``
``ru_minflt`` deltas around the sum, and over the whole task including the unpickle that
maps the segment), and the same for a fresh pool; beside the serial compute floor of the
same arrays in this process (pages already mapped), measured in turn.
"""

from __future__ import annotations

import os
import resource
import sys
import time

import numpy as np

import shmtensor as st
import shmtensor.multiprocessing as smp

ARRAYS, NBYTES, WORKERS = 32, 32 << 20, 2


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def profiled_sum(a: np.ndarray) -> tuple[float, float, int, int]:
    """(sum, seconds in the sum, minor faults in the sum, pid)."""
    f0, t0 = faults(), time.perf_counter()
    s = float(a.sum())
    return s, time.perf_counter() - t0, faults() - f0, os.getpid()


def worker_faults(_) -> tuple[int, int]:
    time.sleep(0.05)  # let every worker take one
    return os.getpid(), faults()


def serial_floor(arrays) -> float:
    t0 = time.perf_counter()
    for a in arrays:
        a.sum()
    return time.perf_counter() - t0


def one_round(pool, arrays) -> dict:
    before = dict(pool.map(worker_faults, range(WORKERS * 4)))
    t0 = time.perf_counter()
    out = pool.map(profiled_sum, arrays)
    wall = time.perf_counter() - t0
    after = dict(pool.map(worker_faults, range(WORKERS * 4)))
    per_pid: dict[int, list] = {}
    for s, dt, f, pid in out:
        per_pid.setdefault(pid, []).append((dt, f))
    return {
        "wall": wall,
        "sum_s_per_worker": {p: sum(d for d, _ in v) for p, v in per_pid.items()},
        "faults_in_sum": sum(f for _, f, _, _ in [(o[1], o[2], 0, 0) for o in out]),
        "faults_total": sum(after.get(p, 0) - before.get(p, 0) for p in after),
    }


def main(rounds: int) -> None:
    arrays = [st.share_memory(np.full(NBYTES // 8, i + 1.0)) for i in range(ARRAYS)]
    print(f"load {os.getloadavg()[0]:.2f}")
    for fresh in (True, False):
        pool = smp.get_context("spawn").Pool(WORKERS)
        pool.map(worker_faults, range(WORKERS * 4))
        for r in range(rounds):
            floor = serial_floor(arrays) / WORKERS
            res = one_round(pool, arrays)
            busy = max(res["sum_s_per_worker"].values())
            print(f"{'fresh pool' if r == 0 else 'same pool ':<10} round {r}: "
                  f"map {res['wall'] * 1e3:7.1f} ms  floor {floor * 1e3:6.1f} ms  "
                  f"ratio {res['wall'] / floor:5.2f}  busiest worker in sum {busy * 1e3:6.1f} ms  "
                  f"faults in sum {res['faults_in_sum']:7d}  whole map {res['faults_total']:7d}")
        pool.close()
        pool.join()
        st.empty_cache()
        if not fresh:
            break


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
