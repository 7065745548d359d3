"""Fan-in: ``PRODUCERS`` spawned processes put arrays on one queue; the parent takes them.

shmtensor's producers each send one shared 1 MB array (``shmtensor.zeros``) again and
again; the stdlib's each send a plain 1 KB array (pickled into the message).  Every
producer starts, makes its array and waits for a go, so start-up is not timed; the parent
counts the arrays it takes between the 10% and the 90% mark of the total (the ends, where
producers start and finish at different times, are left out) and reports aggregate
arrays/s.  The two run in turn, ``sessions`` times; each result is the median session.
"""

from __future__ import annotations

import multiprocessing
import statistics
import sys
import time
from queue import Empty

import numpy as np

import shmtensor as st
import shmtensor.multiprocessing as smp

from . import _report
from ._harness import check_exit_codes, stop_processes
from ._report import KB, MB, Section, ratio, target

PRODUCERS = 8
MAXSIZE = 64
START_TIMEOUT = 120.0
STDLIB = "stdlib mp.Queue, 1 KB plain"
SHM = "shmtensor Queue, 1 MB shared"


def produce(shared: bool, nbytes: int, count: int, q, ready, go) -> None:
    """Child: make the array, say ready, wait for the go, put it ``count`` times."""
    a = st.zeros(nbytes // 8) if shared else np.ones(nbytes // 8)
    ready.put(None)
    go.wait()
    for _ in range(count):
        q.put(a)


def session(shared: bool, count: int) -> float:
    """Aggregate arrays/s of one fan-in run (fresh producers)."""
    ctx = smp.get_context("spawn") if shared else multiprocessing.get_context("spawn")
    nbytes = MB if shared else KB
    q, ready, go = ctx.Queue(MAXSIZE), ctx.SimpleQueue(), ctx.Event()
    procs = [ctx.Process(target=produce, args=(shared, nbytes, count, q, ready, go),
                         daemon=True) for _ in range(PRODUCERS)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get()
        total = PRODUCERS * count
        lo, hi = total // 10, total - total // 10
        go.set()
        get = q.get
        for _ in range(lo):
            _get_checked(get, procs)
        t0 = time.perf_counter()
        for _ in range(hi - lo):
            get()
        elapsed = time.perf_counter() - t0
        for _ in range(total - hi):
            _get_checked(get, procs)
    finally:
        stop_processes(procs)
        q.close()
        q.join_thread()
        st.empty_cache()
    check_exit_codes(procs, "fan-in producers")
    return (hi - lo) / elapsed


def _get_checked(get, procs):
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            return get(timeout=0.5)
        except Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                raise RuntimeError(f"fan-in stalled (producer exit codes {failed})") from None


def run(quick: bool) -> Section:
    sessions, count = (1, 1500) if quick else (3, 4000)
    rates: dict[str, list[float]] = {STDLIB: [], SHM: []}
    for k in range(sessions):
        for label, shared in ((STDLIB, False), (SHM, True)):
            rate = session(shared, count)
            rates[label].append(rate)
            print(f"  fan-in       session {k + 1} {label:<30} {rate:10.0f} arrays/s",
                  file=sys.stderr, flush=True)
    med = {label: statistics.median(r) for label, r in rates.items()}
    rows = [(label, f"{med[label]:.0f}", " ".join(f"{x:.0f}" for x in rates[label]))
            for label in rates]
    return Section(
        key="fanin",
        title=f"fan-in: {PRODUCERS} producer processes -> 1 consumer, {count} arrays each "
              f"(spawn, queue maxsize {MAXSIZE}): aggregate arrays/s, median of {sessions}",
        table=_report.format_rows(("queue, arrays", "arrays/s", "sessions"), rows),
        targets=[target(f"fan-in arrays/s: {SHM} / {STDLIB}", ratio(med[SHM], med[STDLIB]),
                        ">=", 3, section="fanin")],
        data={"producers": PRODUCERS, "count": count, "maxsize": MAXSIZE, "rates": rates})


if __name__ == "__main__":  # this section alone: python -m benchmarks.bench_fanin [--quick]
    print(run("--quick" in sys.argv).render())
