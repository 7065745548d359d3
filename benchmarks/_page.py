"""docs/benchmarks.md, written from a run's results.json: the summary table first, then the
plots, the machine, the commit, the date and the command that reproduces the run, then what
each row measures and every section's own table.

``render(results)`` needs nothing but the parsed results.json, so a page can be rewritten
from an old run (``scripts/bench --render DIR/results.json``) and tested without one.
"""

from __future__ import annotations

from . import _report

# The summary's columns, in order; a section's summary rows name their cells by these.
COLUMNS = ("stdlib", "shmtensor", "torch.multiprocessing", "Ray", "joblib", "faster-fifo",
           "iceoryx2")
PLOTS = (("core_by_size.png", "Time per array through a queue, by size (the core rows)"),
         ("pool_map.png", "Pool.map over 1 GB of arrays, every contender"))

WHAT_EACH_ROW_MEASURES = """\
- **Arrays through a Queue** (`bench_core`): a spawned producer puts arrays on a queue and the
  parent times its steady-state `get()`s; per array, the median of sessions (fresh
  producers, every contender once per session, in turn), each the median of rounds.
  *Plain*: a numpy array the queue must move (pickled, or copied into shared memory);
  *already in shared memory*: `shmtensor.zeros`, torch's `share_memory_()` or a stdlib
  `SharedMemory` block whose name is sent and attached.
- **Round trip, fan-in, fan-out** (`bench_channels`): the parent sends a 1 KiB array to a
  child that sends it back; 8 producers send 1 KiB arrays to one consumer (arrays/s between
  the 10% and 90% marks); one producer sends each 4 MiB array to 4 consumers (GB/s
  delivered).  Every contender copies each message's data once on the producer's side:
  the stdlib, shmtensor *plain* and faster-fifo pickle or copy a numpy array, shmtensor
  *shared* writes it into a fresh `shmtensor.empty_like` array, iceoryx2 into a chunk
  loaned from its publisher.  Consumers read one element per array.  Rounds interleaved.
- **Pool.map** (`bench_pool`): 32 float64 arrays of 32 MiB, 2 workers, `a.sum()` per array;
  every pool started first, then rounds interleaved, only the map call timed, each result
  checked; median round.  shmtensor *shared*: the arrays pre-shared; Ray *pre-put*: `ray.put`
  once.
- **Data loader** (`bench_loader`): 4 spawned workers make 8 MiB float32 batches; batches/s
  from the batch by which every worker has delivered; shmtensor's workers fill the slots of
  a `BatchPool`, the stdlib's make a fresh array per batch, torch's `DataLoader` runs the
  same dataset code.
- **torch DataLoader, default collate** (`bench_torch_loader`): torch's DataLoader over 8 MiB
  numpy items with torch's default context against shmtensor's spawn context.
- **Ray round trip** (`bench_ray`): a 64 MiB array from an actor to a task and back, mutated;
  plain Ray against `shmtensor.ray`.
- Speed-ups are the baseline's time over the contender's (or the contender's rate over
  the baseline's): above 1x is faster.  The baseline is the stdlib unless the row says
  otherwise.  A target's verdict is PASS, FAIL, or SKIP where a contender could not run.
"""


def value_label(value: float | None, unit: str) -> str:
    """A measured value in its unit: a time, a rate (/s) or a throughput (B/s)."""
    if value is None:
        return "-"
    if unit == "s":
        return _report.time_label(value)
    if unit == "B/s":
        return f"{value / 1e9:.2f} GB/s"
    return f"{value:,.0f}/s"


def speedup(value: float | None, base: float | None, unit: str) -> float | None:
    if not value or not base:
        return None
    return base / value if unit == "s" else value / base


def _cell(entries: list[dict], base: float | None, unit: str) -> str:
    parts = []
    for e in entries:
        label = f"{e['label']}: " if e.get("label") else ""
        if e.get("value") is None:
            parts.append(f"{label}skipped" if e.get("note") else f"{label}-")
            continue
        up = speedup(e["value"], base, unit)
        parts.append(f"{label}{value_label(e['value'], unit)}"
                     + (f" (**{up:.2f}x**)" if up is not None else ""))
    return "<br>".join(parts) if parts else ""


def _verdicts(targets: list[dict]) -> str:
    out = []
    for t in targets:
        verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[t["pass"]]
        unit = t.get("unit", "x")
        limit = f"{t['limit']:g}x" if unit == "x" else f"{t['limit']:g} {unit}"
        value = "n/a" if t["ratio"] is None else (
            f"{t['ratio']:.2f}x" if unit == "x" else f"{t['ratio']:.3g} {unit}")
        out.append(f"{verdict} {value} (want {t['op']} {limit})")
    return "<br>".join(out)


def _baseline(row: dict) -> float | None:
    entries = row["cells"].get(row.get("baseline", "stdlib"), [])
    return next((e["value"] for e in entries if e.get("value") is not None), None)


