"""torch's DataLoader with its default collate: torch's default context against shmtensor's.

A map-style dataset of 8 MiB float32 numpy items, 4 workers, batch size 1 (the DataLoader's
default), steady-state items/s.  Default collate turns each item into a torch CPU tensor in
the worker and stacks it into a new shared storage; on torch's default context (fork) that
storage is torch shared memory handed over by fd, on shmtensor's spawn context it is a
recycled segment that crosses without a copy (:mod:`shmtensor._torch`).  The identity
collate row (numpy items crossing shmtensor's queue as arrays) is the reference.  The three
loaders take turns round by round and each one's median is kept: the machine is shared.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from . import _report
from ._report import MB, Section, ratio, target

WORKERS = 4
ITEM, DTYPE = (2048, 1024), np.dtype(np.float32)  # 8 MiB
ITEM_MB = int(np.prod(ITEM)) * DTYPE.itemsize // MB
POOL = 4  # distinct items per worker, made once: the dataset costs no allocation per item
SKIP = 2 * WORKERS  # items taken before the clock starts (worker start-up)
TORCH, SHM, IDENTITY = ("torch default context (fork), default collate",
                        "shmtensor spawn context, default collate",
                        "shmtensor spawn context, identity collate (numpy)")
TARGET = 3.0


@dataclass(frozen=True)
class Plan:
    rounds: int
    items: int


FULL, QUICK = Plan(5, 300), Plan(2, 120)


class Items:
    """``n`` 8 MiB items; item ``i`` is filled with ``i % POOL`` (made once per worker)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pool: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if self.pool is None:
            self.pool = [np.full(ITEM, k, DTYPE) for k in range(POOL)]
        return self.pool[i % POOL]


def identity(batch):
    """The collate that leaves the batch a list of numpy arrays."""
    return batch


def _loader(label: str, n: int):
    from torch.utils.data import DataLoader

    import shmtensor.multiprocessing as smp
    if label == TORCH:
        return DataLoader(Items(n), num_workers=WORKERS)
    ctx = smp.get_context("spawn")
    if label == SHM:
        return DataLoader(Items(n), num_workers=WORKERS, multiprocessing_context=ctx)
    return DataLoader(Items(n), num_workers=WORKERS, multiprocessing_context=ctx,
                      collate_fn=identity)


def steady_rate(label: str, n: int) -> float:
    """Items/s from the ``SKIP``-th item to the last, checking each item's content."""
    stamps = []
    for i, batch in enumerate(_loader(label, n)):
        value = float((batch[0] if isinstance(batch, list) else batch).reshape(-1)[0])
        if value != i % POOL:
            raise AssertionError(f"{label}: item {i} holds {value}")
        del batch
        stamps.append(time.perf_counter())
    return (len(stamps) - 1 - SKIP) / (stamps[-1] - stamps[SKIP])


def torch_version() -> str | None:
    try:
        import torch
    except (ImportError, OSError):
        return None
    return torch.__version__


def run(quick: bool) -> Section:
    plan = QUICK if quick else FULL
    title = (f"torch DataLoader, default collate: {WORKERS} workers, {ITEM_MB} MiB {DTYPE} "
             f"items, batch size 1, {plan.items} items x {plan.rounds} rounds, interleaved")
    name = "items/s, default collate: shmtensor spawn context / torch default context"
    if torch_version() is None:
        return Section(key="torch_loader", title=f"{title}: skipped (torch not importable)",
                       table="", targets=[target(name, None, ">=", TARGET,
                                                 section="torch_loader")])
    import warnings
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    labels = (TORCH, SHM, IDENTITY)
    rates: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(plan.rounds):
        for label in labels:
            rates[label].append(steady_rate(label, plan.items))
            print(f"  torch loader round {r + 1}/{plan.rounds}  {label:<52} "
                  f"{rates[label][-1]:8.1f} items/s", file=sys.stderr, flush=True)
    medians = {label: statistics.median(v) for label, v in rates.items()}
    per_round = [s / t for s, t in zip(rates[SHM], rates[TORCH])]
    rows = [(label, f"{medians[label]:.1f}", f"{medians[label] * ITEM_MB / 1024:.2f}",
             f"{medians[label] / medians[TORCH]:.2f}x",
             " ".join(f"{x:.0f}" for x in rates[label])) for label in labels]
    return Section(
        key="torch_loader", title=title,
        table=_report.format_rows(("loader", "items/s", "GB/s", "vs torch", "rounds"), rows),
        targets=[target(name, ratio(medians[SHM], medians[TORCH]), ">=", TARGET,
                        section="torch_loader")],
        notes=["per-round ratios (shmtensor / torch): "
               + " ".join(f"{x:.2f}" for x in per_round)],
        data={"workers": WORKERS, "item_shape": list(ITEM), "dtype": str(DTYPE),
              "skip": SKIP, "rounds": plan.rounds, "items": plan.items, "rates": rates,
              "medians": medians, "per_round_ratio": per_round, "torch": torch_version()})
