"""The page's summary rows, taken from what the sections measured.

A row: ``{"workload", "unit", "baseline", "cells", "targets"}``; ``unit`` is ``s`` (time:
lower is better), ``/s`` or ``B/s`` (higher is better); ``cells`` maps a column of
:data:`benchmarks._page.COLUMNS` to a list of ``{"label", "value", "note"}`` (a contender
may have variants, e.g. shmtensor with plain and with shared arrays); ``targets`` are the
target verdicts that judge the row.  A section may set its own rows (``Section.summary``,
as bench_channels does); the others' are made here.
"""

from __future__ import annotations

from . import bench_core as core_
from . import bench_loader, bench_pool, bench_ray, bench_torch_loader
from ._report import GB, KB, MB


def entry(value: float | None, label: str = "", note: str | None = None) -> dict:
    return {"label": label, "value": value, "note": note}


def row(workload: str, unit: str, cells: dict, targets: list[dict],
        baseline: str = "stdlib") -> dict:
    return {"workload": workload, "unit": unit, "baseline": baseline,
            "cells": {k: v for k, v in cells.items() if v}, "targets": targets}


def core(results: list[dict], targets: list[dict]) -> list[dict]:
    """Three rows of the core table: 1 KiB and 256 MiB plain arrays, 1 GiB shared."""
    t = core_.Lookup(results)

    def judged(prefix: str) -> list[dict]:
        return [x for x in targets if x.get("section") == "core" and x["name"].startswith(prefix)]

    def one(scenario: str, peer: str, size: int, label: str = "") -> list[dict]:
        return [entry(t(scenario, peer, size), label)] if (scenario, peer, size) in t.times else []

    plain, shared = core_.NOT_SHARED, core_.SHARED
    return [
        row("1 KiB plain array through a Queue (time per array)", "s",
            {"stdlib": one(plain, core_.STDLIB, KB), "shmtensor": one(plain, core_.SHM, KB),
             "torch.multiprocessing": one(plain, core_.TORCH_FD, KB)},
            judged("1 KB not shared")),
        row("256 MiB plain array through a Queue (time per array)", "s",
            {"stdlib": one(plain, core_.STDLIB, 256 * MB),
             "shmtensor": one(plain, core_.SHM, 256 * MB),
             "torch.multiprocessing": one(plain, core_.TORCH_FD, 256 * MB)},
            judged("256 MB not shared")),
        row("1 GiB array already in shared memory through a Queue (time per array; stdlib: "
            "a SharedMemory name, attached)", "s",
            {"stdlib": one(shared, "SharedMemory attach", GB),
             "shmtensor": one(shared, core_.SHM, GB),
             "torch.multiprocessing": one(shared, core_.TORCH_FD_PRE, GB)},
            judged("shared")),
    ]


def pool(data: dict, targets: list[dict]) -> list[dict]:
    t = {r["peer"]: r["median_s"] for r in data.get("rows", []) if r["function"] == "sum"}
    skipped = data.get("skipped", {})

    def one(label: str, variant: str = "") -> list[dict]:
        if label in t:
            return [entry(t[label], variant)]
        return [entry(None, variant, skipped[label])] if label in skipped else []

    return [row(f"Pool.map, a sum over {bench_pool.ARRAYS} arrays of {bench_pool.NBYTES // MB}"
                " MiB (time per map)", "s",
                {"stdlib": one(bench_pool.STDLIB),
                 "shmtensor": one(bench_pool.SHM_PLAIN, "plain")
                 + one(bench_pool.SHM_SHARED, "shared"),
                 "Ray": one("Ray, plain arrays", "plain") + one("Ray, pre-put (ray.put once)",
                                                                 "pre-put"),
                 "joblib": one(bench_pool.JOBLIB)},
                [x for x in targets if x["name"].startswith("sum:")])]


def loader(data: dict, targets: list[dict]) -> list[dict]:
    rows = data.get("rows", [])
    rate = {r["context"]: r["steady_batches_per_s"] for r in rows}  # the longer shm run last
    skipped = data.get("skipped", {})
    torch = ([entry(rate[bench_loader.TORCH])] if bench_loader.TORCH in rate
             else [entry(None, note=skipped.get(bench_loader.TORCH))])
    return [row("data loader, 4 workers, 8 MiB batches (batches/s)", "/s",
                {"stdlib": [entry(rate.get(bench_loader.STDLIB))],
                 "shmtensor": [entry(rate.get(bench_loader.SHM), "BatchPool")],
                 "torch.multiprocessing": torch},
                [x for x in targets if "batches/s" in x["name"]])]


def torch_loader(data: dict, targets: list[dict]) -> list[dict]:
    med = data.get("medians")
    if not med:
        return []
    return [row("torch DataLoader, default collate, 8 MiB items (items/s)", "/s",
                {"torch.multiprocessing": [entry(med.get(bench_torch_loader.TORCH))],
                 "shmtensor": [entry(med.get(bench_torch_loader.SHM))]},
                targets, baseline="torch.multiprocessing")]


def ray(data: dict, targets: list[dict]) -> list[dict]:
    med = data.get("median_s")
    if not med:
        return []
    return [row("Ray: a 64 MiB array actor -> task -> actor, mutated (time per round trip)",
                "s", {"Ray": [entry(med.get(bench_ray.PLAIN))],
                      "shmtensor": [entry(med.get(bench_ray.SHM), "shmtensor.ray")]},
                targets, baseline="Ray")]


BUILDERS = {"pool_map": pool, "loader": loader, "torch_loader": torch_loader, "ray": ray}


def for_section(key: str, data: dict, targets: list[dict]) -> list[dict]:
    """A section's summary rows (none for a section that failed or has none)."""
    if "error" in data or key not in BUILDERS:
        return []
    try:
        return BUILDERS[key](data, targets)
    except (KeyError, TypeError, StopIteration):  # a section whose data lacks a row
        return []
