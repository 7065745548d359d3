"""Presenting results: the table, the targets' verdicts, results.json and plot.png."""

from __future__ import annotations

import json
from pathlib import Path

KB, MB, GB = 1 << 10, 1 << 20, 1 << 30
LINE_STYLES = {"not shared": "-", "shared": "--"}  # any other scenario: dotted


def size_label(nbytes: int) -> str:
    """``1 KB``, ``64 KB``, ``256 MB``, ``1 GB``."""
    for unit, name in ((GB, "GB"), (MB, "MB"), (KB, "KB")):
        if nbytes >= unit:
            return f"{nbytes / unit:g} {name}"
    return f"{nbytes} B"


def time_label(seconds: float | None) -> str:
    """A time in µs, ms or s, whichever reads best."""
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.3f} s"


def format_table(results: list[dict]) -> str:
    """One row per measurement, in the order measured, grouped by scenario and size."""
    rows = [("scenario", "size", "peer", "per array", "n")]
    order = {s: i for i, s in enumerate(dict.fromkeys(r["scenario"] for r in results))}
    for r in sorted(results, key=lambda r: (order[r["scenario"]], r["size"])):
        time = time_label(r["per_array_s"]) if "error" not in r else "error (see results.json)"
        rows.append((r["scenario"], size_label(r["size"]), r["peer"], time, str(r["n"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        cells = [c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_targets(targets: list[dict]) -> str:
    """One line per target: verdict, measured ratio, the limit, what is compared."""
    lines = []
    for t in targets:
        verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[t["pass"]]
        ratio = "n/a" if t["ratio"] is None else f"{t['ratio']:.2f}x"
        want = f"(want {t['op']} {t['limit']:g}x)"
        lines.append(f"  {verdict}  {ratio:>9}  {want:<15}  {t['name']}")
    return "\n".join(lines)


def write_json(path: Path, **sections) -> None:
    path.write_text(json.dumps(sections, indent=2) + "\n")


def plot(path: Path, results: list[dict], title: str) -> bool:
    """Per-array time against size, one line per (scenario, peer); False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6.5))
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in results:
        if r["per_array_s"] is not None:
            series.setdefault((r["scenario"], r["peer"]), []).append((r["size"], r["per_array_s"]))
    for (scenario, peer), points in series.items():
        sizes, times = zip(*sorted(points))
        style = LINE_STYLES.get(scenario, ":")
        ax.plot(sizes, times, style, marker="*" if len(sizes) == 1 else "o",
                markersize=12 if len(sizes) == 1 else 6, label=f"{scenario}: {peer}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({r["size"] for r in results})
    ax.set_xticks(ticks, [size_label(s) for s in ticks])
    ax.set_xlabel("array size")
    ax.set_ylabel("time per array (s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
