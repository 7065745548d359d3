"""shmtensor beside its peers, in one run: the core per-array table and the sections.

Usage: ``scripts/bench [--quick] [--out DIR]``.  Runs, in order: the core table (queues of
stdlib, shmtensor, torch, SharedMemory, joblib; :mod:`benchmarks.bench_core`), the inline
threshold sweep, small arrays at scale, ``Pool.map`` of 1 GB of arrays (beside Ray, mpire,
loky, joblib and the compute floor), an 8-producer fan-in, a 4-worker data loader (beside
torch's and grain's), torch's DataLoader with default collate (torch's context against
shmtensor's), the CLI's overhead, where CuPy sees a GPU, the CUDA relay and 1 GiB re-send
(:mod:`benchmarks.bench_cuda`), and, where Ray is installed, a 64 MB actor -> task -> actor
round trip against plain Ray (:mod:`benchmarks.bench_ray`).  Prints every table with its
targets' verdicts, writes ``DIR/results.json`` and, with matplotlib, ``DIR/plot.png`` (the
core table) and ``DIR/pool_map.png``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib
import os
import platform
import subprocess
import sys
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import psutil

import shmtensor as st

from . import (_report, bench_cli, bench_core, bench_cuda, bench_fanin, bench_loader,
               bench_pool, bench_ray, bench_scale, bench_threshold, bench_torch_loader)
from ._report import Section

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("shmtensor", "ipc")


def available(module: str) -> str | None:
    """The module's version when it imports, else None."""
    try:
        return importlib.import_module(module).__version__
    except (ImportError, OSError):  # OSError: a wheel whose shared libraries do not load
        return None


def machine_info(quick: bool) -> dict:
    """What the numbers were measured on (and with), for results.json."""
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": _cpu_model(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "numpy": np.__version__,
        "shmtensor": st.__version__,
        "library_at_start": library_version(),
        "inline_threshold": st.get_inline_threshold(),
        "torch": available("torch"),
        "joblib": available("joblib"),
        **{m: available(m) for m in ("ray", "loky", "grain")},
        "mpire": _distribution_version("mpire"),
        "quick": quick,
        "load_average_at_start": os.getloadavg()[0],
    }


def library_version() -> str | None:
    """The git commit of the code under test; ``+dirty.<hash of the diff>`` when shmtensor/
    or ipc/ has uncommitted changes (the library may be edited while the bench runs)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
    try:
        head = git("rev-parse", "--short", "HEAD").strip()
        diff = git("diff", "HEAD", "--", *LIBRARY)
        untracked = git("ls-files", "--others", "--exclude-standard", "--", *LIBRARY)
    except (OSError, subprocess.CalledProcessError):
        return None
    if not diff and not untracked:
        return head
    return f"{head}+dirty.{hashlib.sha1((diff + untracked).encode()).hexdigest()[:8]}"


def _distribution_version(name: str) -> str | None:
    """An installed distribution's version (for packages without ``__version__``)."""
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), None)
    except OSError:
        return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer sizes and repeats: a smoke run of a few minutes")
    parser.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="where results.json and plot.png go (default: bench-results/)")
    return parser.parse_args(argv)


def section_plan(settings: bench_core.Settings, quick: bool,
                 have_joblib: bool) -> list[tuple[str, Callable[[], Section]]]:
    """The sections after the core table, each a call that measures and judges it."""
    return [
        ("threshold_sweep", partial(bench_threshold.run, settings)),
        ("scale", partial(bench_scale.run, quick)),
        ("pool_map", partial(bench_pool.run, 1 if quick else 3, have_joblib)),
        ("fanin", partial(bench_fanin.run, quick)),
        ("loader", partial(bench_loader.run, quick)),
        ("torch_loader", partial(bench_torch_loader.run, quick)),
        ("cli", partial(bench_cli.run, 3 if quick else 5)),
        ("cuda", bench_cuda.run),
        ("ray", partial(bench_ray.run, quick)),
    ]


