"""Scale: what a small shared array costs to make, and whether sending and holding many of
them stays linear (10,000 against 100,000 live arrays in the consumer).

Small arrays are carved from slabs (see docs/architecture.md): creating one is a bump of
an offset and a numpy view, and 100,000 live ones take a handful of segments, fds and
leases in each process instead of 100,000.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

import shmtensor
import shmtensor.multiprocessing as smp

from . import _report
from ._report import Section, target, time_label

CREATE_CALLS = 20_000
CREATE_ROUNDS = 7
COUNTS = (10_000, 100_000)
ELEMENTS = 128  # float64: 1 KB per array


def create_times(rounds: int) -> dict[str, list[float]]:
    """Per-call time of making a 1 KB array, per round, for shmtensor and numpy in turn."""
    calls = {
        "shmtensor.empty(128)": lambda: shmtensor.empty(ELEMENTS),
        "shmtensor.zeros(128)": lambda: shmtensor.zeros(ELEMENTS),
        "np.zeros(128)": lambda: np.zeros(ELEMENTS),
    }
    out: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            keep = [None] * 64  # a few alive at a time, as a loop body would hold them
            t0 = time.perf_counter()
            for i in range(CREATE_CALLS):
                keep[i & 63] = fn()
            out[name].append((time.perf_counter() - t0) / CREATE_CALLS)
    return out


def _produce(q, n: int) -> None:
    for i in range(n):
        q.put(shmtensor.full((ELEMENTS,), i))
    q.close()
    q.join_thread()


def send_and_hold(n: int) -> float:
    """Seconds for one producer to send ``n`` small shared arrays that the consumer (this
    process) keeps, from the first get to the last."""
    ctx = smp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_produce, args=(q, n))
    p.start()
    kept = [q.get(timeout=120)]
    t0 = time.perf_counter()
    kept.extend(q.get(timeout=120) for _ in range(n - 1))
    dt = time.perf_counter() - t0
    p.join(60)
    if p.exitcode != 0:
        raise RuntimeError(f"producer exited {p.exitcode}")
    if not all(int(a[0]) == i for i, a in enumerate(kept)):
        raise RuntimeError("an array arrived with another array's values")
    del kept
    shmtensor.empty_cache()
    return dt


def run(quick: bool) -> Section:
    rounds = 3 if quick else CREATE_ROUNDS
    create = create_times(rounds)
    med = {name: statistics.median(ts) for name, ts in create.items()}
    hold = {n: [] for n in COUNTS}
    for _ in range(1 if quick else 3):  # the two counts in turn, round by round
        for n in COUNTS:
            hold[n].append(send_and_hold(n))
    hold_med = {n: statistics.median(ts) for n, ts in hold.items()}
    small, large = COUNTS
    rows = [(name, time_label(m), time_label(min(create[name]))) for name, m in med.items()]
    rows += [(f"send + hold {n:,} x 1 KB shared", time_label(hold_med[n]),
              time_label(min(hold[n]))) for n in COUNTS]
    growth = _report.ratio(hold_med[large], hold_med[small])
    return Section(
        key="scale",
        title="Scale: making a 1 KB shared array; sending and holding many (fork)",
        table=_report.format_rows(("what", "median", "best"), rows),
        targets=[
            target("creating a 1 KB shared array (shmtensor.zeros(128)), median per call",
                   med["shmtensor.zeros(128)"] * 1e6, "<=", 3.0, unit="us", section="scale"),
            target(f"send + hold {large:,} / {small:,} small arrays (linear: 10x)",
                   growth, "<=", 12.0, section="scale"),
        ],
        data={"create_s": create, "hold_s": {str(n): ts for n, ts in hold.items()}},
        notes=["creation is timed with up to 64 arrays alive at once; every array lives in a "
               "slab of its strategy (file_descriptor here)"])
