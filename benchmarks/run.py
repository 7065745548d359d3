"""shmtensor beside its peers, in one run: the core per-array table and the sections.

Usage: ``scripts/bench [--quick] [--out DIR] [--write-docs | --no-write-docs]`` or
``scripts/bench --render DIR/results.json [--write-docs]``.  Runs, in order: the core table
(queues of stdlib, shmtensor, torch, SharedMemory, joblib; :mod:`benchmarks.bench_core`),
the inline threshold sweep, small arrays at scale, ``Pool.map`` of 1 GB of arrays (beside
Ray, mpire, loky, joblib and the compute floor), channels (round trip, fan-in 8 -> 1,
fan-out 1 -> 4, beside faster-fifo and iceoryx2; :mod:`benchmarks.bench_channels`), a
4-worker data loader (beside torch's and grain's), torch's DataLoader with default collate,
the CLI's overhead, where CuPy sees a GPU the CUDA relay (:mod:`benchmarks.bench_cuda`),
and, where Ray is installed, a 64 MB actor -> task -> actor round trip
(:mod:`benchmarks.bench_ray`).  Prints every table with its targets' verdicts and writes
``DIR/results.json``, the page ``DIR/benchmarks.md`` and its plots ``DIR/img/*.png``
(:mod:`benchmarks._page`); a full run, or ``--write-docs``, writes the page and the plots
into ``docs/`` too.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Callable

import shmtensor as st

from . import (_machine, _page, _report, _summary, bench_channels, bench_cli, bench_core,
               bench_cuda, bench_loader, bench_pool, bench_ray, bench_scale, bench_threshold,
               bench_torch_loader)
from ._report import Section

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer sizes and repeats: a smoke run of a few minutes")
    parser.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="where results.json, benchmarks.md and img/ go "
                             "(default: bench-results/)")
    parser.add_argument("--write-docs", action=argparse.BooleanOptionalAction, default=None,
                        help="also write docs/benchmarks.md and docs/img/ (default: only "
                             "for a full run, not for --quick or --render)")
    parser.add_argument("--render", type=Path, metavar="RESULTS_JSON",
                        help="measure nothing: write the page and plots from this results.json")
    return parser.parse_args(argv)


def section_plan(settings: bench_core.Settings, quick: bool,
                 have_joblib: bool) -> list[tuple[str, Callable[[], Section]]]:
    """The sections after the core table, each a call that measures and judges it."""
    return [
        ("threshold_sweep", partial(bench_threshold.run, settings)),
        ("scale", partial(bench_scale.run, quick)),
        ("pool_map", partial(bench_pool.run, 1 if quick else 3, have_joblib)),
        ("channels", partial(bench_channels.run, quick)),
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


def results_json(machine: dict, results: list[dict], targets: list[dict],
                 counters: dict | None, sections: list[Section], command: str) -> dict:
    """Everything the run measured, as results.json keeps it (and the page reads it)."""
    rows = [bench_core.without_info(r) for r in results]
    core = {"title": "core: arrays through a queue, per array (spawn, producer in a child)",
            "table": _report.format_table(rows)}
    return {
        "command": command, "machine": machine, "results": rows, "targets": targets,
        "recycling_256mb": counters,
        "summary": _summary.core(rows, targets)
        + [r for s in sections
           for r in s.summary or _summary.for_section(s.key, s.data, s.targets)],
        "sections": {"core": core,
                     **{s.key: {"title": s.title, "table": s.table, **s.data}
                        for s in sections}},
    }


def plots(results: dict, img: Path) -> list[str]:
    """Draw the plots from results.json into ``img``; the names drawn (none without
    matplotlib)."""
    img.mkdir(parents=True, exist_ok=True)
    m = results["machine"]
    title = (f"shmtensor {m['shmtensor']}: time per array "
             f"({m['cpus']} CPUs, Python {m['python']})")
    if not _report.plot(img / "core_by_size.png", results["results"], title):
        return []
    drawn = ["core_by_size.png"]
    pool = results["sections"].get("pool_map", {})
    if pool.get("rows"):
        _report.plot_bars(img / "pool_map.png", pool["rows"], pool["title"])
        drawn.append("pool_map.png")
    return drawn


def write_page(results: dict, out: Path, write_docs: bool) -> None:
    """``out/benchmarks.md`` and ``out/img/``; with ``write_docs``, docs/ too."""
    results["plots"] = plots(results, out / "img")
    page = _page.render(results)
    (out / "benchmarks.md").write_text(page)
    print(f"\nwrote {out / 'benchmarks.md'} and {out / 'img'}/ "
          f"({', '.join(results['plots']) or 'no plots: matplotlib is not installed'})")
    if write_docs:
        for name in results["plots"]:
            (DOCS / "img").mkdir(exist_ok=True)
            shutil.copyfile(out / "img" / name, DOCS / "img" / name)
        (DOCS / "benchmarks.md").write_text(page)
        print(f"wrote {DOCS / 'benchmarks.md'} and its plots")


def warn_about_machine(machine: dict) -> None:
    for module in _machine.PEERS:
        if machine[module] is None:
            print(f"{module} is not importable: its rows are skipped", file=sys.stderr)
    if machine["load_average_at_start"] > 0.5:
        print(f"note: load average {machine['load_average_at_start']:.2f} at start: other work "
              "on this machine skews the numbers", file=sys.stderr)


def measure(args: argparse.Namespace, command: str) -> dict:
    machine = _machine.machine_info(args.quick)
    warn_about_machine(machine)
    started = time.monotonic()
    print("measuring (scenario, size, peer, per array):", file=sys.stderr)
    settings = bench_core.QUICK if args.quick else bench_core.FULL
    have_torch, have_joblib = machine["torch"] is not None, machine["joblib"] is not None
    with _machine.Monitor() as monitor:
        results = bench_core.run_all(settings, have_torch, have_joblib)
        targets = bench_core.evaluate_targets(results)
        counters = bench_core.recycling(results)
        sections = [run_section(key, run)
                    for key, run in section_plan(settings, args.quick, have_joblib)]
    machine.update(monitor.report())
    machine["load_average_at_end"] = os.getloadavg()[0]
    machine["library_at_end"] = _machine.library_version()
    machine["wall_s"] = round(time.monotonic() - started, 1)

    bench_core.print_report(settings, machine, results, targets, counters)
    for section in sections:
        print("\n" + section.render())
    all_targets = targets + [t for s in sections for t in s.targets]
    print_summary(all_targets)
    print(f"\nwall time {machine['wall_s']:.0f} s; load average {machine['load']['min']:.2f}"
          f"-{machine['load']['max']:.2f}; other processes kept {machine['others_cpus']:.2f} "
          "CPUs busy")
    print_library(machine)
    return results_json(machine, results, all_targets, counters, sections, command)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.render is not None:
        results = json.loads(args.render.read_text())
    else:
        results = measure(args, shlex.join(["scripts/bench", *argv]))
        (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out / 'results.json'}")
    write_docs = args.write_docs
    if write_docs is None:
        write_docs = args.render is None and not args.quick
    write_page(results, args.out, write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