def run_section(key: str, measure: Callable[[], Section]) -> Section:
    """Run one section; a failure becomes a section that says so, not the end of the run."""
    start = time.monotonic()
    try:
        section = measure()
    except Exception as e:  # one broken section must not hide the others' numbers
        traceback.print_exc()
        section = Section(key=key, title=f"{key}: failed", table=f"{type(e).__name__}: {e}",
                          targets=[], data={"error": f"{type(e).__name__}: {e}"})
    section.data["wall_s"] = round(time.monotonic() - start, 1)
    return section


def print_summary(targets: list[dict]) -> None:
    verdicts = [t["pass"] for t in targets]
    print(f"\nall targets: {verdicts.count(True)} PASS, {verdicts.count(False)} FAIL, "
          f"{verdicts.count(None)} SKIP")
    for t in targets:
        if t["pass"] is False:
            print(f"  FAIL [{t['section']}] {t['name']}")


def print_library(machine: dict) -> None:
    start, end = machine["library_at_start"], machine["library_at_end"]
    if start == end:
        print(f"library under test: {start}")
    else:
        print(f"library under test: {start} at start, {end} at end: it changed during the "
              "run (processes started later ran the newer code)")


def save(out: Path, machine: dict, results: list[dict], targets: list[dict],
         counters: dict | None, sections: list[Section]) -> None:
    """Write results.json (every section) and, when matplotlib imports, plot.png."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [bench_core.without_info(r) for r in results]
    _report.write_json(out / "results.json", machine=machine, results=rows, targets=targets,
                       recycling_256mb=counters,
                       sections={s.key: {"title": s.title, **s.data} for s in sections})
    title = (f"shmtensor {st.__version__}: time per array "
             f"({machine['cpus']} CPUs, Python {machine['python']})")
    if _report.plot(out / "plot.png", rows, title):
        pool = next((s for s in sections if s.key == "pool_map" and "rows" in s.data), None)
        if pool is not None:
            _report.plot_bars(out / "pool_map.png", pool.data["rows"], pool.title)
        print(f"\nwrote {out / 'results.json'}, {out / 'plot.png'} and {out / 'pool_map.png'}")
    else:
        print(f"\nwrote {out / 'results.json'} (no plot: matplotlib is not installed)")


def warn_about_machine(machine: dict) -> None:
    for module in ("torch", "joblib", "ray", "loky", "mpire", "grain"):
        if machine[module] is None:
            print(f"{module} is not importable: its rows are skipped", file=sys.stderr)
    if machine["load_average_at_start"] > 0.5:
        print(f"note: load average {machine['load_average_at_start']:.2f} at start: other work "
              "on this machine skews the numbers", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info(args.quick)
    warn_about_machine(machine)
    started = time.monotonic()
    print("measuring (scenario, size, peer, per array):", file=sys.stderr)
    settings = bench_core.QUICK if args.quick else bench_core.FULL
    have_torch, have_joblib = machine["torch"] is not None, machine["joblib"] is not None
    results = bench_core.run_all(settings, have_torch, have_joblib)
    targets = bench_core.evaluate_targets(results)
    counters = bench_core.recycling(results)
    sections = [run_section(key, measure)
                for key, measure in section_plan(settings, args.quick, have_joblib)]
    machine["load_average_at_end"] = os.getloadavg()[0]
    machine["library_at_end"] = library_version()
    machine["wall_s"] = round(time.monotonic() - started, 1)

    bench_core.print_report(settings, machine, results, targets, counters)
    for section in sections:
        print("\n" + section.render())
    all_targets = targets + [t for s in sections for t in s.targets]
    print_summary(all_targets)
    print(f"\nwall time {machine['wall_s']:.0f} s; load average "
          f"{machine['load_average_at_start']:.2f} at start, "
          f"{machine['load_average_at_end']:.2f} at end")
    print_library(machine)
    save(args.out, machine, results, all_targets, counters, sections)
    return 0


if __name__ == "__main__":
    sys.exit(main())
