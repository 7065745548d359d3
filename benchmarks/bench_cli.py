"""CLI overhead: ``shmtensor leak-check`` around a trivial command, and ``shmtensor ls``
with 1,000 named segments on the machine.

Every command is a fresh ``python -m shmtensor`` process timed from the outside (start-up
and imports included); runs of the compared commands are interleaved and the median kept.
``ls`` also gets the in-process time of :func:`shmtensor.cli.segments`, which it prints.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shmtensor import cli

from . import _report
from ._report import Section, target, time_label

ROOT = Path(__file__).resolve().parent.parent
SEGMENTS = 1000
GONE_TIMEOUT = 15.0
PY = sys.executable
PLAIN = [PY, "-c", "pass"]
IMPORT_CLI = [PY, "-c", "import shmtensor.cli"]
LEAK_CHECK = [PY, "-m", "shmtensor", "leak-check", "--", *PLAIN]
LS_JSON = [PY, "-m", "shmtensor", "ls", "--json"]
# Every timed command runs with a bytecode cache of its own, filled by the untimed first run.
# Why: with PYTHONDONTWRITEBYTECODE=1 (set on the machines these runs were taken on) and the
# editable install, no .pyc of shmtensor exists, so each fresh process compiled the ~17
# modules `shmtensor.cli` imports from source: ~20 ms of every leak-check and ls run (15
# interleaved runs: overhead 97 ms without a cache, 78 ms with one), a cost no installed
# package pays.  The same environment goes to every command (plain python too), and the
# prefix keeps the .pyc files out of the source tree.
_PYCACHE = tempfile.TemporaryDirectory(prefix="shmtensor-bench-pyc-")
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} \
    | {"PYTHONPYCACHEPREFIX": _PYCACHE.name}


def wall(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    """Wall time of one run of ``cmd`` (its output captured), and the finished process."""
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV)
    return time.perf_counter() - t0, done


def interleaved(cmds: dict[str, list[str]], runs: int) -> dict[str, list[float]]:
    """``runs`` timed runs of each command, taking turns, after one untimed run of each.
    Fails when a command exits non-zero (leak-check: 97 means it found a leak)."""
    times: dict[str, list[float]] = {name: [] for name in cmds}
    for k in range(runs + 1):
        for name, cmd in cmds.items():
            dt, done = wall(cmd)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd[1:])} exited {done.returncode}: "
                                   f"{(done.stdout + done.stderr).strip()[-500:]}")
            if k:
                times[name].append(dt)
    return times


def leak_check_overhead(runs: int) -> dict:
    """Medians of ``python -c pass``, of importing shmtensor.cli, and of the same command
    under ``shmtensor leak-check``."""
    times = interleaved({"plain": PLAIN, "import_cli": IMPORT_CLI, "leak_check": LEAK_CHECK},
                        runs)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {"median_s": med, "runs_s": times,
            "overhead_s": med["leak_check"] - med["plain"]}


def _own_names(pid: int) -> list[str]:
    prefix = f"shmtensor_{pid}_"
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


def wait_gone(pid: int, timeout: float) -> tuple[int, float]:
    """Poll /dev/shm until no segment of ``pid`` is left: (left at the end, seconds taken)."""
    t0 = time.monotonic()
    while (left := len(_own_names(pid))) and time.monotonic() - t0 < timeout:
        time.sleep(0.02)
    return left, time.monotonic() - t0


def time_ls(helper_pid: int, runs: int) -> dict:
    """``shmtensor ls --json`` runs (each must list the helper's segments) and in-process
    :func:`shmtensor.cli.segments` calls, each after one untimed run."""
    times = interleaved({"ls": LS_JSON}, runs)["ls"]
    _, done = wall(LS_JSON)
    rows = json.loads(done.stdout)["segments"]
    listed = sum(1 for r in rows if r["creator_pid"] == helper_pid)
    cli.segments()
    in_process = []
    for _ in range(runs):
        t0 = time.perf_counter()
        cli.segments()
        in_process.append(time.perf_counter() - t0)
    return {"ls_json_s": statistics.median(times), "ls_json_runs_s": times,
            "segments_fn_s": statistics.median(in_process), "segments_fn_runs_s": in_process,
            "rows_listed": len(rows), "helper_rows_listed": listed}


def ls_with_segments(count: int, runs: int) -> dict:
    """Time ``ls`` while a helper child holds ``count`` named segments; then let it exit
    and wait for its segments to leave /dev/shm."""
    helper = subprocess.Popen([PY, "-m", "benchmarks._hold_segments", str(count)], cwd=ROOT,
                              env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        made = int(helper.stdout.readline())
        result = {"segments_held": made, "named_in_dev_shm": len(_own_names(helper.pid))}
        result |= time_ls(helper.pid, runs)
    finally:
        helper.stdin.close()
        helper.wait(60)
    left, took = wait_gone(helper.pid, GONE_TIMEOUT)
    return result | {"left_after_exit": left, "gone_after_s": took}


def cli_table(lc: dict, ls: dict) -> str:
    med = lc["median_s"]
    rows = [
        ("python -c pass", time_label(med["plain"])),
        ("python -c 'import shmtensor.cli'", time_label(med["import_cli"])),
        ("shmtensor leak-check -- python -c pass", time_label(med["leak_check"])),
        ("  leak-check overhead (difference)", time_label(lc["overhead_s"])),
        (f"shmtensor ls --json, {ls['segments_held']} helper segments "
         f"({ls['rows_listed']} rows)", time_label(ls["ls_json_s"])),
        ("  shmtensor.cli.segments() in process", time_label(ls["segments_fn_s"])),
        (f"helper exited: its segments gone from /dev/shm after ({ls['left_after_exit']} "
         "left)", time_label(ls["gone_after_s"])),
    ]
    return _report.format_rows(("command", "median wall time"), rows)


def cli_targets(lc: dict, ls: dict) -> list[dict]:
    return [
        target("leak-check overhead: wall(leak-check -- python -c pass) - wall(python -c "
               "pass)", lc["overhead_s"] * 1e3, "<=", 100, unit="ms", section="cli"),
        target(f"ls --json wall time with {ls['segments_held']} segments (it listed "
               f"{ls['helper_rows_listed']} of them)", ls["ls_json_s"], "<=", 1, unit="s",
               section="cli"),
        target("helper's segments ls --json did not list", ls["segments_held"]
               - ls["helper_rows_listed"], "<=", 0, unit="segments", section="cli"),
        target(f"helper's segments left in /dev/shm {GONE_TIMEOUT:g} s after it exited",
               ls["left_after_exit"], "<=", 0, unit="segments", section="cli"),
    ]


def run(runs: int) -> Section:
    lc = leak_check_overhead(runs)
    print(f"  cli          leak-check overhead {time_label(lc['overhead_s'])}",
          file=sys.stderr, flush=True)
    ls = ls_with_segments(SEGMENTS, runs)
    print(f"  cli          ls --json with {ls['segments_held']} segments "
          f"{time_label(ls['ls_json_s'])}", file=sys.stderr, flush=True)
    med = lc["median_s"]
    note = (f"of the leak-check overhead, {time_label(med['import_cli'] - med['plain'])} is "
            "importing shmtensor.cli (the shmtensor package, numpy, psutil)")
    return Section(key="cli", title="CLI overhead (fresh processes, median wall time)",
                   table=cli_table(lc, ls), targets=cli_targets(lc, ls),
                   data={"runs": runs, "leak_check": lc, "ls": ls}, notes=[note])
