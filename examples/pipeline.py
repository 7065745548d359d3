"""A producer/consumer pipeline: arrays of several sizes through shmtensor's Queue and the
stdlib's, timed side by side, with a leak report at the end.

Run it with ``scripts/demo`` (or ``python examples/pipeline.py`` inside the venv).
"""

from __future__ import annotations

import multiprocessing
import sys
import time

import numpy as np

import shmtensor
import shmtensor.multiprocessing as smp
from shmtensor.testing import LeakError, leak_checker

SIZES = [1 << 10, 64 << 10, 1 << 20, 16 << 20, 128 << 20]


def producer(queue, nbytes: int, count: int, shared: bool) -> None:
    """Send ``count`` arrays of ``nbytes`` (one reused array, like a loader's buffer)."""
    n = nbytes // 8
    a = shmtensor.zeros(n) if shared else np.zeros(n)
    queue.put("ready")
    for i in range(count):
        a[0] = i
        queue.put(a)
    queue.put(shmtensor.debug_info())


def run(ctx, nbytes: int, count: int, shared: bool = False) -> tuple[float, dict]:
    """Seconds per array received, and the producer's counters."""
    q = ctx.Queue(maxsize=8)
    p = ctx.Process(target=producer, args=(q, nbytes, count, shared))
    p.start()
    assert q.get(timeout=60) == "ready"
    first = q.get(timeout=60)
    t0 = time.perf_counter()
    for _ in range(count - 1):
        a = q.get(timeout=60)
        checksum = float(a[0])
    dt = (time.perf_counter() - t0) / max(count - 1, 1)
    info = q.get(timeout=60)
    p.join(60)
    del first, a
    return dt, info if isinstance(info, dict) else {}


def fmt(seconds: float) -> str:
    return f"{seconds * 1e6:9.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:9.2f} ms"


def main() -> int:
    std = multiprocessing.get_context("spawn")
    shm = smp.get_context("spawn")
    print(f"shmtensor {shmtensor.__version__}: spawn context, producer in a child, "
          f"strategy {smp.get_sharing_strategy()}\n")
    print(f"{'array size':>12} | {'stdlib Queue':>12} | {'shmtensor':>12} | {'shmtensor, shared':>17} | speed-up")
    print("-" * 78)
    try:
        with leak_checker(timeout=10) as lc:
            for nbytes in SIZES:
                count = max(5, min(500, (256 << 20) // nbytes))
                t_std, _ = run(std, nbytes, min(count, 20) if nbytes >= 16 << 20 else count)
                t_shm, info = run(shm, nbytes, count)
                t_sh, _ = run(shm, nbytes, count, shared=True)
                label = f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"
                print(f"{label:>12} | {fmt(t_std)} | {fmt(t_shm)} | {fmt(t_sh):>17} | "
                      f"{t_std / t_shm:6.1f}x / {t_std / t_sh:7.1f}x", flush=True)
                if nbytes >= 1 << 20:
                    print(f"{'':>12}   producer made {info.get('segments_created')} segments, "
                          f"reused them {info.get('segments_recycled')} times")
        print("\nleak report: clean (no segments, fds or processes left behind)")
        return 0
    except LeakError as e:
        print(f"\nleak report: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