def summary_table(rows: list[dict]) -> str:
    """Workloads x contenders: each cell the value and, in bold, the speed-up over the
    row's baseline; the last column the row's target verdicts."""
    used = [c for c in COLUMNS if any(c in r["cells"] for r in rows)]
    lines = ["| workload | " + " | ".join(used) + " | targets |",
             "| --- |" + " --- |" * (len(used) + 1)]
    for r in rows:
        base = _baseline(r)
        name = r["workload"]
        if r.get("baseline", "stdlib") != "stdlib":
            name += f" (speed-up vs {r['baseline']})"
        cells = [_cell(r["cells"].get(c, []), base, r["unit"]) for c in used]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_verdicts(r['targets'])} |")
    return "\n".join(lines)


def skipped_notes(rows: list[dict]) -> list[str]:
    """One line per contender that could not run, with the reason."""
    seen = {}
    for r in rows:
        for column, entries in r["cells"].items():
            for e in entries:
                if e.get("value") is None and e.get("note"):
                    seen.setdefault(f"{column} {e.get('label') or ''}".strip(), e["note"])
    return [f"- {who}: skipped ({why})" for who, why in seen.items()]


def machine_lines(m: dict) -> list[str]:
    load = m.get("load") or {}
    lines = [
        f"- CPU: {m.get('processor') or 'unknown'}, {m.get('cpus')} logical CPUs; "
        f"{(m.get('memory_bytes') or 0) / 2**30:.0f} GiB RAM; {m.get('platform')}",
        f"- Python {m.get('python')}, numpy {m.get('numpy')}, shmtensor {m.get('shmtensor')}"
        + "".join(f", {k} {m[k]}" for k in ("torch", "ray", "joblib", "faster_fifo",
                                              "iceoryx2") if m.get(k)),
    ]
    if load:
        lines.append(f"- Load average during the run (sampled every {load.get('every_s')} s): "
                     f"min {load['min']:.2f}, median {load['median']:.2f}, max "
                     f"{load['max']:.2f}")
    others = m.get("others")
    if others is not None:
        busy = m.get("others_cpus", 0.0)
        if others:
            top = "; ".join(f"`{o['name']}` {o['cpu_s']:.0f} CPU-s" for o in others)
            lines.append(f"- Other work on the machine during the run: {busy:.2f} CPUs busy "
                         f"on average outside this run's processes (largest: {top})")
        else:
            lines.append(f"- Other work on the machine during the run: {busy:.2f} CPUs busy "
                         "on average outside this run's processes")
    return lines


def render(results: dict) -> str:
    """The whole page, in Markdown."""
    m, summary = results["machine"], results.get("summary", [])
    targets = results.get("targets", [])
    verdicts = [t["pass"] for t in targets]
    commit = m.get("commit") or "unknown"
    if m.get("dirty"):
        commit += " (with uncommitted changes)"
    quick = " **A quick run** (fewer sizes and rounds): indicative, not the reference." \
        if m.get("quick") else ""
    parts = [
        "# Benchmarks",
        "",
        "<!-- Written by scripts/bench from its results.json; edit benchmarks/_page.py, "
        "not this file. -->",
        "",
        f"shmtensor beside the stdlib and its peers, measured in one run by `scripts/bench` "
        f"on {m.get('date')}.{quick}  All targets: {verdicts.count(True)} PASS, "
        f"{verdicts.count(False)} FAIL, {verdicts.count(None)} SKIP.",
        "",
        "## Summary",
        "",
        summary_table(summary),
        "",
        *(["Contenders that could not run here:", "", *skipped_notes(summary), ""]
          if skipped_notes(summary) else []),
        "## Plots",
        "",
    ]
    for name, caption in PLOTS:
        if name in results.get("plots", []):
            parts += [f"![{caption}](img/{name})", ""]
    parts += [
        "## Machine, code and command",
        "",
        *machine_lines(m),
        f"- Commit: `{commit}`",
        f"- Date: {m.get('date')}; wall time {m.get('wall_s', 0):.0f} s",
        "",
        "Reproduce it from a checkout of that commit:",
        "",
        "```bash",
        results.get("command", "scripts/bench"),
        "```",
        "",
        "## What each row measures",
        "",
        WHAT_EACH_ROW_MEASURES,
        "## Every table of the run",
        "",
        "Each section as `scripts/bench` printed it, with its targets.",
        "",
    ]
    for key, section in results.get("sections", {}).items():
        parts += [f"### {section.get('title', key)}", "", "```text",
                  section.get("table", "").rstrip() or "(no table)"]
        own = [t for t in targets if t.get("section") == key]
        if own:
            parts += ["", "targets:", _report.format_targets(own)]
        parts += ["```", ""]
    core = [t for t in targets if t.get("section") == "core"]
    if core:
        parts += ["### Core targets", "", "```text", _report.format_targets(core), "```", ""]
    return "\n".join(parts).rstrip() + "\n"
