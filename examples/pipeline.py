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

SIZES = [1 << 10, 64 << 10, 256 << 10, 1 << 20, 16 << 20, 128 << 20]


def producer(queue, nbytes: int, count: int, shared: bool) -> None:
    """Send ``count`` fresh arrays of ``nbytes``, each filled before it is sent and never
    written after (a loader's batches): nothing is overwritten while in flight."""
    make = shmtensor.empty if shared else np.empty
    queue.put("ready")
    for i in range(count):
        a = make(nbytes // 8)
        a.fill(i)
        queue.put(a)
        del a
    queue.put(shmtensor.debug_info())


def run(ctx, nbytes: int, count: int, shared: bool = False) -> tuple[float, dict]:
    """Seconds per array received (the first one, which pays for start-up, not counted),
    and the producer's counters."""
    q = ctx.Queue(maxsize=8)
    p = ctx.Process(target=producer, args=(q, nbytes, count, shared))
    p.start()
    assert q.get(timeout=60) == "ready"
    first = q.get(timeout=60)
    t0 = time.perf_counter()
    for i in range(1, count):
        a = q.get(timeout=60)
        assert a[0] == i and a[-1] == i  # the consumer 'uses' it: every message is its own
        del a
    dt = (time.perf_counter() - t0) / max(count - 1, 1)
    info = q.get(timeout=60)
    p.join(60)
    del first
    return dt, info if isinstance(info, dict) else {}


def size_label(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g} {unit}"
    return f"{nbytes} B"


def fmt(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


COLUMNS = """\
Each time is how long this process takes to receive one array, on average, while a
producer process makes, fills and sends a fresh array per message through a Queue (lower
is better; the first array, which pays for start-up, is not counted).  The producer's
allocation and fill are in every column alike.  speed-up = stdlib time / shmtensor time:
above 1.0x shmtensor is faster.
  stdlib     multiprocessing's Queue: every array is pickled through a pipe.
  shmtensor  the same plain numpy array through shmtensor's Queue: under the inline
             threshold ({threshold}) it is pickled into the message, as the stdlib does;
             from there on it is copied once into shared memory that shmtensor recycles,
             and only a handle crosses.
  shared     the producer makes each array with shmtensor.empty: nothing is copied, only
             a handle crosses.
"""

INLINE_ROWS = """\
Rows under the inline threshold ({threshold}): the array is pickled into the message just as
the stdlib pickles it, so shmtensor has no copy to save and the two are about even (0.5x
to 2x from run to run and machine to machine).  Near the threshold a segment's fixed cost
per message (its fd and lease) is about what the copy it saves costs, so the speed-up
grows with the size above it.  A shared array (last column) is never copied."""

SLOWER_INLINE = ("{mark} slower than the stdlib: {size} is under or near the inline threshold "
                 "(see above).")
SLOWER_SHARED = ("{mark} slower than the stdlib: a shared array crosses as a handle with its fd "
                 "and lease, a fixed\n  few tens of us; at {size} the stdlib's copy costs as "
                 "little.")
SLOWER_OTHER = ("{mark} slower than the stdlib: not expected at {size}; on a busy machine one "
                "run can be\n  unlucky (run the demo again).")


def main() -> int:
    std = multiprocessing.get_context("spawn")
    shm = smp.get_context("spawn")
    threshold = size_label(shmtensor.get_inline_threshold())
    print(f"shmtensor {shmtensor.__version__} pipeline: a producer process sends arrays to this "
          f"one (spawn context,\nstrategy {smp.get_sharing_strategy()}, inline threshold "
          f"{threshold}).\n")
    print(COLUMNS.format(threshold=threshold))
    head = (f"{'size':>9}  {'stdlib':>10}  {'shmtensor':>10}  {'speed-up':>8}  "
            f"{'shared':>10}  {'speed-up':>8}")
    print(head)
    print("-" * len(head))
    notes = []
    try:
        with leak_checker(timeout=10):
            for nbytes in SIZES:
                count = max(5, min(500, (256 << 20) // nbytes))
                t_std, _ = run(std, nbytes, min(count, 20) if nbytes >= 16 << 20 else count)
                t_shm, info = run(shm, nbytes, count)
                t_sh, _ = run(shm, nbytes, count, shared=True)
                label = size_label(nbytes)
                # marked where the speed-up shows under 1.0x
                slow, slow_shared = t_std / t_shm < 0.95, t_std / t_sh < 0.95
                print(f"{label:>9}  {fmt(t_std):>10}  {fmt(t_shm):>10}  "
                      f"{t_std / t_shm:7.1f}x{' *' if slow else '  '}{fmt(t_sh):>10}  "
                      f"{t_std / t_sh:7.1f}x{' **' if slow_shared else ''}", flush=True)
                below = nbytes < shmtensor.get_inline_threshold()
                near = nbytes < 4 * shmtensor.get_inline_threshold()
                if slow:
                    notes.append((SLOWER_INLINE if near else SLOWER_OTHER).format(
                        mark="*", size=label, threshold=threshold))
                if slow_shared:
                    notes.append((SLOWER_SHARED if near else SLOWER_OTHER).format(
                        mark="**", size=label))
                if not below:
                    made = info.get("segments_created", 0)
                    print(f"{'':>11}(the producer made {made} segment{'s' * (made != 1)}, "
                          f"{size_label(info.get('bytes_created', 0))} in all, for these "
                          f"{count} arrays)")
            if SIZES[0] < shmtensor.get_inline_threshold():
                print("\n" + INLINE_ROWS.format(threshold=threshold))
            for note in notes:
                print(note)
        print("\nleak report: clean (no segments, fds or processes left behind)")
        return 0
    except LeakError as e:
        print(f"\nleak report: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
