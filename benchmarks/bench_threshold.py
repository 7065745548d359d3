"""Inline threshold sweep: where pickling a not-shared array into the message stops beating
a copy into a shared segment.

The same queue harness as the core table (a spawned producer, the parent times its gets),
with the producer's threshold forced to one path: every array inline, or every array
through a (recycled) segment.  The default threshold should sit between the largest size
where inline wins and the smallest where the segment wins.
"""

from __future__ import annotations

import math
from functools import partial

import shmtensor as st

from . import _report
from ._harness import Peer, time_queue
from ._report import KB, Section, ratio, size_label, target, time_label
from .bench_core import Settings, measure, warmup, without_info

SWEEP = "threshold sweep"
INLINE, SEGMENT = "shmtensor, forced inline", "shmtensor, forced segment"
SIZES = (16 * KB, 64 * KB, 128 * KB, 256 * KB, 512 * KB)
PEERS = (Peer(SWEEP, INLINE, "plain_inline", "shmtensor"),
         Peer(SWEEP, SEGMENT, "plain_segment", "shmtensor"))


def measure_sweep(settings: Settings) -> list[dict]:
    """Both forced paths at every size, through the core table's queue harness."""
    results = []
    for size in SIZES:
        n = settings.n(size)
        for peer in PEERS:
            run = partial(time_queue, peer, size, n, settings.rounds, warmup(n))
            results.append(measure(SWEEP, peer.label, size, run, settings.sessions))
    return results


def segment_over_inline(results: list[dict]) -> dict[int, float]:
    """Per size: segment time / inline time (< 1: the segment path is faster)."""
    times = {(r["peer"], r["size"]): r["per_array_s"] for r in results}
    ratios = {size: ratio(times.get((SEGMENT, size)), times.get((INLINE, size)))
              for size in SIZES}
    return {size: r for size, r in ratios.items() if r is not None}


def crossover(ratios: dict[int, float]) -> int | None:
    """Where segment/inline crosses 1 (interpolated in log size and log ratio), or None
    when it does not cross exactly once from inline-faster to segment-faster."""
    sizes = sorted(ratios)
    crossings = [(a, b) for a, b in zip(sizes, sizes[1:]) if ratios[a] > 1 >= ratios[b]]
    if len(crossings) != 1:
        return None
    a, b = crossings[0]
    la, lb = math.log(ratios[a]), math.log(ratios[b])
    frac = la / (la - lb)
    return int(round(math.exp(math.log(a) + frac * (math.log(b) - math.log(a)))))


def sweep_targets(ratios: dict[int, float], default: int) -> list[dict]:
    """Inline must win just below the default, the segment just above it."""
    below = max((s for s in ratios if s < default), default=None)
    above = min((s for s in ratios if s >= default), default=None)
    inline_over_segment = None if below is None else 1 / ratios[below]
    return [
        target(f"{size_label(below or 0)} (below the default {size_label(default)}): inline "
               "time / segment time", inline_over_segment, "<=", 1, section="threshold"),
        target(f"{size_label(above or 0)} (above the default {size_label(default)}): segment "
               "time / inline time", ratios.get(above), "<=", 1, section="threshold"),
    ]


def sweep_table(results: list[dict], ratios: dict[int, float]) -> str:
    """One row per size: both times, their ratio and the winner."""
    times = {(r["peer"], r["size"]): r["per_array_s"] for r in results}
    rows = []
    for size in SIZES:
        r = ratios.get(size)
        rows.append((size_label(size), time_label(times.get((INLINE, size))),
                     time_label(times.get((SEGMENT, size))),
                     "-" if r is None else f"{r:.2f}",
                     "-" if r is None else ("segment" if r < 1 else "inline")))
    return _report.format_rows(("size", "inline", "segment", "segment/inline", "faster"), rows)


def run(settings: Settings) -> Section:
    """Measure the sweep and judge the default threshold against it."""
    results = measure_sweep(settings)
    ratios = segment_over_inline(results)
    default = st.get_inline_threshold()
    cross = crossover(ratios)
    note = (f"measured crossover ~{cross // KB} KB (interpolated); default threshold "
            f"{size_label(default)}" if cross else
            f"no single crossover in the sweep; default threshold {size_label(default)}")
    return Section(
        key="threshold_sweep",
        title="inline threshold sweep: not-shared arrays, per array (queue harness)",
        table=sweep_table(results, ratios),
        targets=sweep_targets(ratios, default),
        data={"results": [without_info(r) for r in results],
              "segment_over_inline": {str(k): v for k, v in ratios.items()},
              "crossover_bytes": cross, "default_threshold_bytes": default},
        notes=[note])
