"""Loader: steady-state batches/s of a 4-worker loader of 8 MB float32 batches.

shmtensor's spawn context with a ``BatchPool`` of ``SLOTS`` slots per worker, against the
stdlib's spawn context with a fresh array per batch (see :mod:`benchmarks._loader`).
shmtensor's loader runs twice, with a short and a long batch count: the segments its
workers made must not grow with the batches (``workers x slots``, reused).
"""

from __future__ import annotations

import multiprocessing
import sys
from dataclasses import asdict, dataclass

import numpy as np

import shmtensor.multiprocessing as smp

from . import _report
from ._loader import BATCH, DTYPE, SLOTS, LoaderRun, run_loader
from ._report import MB, Section, ratio, target

WORKERS, SKIP = 4, 10
BATCH_MB = int(np.prod(BATCH)) * DTYPE.itemsize // MB
STDLIB, SHM = "stdlib spawn context, fresh arrays", "shmtensor spawn context, BatchPool"


@dataclass(frozen=True)
class Plan:
    stdlib_batches: int
    shmtensor_batches: tuple[int, int]  # short, long


FULL, QUICK = Plan(200, (200, 1000)), Plan(60, (60, 240))


def measure(label: str, ctx, nbatches: int, use_pool: bool) -> dict:
    run: LoaderRun = run_loader(ctx, WORKERS, nbatches, use_pool, SKIP)
    print(f"  loader       {label:<40} {nbatches:>5} batches  "
          f"{run.steady_batches_per_s:8.1f} batches/s  {run.segments_created} segments made",
          file=sys.stderr, flush=True)
    return {"context": label, **asdict(run)}


def loader_targets(rows: list[dict]) -> list[dict]:
    """>= 5x the stdlib's rate; no new segments per batch; workers x slots segments."""
    std = next(r for r in rows if r["context"] == STDLIB)
    short, long = [r for r in rows if r["context"] == SHM]
    per_batch = ((long["segments_created"] - short["segments_created"])
                 / (long["batches"] - short["batches"]))
    return [
        target(f"batches/s, {long['batches']} batches: shmtensor / stdlib",
               ratio(long["steady_batches_per_s"], std["steady_batches_per_s"]), ">=", 5,
               section="loader"),
        target(f"new segments per batch, between {short['batches']} and {long['batches']} "
               "batches", per_batch, "<=", 0, unit="segments/batch", section="loader"),
        target(f"segments the workers made for {long['batches']} batches (want workers x "
               "slots)", long["segments_created"], "<=", WORKERS * SLOTS, unit="segments",
               section="loader"),
    ]


def loader_table(rows: list[dict]) -> str:
    out = [(r["context"], r["batches"], r["clock_started_at"],
            f"{r['steady_batches_per_s']:.1f}",
            f"{r['steady_batches_per_s'] * BATCH_MB / 1024:.2f}", r["segments_created"])
           for r in rows]
    return _report.format_rows(("context", "batches", "clock from", "batches/s", "GB/s",
                                "segments made"), out)


def run(quick: bool) -> Section:
    plan = QUICK if quick else FULL
    rows = [measure(STDLIB, multiprocessing.get_context("spawn"), plan.stdlib_batches, False)]
    shm_ctx = smp.get_context("spawn")
    rows += [measure(SHM, shm_ctx, n, True) for n in plan.shmtensor_batches]
    return Section(
        key="loader",
        title=f"loader: {WORKERS} workers, {BATCH_MB} MB {DTYPE} batches {BATCH}, steady "
              f"state (clock from the batch by which every worker delivered and >= {SKIP} "
              "batches were taken)",
        table=loader_table(rows),
        targets=loader_targets(rows),
        data={"workers": WORKERS, "slots": SLOTS, "batch_shape": list(BATCH),
              "dtype": str(DTYPE), "skip": SKIP, "rows": rows})
