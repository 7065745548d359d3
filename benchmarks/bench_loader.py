"""Loader: steady-state batches/s of a 4-worker loader of 8 MB float32 batches.

shmtensor's spawn context with a ``BatchPool`` of ``SLOTS`` slots per worker, against the
stdlib's spawn context with a fresh array per batch, ``torch.utils.data.DataLoader`` with
its default context over the same numpy dataset, and grain's multiprocessing
``DataLoader`` over it (see :mod:`benchmarks._loader`).  shmtensor's loader runs twice,
with a short and a long batch count: the segments its workers made must not grow with the
batches (``workers x slots``, reused).  The contenders run in turn, ``sessions`` times;
each row is the median session.  A contender that cannot be imported is shown as skipped.
"""

from __future__ import annotations

import importlib
import multiprocessing
import sys
import warnings
from dataclasses import asdict, dataclass

import numpy as np

import shmtensor.multiprocessing as smp

from . import _report
from ._loader import (BATCH, DTYPE, SLOTS, LoaderRun, grain_loader, run_iterable, run_loader,
                      torch_loader)
from ._report import MB, Section, ratio, target

WORKERS, SKIP = 4, 10
BATCH_MB = int(np.prod(BATCH)) * DTYPE.itemsize // MB
STDLIB, SHM = "stdlib spawn context, fresh arrays", "shmtensor spawn context, BatchPool"
TORCH = "torch DataLoader, default context"
GRAIN = "grain DataLoader (multiprocessing)"
PEERS = {TORCH: ("torch", torch_loader), GRAIN: ("grain", grain_loader)}


@dataclass(frozen=True)
class Plan:
    stdlib_batches: int
    shmtensor_batches: tuple[int, int]  # short, long
    sessions: int


FULL, QUICK = Plan(200, (200, 1000), 3), Plan(60, (60, 240), 1)


def measure(label: str, ctx, nbatches: int, use_pool: bool) -> dict:
    run: LoaderRun = run_loader(ctx, WORKERS, nbatches, use_pool, SKIP)
    print(f"  loader       {label:<40} {nbatches:>5} batches  "
          f"{run.steady_batches_per_s:8.1f} batches/s  {run.segments_created} segments made",
          file=sys.stderr, flush=True)
    return {"context": label, **asdict(run)}


def measure_peer(label: str, nbatches: int) -> dict:
    """torch's or grain's loader over the same dataset, timed from batch ``SKIP``."""
    _, make = PEERS[label]
    with warnings.catch_warnings():  # torch: "4 workers, suggested max 2" (we mean it)
        warnings.simplefilter("ignore", UserWarning)
        run = run_iterable(make(WORKERS, nbatches), nbatches, SKIP)
    print(f"  loader       {label:<40} {nbatches:>5} batches  "
          f"{run.steady_batches_per_s:8.1f} batches/s", file=sys.stderr, flush=True)
    return {"context": label, **asdict(run)}


def missing(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, or a wheel whose libraries do not load
        return f"{module} not importable ({type(e).__name__}: {e})"
    return None


def median_row(rows: list[dict]) -> dict:
    """The median session's row, with every session's rate."""
    mid = sorted(rows, key=lambda r: r["steady_batches_per_s"])[len(rows) // 2]
    return {**mid, "sessions_batches_per_s": [r["steady_batches_per_s"] for r in rows]}


def loader_targets(rows: list[dict], skipped: dict[str, str]) -> list[dict]:
    """>= 5x the stdlib's rate, 3x torch's, 2x grain's; no new segments per batch;
    workers x slots segments."""
    std = next(r for r in rows if r["context"] == STDLIB)
    short, long = [r for r in rows if r["context"] == SHM]
    rate = {r["context"]: r["steady_batches_per_s"] for r in rows}
    per_batch = ((long["segments_created"] - short["segments_created"])
                 / (long["batches"] - short["batches"]))
    peers = []
    for label, limit in ((TORCH, 3), (GRAIN, 2)):
        note = f" [skipped: {skipped[label]}]" if label in skipped else ""
        peers.append(target(f"batches/s, {long['batches']} batches: shmtensor / {label}{note}",
                            ratio(long["steady_batches_per_s"], rate.get(label)), ">=", limit,
                            section="loader"))
    return [
        target(f"batches/s, {long['batches']} batches: shmtensor / stdlib",
               ratio(long["steady_batches_per_s"], std["steady_batches_per_s"]), ">=", 5,
               section="loader"),
        *peers,
        target(f"new segments per batch, between {short['batches']} and {long['batches']} "
               "batches", per_batch, "<=", 0, unit="segments/batch", section="loader"),
        target(f"segments the workers made for {long['batches']} batches (want workers x "
               "slots)", long["segments_created"], "<=", WORKERS * SLOTS, unit="segments",
               section="loader"),
    ]


def loader_table(rows: list[dict], skipped: dict[str, str]) -> str:
    out = [(r["context"], r["batches"], r["clock_started_at"],
            f"{r['steady_batches_per_s']:.1f}",
            f"{r['steady_batches_per_s'] * BATCH_MB / 1024:.2f}",
            r["segments_created"] if r["context"] in (STDLIB, SHM) else "-",
            " ".join(f"{x:.0f}" for x in r["sessions_batches_per_s"])) for r in rows]
    out += [(label, "skipped", "-", "-", "-", "-", why) for label, why in skipped.items()]
    return _report.format_rows(("context", "batches", "clock from", "batches/s", "GB/s",
                                "segments made", "sessions"), out)


def run(quick: bool) -> Section:
    plan = QUICK if quick else FULL
    skipped = {label: why for label, (module, _) in PEERS.items()
               if (why := missing(module)) is not None}
    shm_ctx = smp.get_context("spawn")
    todo = [(STDLIB, plan.stdlib_batches,
             lambda n: measure(STDLIB, multiprocessing.get_context("spawn"), n, False))]
    todo += [(SHM, n, lambda n: measure(SHM, shm_ctx, n, True)) for n in plan.shmtensor_batches]
    todo += [(label, plan.stdlib_batches, lambda n, label=label: measure_peer(label, n))
             for label in PEERS if label not in skipped]
    sessions: list[list[dict]] = [[] for _ in todo]
    for _ in range(plan.sessions):  # interleaved: each session runs every contender once
        for i, (_, n, measure_one) in enumerate(todo):
            sessions[i].append(measure_one(n))
    rows = [median_row(done) for done in sessions]
    return Section(
        key="loader",
        title=f"loader: {WORKERS} workers, {BATCH_MB} MB {DTYPE} batches {BATCH}, steady "
              f"state (clock from the batch by which every worker delivered and >= {SKIP} "
              "batches were taken)",
        table=loader_table(rows, skipped),
        targets=loader_targets(rows, skipped),
        data={"workers": WORKERS, "slots": SLOTS, "batch_shape": list(BATCH),
              "dtype": str(DTYPE), "skip": SKIP, "rows": rows, "skipped": skipped},
        notes=[f"{TORCH} and {GRAIN}: each item is a batch made by the same dataset code, "
               f"clock from batch {SKIP}"])


if __name__ == "__main__":  # this section alone: python -m benchmarks.bench_loader [--quick]
    print(run("--quick" in sys.argv).render())
