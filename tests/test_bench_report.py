"""The benchmarks page, rendered from a small fake results.json (no benchmark runs)."""

import json

from benchmarks import _page, _summary, run
from benchmarks._report import KB, target

COMMIT = "0123456789abcdef0123456789abcdef01234567"
COMMAND = "scripts/bench --quick --write-docs"


def fake_results():
    core = [
        {"scenario": "not shared", "peer": "stdlib mp.Queue", "size": KB,
         "per_array_s": 20e-6, "n": 100},
        {"scenario": "not shared", "peer": "shmtensor Queue", "size": KB,
         "per_array_s": 10e-6, "n": 100},
    ]
    fanin = target("fan-in, 1 KiB shared arrays: shmtensor vs stdlib", 1.5, ">=", 3,
                   section="channels")
    channels = {
        "workload": "fan-in 8 -> 1 of 1 KiB arrays (arrays/s)", "unit": "/s",
        "baseline": "stdlib", "targets": [fanin],
        "cells": {"stdlib": [_summary.entry(20000.0)],
                  "shmtensor": [_summary.entry(30000.0, "shared")],
                  "iceoryx2": [_summary.entry(None, note="iceoryx2 does not import")]},
    }
    return {
        "command": COMMAND,
        "machine": {"date": "2026-11-26T07:00:00", "processor": "Test CPU 9000", "cpus": 2,
                    "memory_bytes": 8 << 30, "platform": "Linux-test", "python": "3.11.7",
                    "numpy": "2.4", "shmtensor": "0.1", "commit": COMMIT, "dirty": True,
                    "quick": True, "wall_s": 12.0,
                    "load": {"every_s": 5.0, "min": 0.5, "median": 1.25, "max": 2.0},
                    "others_cpus": 0.75, "others": [{"name": "pytest", "cpu_s": 9.0}]},
        "results": core,
        "targets": [target("1 KB not shared: shmtensor time / stdlib time", 0.5, "<=", 1.3),
                    fanin],
        "summary": _summary.core(core, []) + [channels],
        "sections": {"core": {"title": "core table", "table": "scenario  size"},
                     "channels": {"title": "channels section", "table": "workload  contender"}},
    }


def test_page_has_the_table_machine_commit_and_command():
    page = _page.render(fake_results())
    lines = page.splitlines()
    header = next(line for line in lines if line.startswith("| workload |"))
    # the contenders that appear, in the page's order; none that the run did not measure
    assert header.split(" | ")[1:-1] == ["stdlib", "shmtensor", "iceoryx2"]
    # the summary comes before the plots and the machine
    assert page.index("| workload |") < page.index("## Plots") < page.index("Test CPU 9000")
    core_row = next(line for line in lines if line.startswith("| 1 KiB plain array"))
    assert "20.0 µs" in core_row and "10.0 µs (**2.00x**)" in core_row
    fanin_row = next(line for line in lines if line.startswith("| fan-in 8 -> 1"))
    assert "shared: 30,000/s (**1.50x**)" in fanin_row
    assert "FAIL 1.50x (want >= 3x)" in fanin_row
    assert "- iceoryx2: skipped (iceoryx2 does not import)" in lines
    assert "2 logical CPUs" in page and "median 1.25" in page and "`pytest` 9 CPU-s" in page
    assert f"`{COMMIT} (with uncommitted changes)`" in page
    assert COMMAND in lines
    assert "A quick run" in page
    assert "## What each row measures" in page
    assert "1 PASS, 1 FAIL, 0 SKIP" in page


def test_render_writes_the_page_into_out_and_not_docs(tmp_path, monkeypatch):
    source = tmp_path / "results.json"
    source.write_text(json.dumps(fake_results()))
    docs = tmp_path / "docs"
    docs.mkdir()
    monkeypatch.setattr(run, "DOCS", docs)
    out = tmp_path / "out"
    assert run.main(["--render", str(source), "--out", str(out)]) == 0
    assert COMMAND in (out / "benchmarks.md").read_text()
    assert not (docs / "benchmarks.md").exists()
    assert run.main(["--render", str(source), "--out", str(out), "--write-docs"]) == 0
    assert (docs / "benchmarks.md").read_text() == (out / "benchmarks.md").read_text()
