"""Presenting results: the table, the targets' verdicts, results.json and plot.png."""

from __future__ import annotations

from dataclasses import dataclass, field
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


def target(name: str, value: float | None, op: str, limit: float, unit: str = "x",
           section: str = "core") -> dict:
    """A target's verdict: ``value op limit`` (None when the value could not be measured).

    ``unit`` is ``x`` for ratios of two times; anything else (``ms``, ``s``, ...) is shown
    after the value."""
    ok = None if value is None else (value <= limit if op == "<=" else value >= limit)
    return {"section": section, "name": name, "ratio": value, "op": op, "limit": limit,
            "unit": unit, "pass": ok}


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing (or ``b`` is 0)."""
    return a / b if a is not None and b else None


def _value_label(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}x" if unit == "x" else f"{value:.3g} {unit}"


def format_targets(targets: list[dict]) -> str:
    """One line per target: verdict, measured value, the limit, what is compared."""
    lines = []
    for t in targets:
        verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[t["pass"]]
        unit = t.get("unit", "x")
        limit = f"{t['limit']:g}x" if unit == "x" else f"{t['limit']:g} {unit}"
        want = f"(want {t['op']} {limit})"
        lines.append(f"  {verdict}  {_value_label(t['ratio'], unit):>9}  {want:<16}  {t['name']}")
    return "\n".join(lines)


def format_rows(header: tuple[str, ...], rows: list[tuple], left: int = 1) -> str:
    """A plain table: the first ``left`` columns left-aligned, the others right-aligned."""
    cells = [tuple(header)] + [tuple(str(c) for c in row) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for k, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i < left else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


@dataclass
class Section:
    """One part of the run beyond the per-array table: its own table, targets and data."""

    key: str                    # its key under "sections" in results.json
    title: str
    table: str
    targets: list[dict]
    data: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    summary: list[dict] = field(default_factory=list)  # its rows of the page's summary table

    def render(self) -> str:
        parts = [f"== {self.title} ==", self.table]
        parts += [f"  {note}" for note in self.notes]
        parts += ["targets:", format_targets(self.targets)]
        return "\n".join(parts)


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


def plot_bars(path: Path, rows: list[dict], title: str) -> bool:
    """Pool.map: one horizontal bar per (function, contender), median time on a log axis,
    the first round marked; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("median_s")]
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(rows) + 1.5))
    labels = [f"{r['function']}: {r['peer']}" for r in rows]
    y = range(len(rows))
    colors = ["tab:orange" if "shmtensor" in r["peer"] else
              "tab:gray" if "numpy" in r["peer"] or "floor" in r["peer"] else "tab:blue"
              for r in rows]
    ax.barh(y, [r["median_s"] for r in rows], color=colors)
    ax.plot([r["first_s"] for r in rows], y, "k|", markersize=12, label="first round")
    for i, r in enumerate(rows):
        ax.text(r["median_s"], i, " " + time_label(r["median_s"]), va="center", fontsize=8)
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("time per map call (median of rounds; s)")
    ax.set_title(title, fontsize=9, wrap=True)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
