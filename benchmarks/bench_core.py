"""The core table: per-array transfer times of shmtensor beside its peers, and the targets.

A spawned child produces arrays, the parent consumes them and times steady-state
``get()``s (see :mod:`benchmarks._harness`); every queue peer goes through the same
harness.  :mod:`benchmarks.run` runs this and the other sections and writes the results.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from functools import partial

import shmtensor as st

from . import _peers, _report
from ._harness import (SHARED, Peer, median_session, time_joblib, time_memcpy,
                       time_queue)
from ._report import GB, KB, MB, ratio, target

NOT_SHARED = "not shared"
JOBLIB_SCENARIO = "joblib round trip (other harness)"
FLOOR = "floor"
STDLIB, SHM = "stdlib mp.Queue", "shmtensor Queue"
TORCH_FD, TORCH_FS, TORCH_FD_PRE = "torch fd", "torch fs", "torch fd pre-shared"
MEMCPY, JOBLIB = "numpy copyto", "joblib loky x2"

PEERS = (
    Peer(NOT_SHARED, STDLIB, "plain", "stdlib"),
    Peer(NOT_SHARED, SHM, "plain", "shmtensor"),
    Peer(NOT_SHARED, TORCH_FD, "torch_fd", "torch"),
    Peer(NOT_SHARED, TORCH_FS, "torch_fs", "torch"),
    Peer(SHARED, SHM, "shmtensor_shared", "shmtensor"),
    Peer(SHARED, TORCH_FD_PRE, "torch_fd_preshared", "torch"),
    Peer(SHARED, "SharedMemory attach", "shared_memory", "stdlib", _peers.take_shared_memory),
)
ONLY_1KB = {TORCH_FS}
RECYCLING_SIZE = 256 * MB


@dataclass(frozen=True)
class Settings:
    """How much to measure: which sizes, and how many sessions, rounds and arrays."""

    copy_sizes: tuple[int, ...]     # peers that copy each array (1 GB would only be slow)
    shared_sizes: tuple[int, ...]
    sessions: int                   # fresh producers per measurement; the median one counts
    rounds: int                     # timed rounds per session; the median one counts
    max_n: int                      # arrays per round, at most

    def sizes(self, peer: Peer) -> tuple[int, ...]:
        if peer.label in ONLY_1KB:
            return (KB,)
        return self.shared_sizes if peer.scenario == SHARED else self.copy_sizes

    def n(self, moved: int) -> int:
        """Arrays per round: ~64 MB copied a round, at least 3, at most ``max_n``."""
        return max(3, min(self.max_n, (64 * MB) // max(moved, 1)))


FULL = Settings((KB, 64 * KB, MB, 16 * MB, 256 * MB), (KB, 64 * KB, MB, 16 * MB, 256 * MB, GB),
                sessions=3, rounds=3, max_n=2000)
QUICK = Settings((KB, MB, 256 * MB), (KB, MB, GB), sessions=1, rounds=3, max_n=1000)


def warmup(n: int) -> int:
    """Untimed items before the first round: enough to start up and fill the pipeline."""
    return max(2, min(20, n // 10))


def progress(result: dict, wall: float) -> None:
    """One line on stderr per finished measurement."""
    shown = _report.time_label(result["per_array_s"]) if "error" not in result else result["error"]
    print(f"  {result['scenario']:<12.12} {_report.size_label(result['size']):>7}  "
          f"{result['peer']:<22} {shown:>10}   ({wall:.1f} s)", file=sys.stderr, flush=True)


def without_info(result: dict) -> dict:
    """A result as results.json keeps it: without the producer's counters."""
    return {k: v for k, v in result.items() if k != "info"}


def measure(scenario: str, peer: str, size: int, run, sessions: int) -> dict:
    """Run one measurement; a failure is recorded (and shown), not fatal to the run."""
    result = {"scenario": scenario, "peer": peer, "size": size}
    start = time.monotonic()
    try:
        timing = median_session(run, sessions)
        result.update(per_array_s=timing.per_array_s, n=timing.n, info=timing.producer_info)
    except Exception as e:  # one broken peer must not hide the others' numbers
        result.update(per_array_s=None, n=0, error=f"{type(e).__name__}: {e}")
    progress(result, time.monotonic() - start)
    return result


def plan(settings: Settings, have_torch: bool, have_joblib: bool) -> list[tuple]:
    """Every measurement as ``(scenario, peer, size, run)``; torch's and joblib's only
    when importable."""
    rounds = settings.rounds
    out = [(FLOOR, MEMCPY, 256 * MB, partial(time_memcpy, 256 * MB, 3 * rounds))]
    for peer in PEERS:
        if peer.context == "torch" and not have_torch:
            continue
        for size in settings.sizes(peer):
            n = settings.n(peer.bytes_moved(size))
            out.append((peer.scenario, peer.label, size,
                        partial(time_queue, peer, size, n, rounds, warmup(n))))
    if have_joblib:
        for size in settings.copy_sizes:
            out.append((JOBLIB_SCENARIO, JOBLIB, size,
                        partial(time_joblib, size, settings.n(size), rounds)))
    return out


def run_all(settings: Settings, have_torch: bool, have_joblib: bool) -> list[dict]:
    """Every measurement of the plan, contenders interleaved: each session runs every
    (scenario, peer, size) once, in turn, so a machine whose speed drifts during the run
    moves every contender alike; each result is the median session."""
    todo = plan(settings, have_torch, have_joblib)
    sessions: list[list[dict]] = [[] for _ in todo]
    for k in range(settings.sessions):
        print(f" session {k + 1} of {settings.sessions}:", file=sys.stderr, flush=True)
        for i, (scenario, peer, size, run) in enumerate(todo):
            sessions[i].append(measure(scenario, peer, size, run, 1))
    results = []
    for done in sessions:
        ok = sorted((r for r in done if r["per_array_s"] is not None),
                    key=lambda r: r["per_array_s"])
        if not ok:
            results.append(done[-1])
            continue
        mid = dict(ok[len(ok) // 2])
        mid["n"] = sum(r["n"] for r in ok)
        mid["sessions_s"] = [r["per_array_s"] for r in done]
        results.append(mid)
    return results


class Lookup:
    """Per-array times by (scenario, peer, size)."""

    def __init__(self, results: list[dict]) -> None:
        self.times = {(r["scenario"], r["peer"], r["size"]): r["per_array_s"] for r in results}

    def __call__(self, scenario: str, peer: str, size: int) -> float | None:
        return self.times.get((scenario, peer, size))

    def by_size(self, scenario: str, peer: str) -> dict[int, float]:
        return {size: t for (sc, p, size), t in self.times.items()
                if sc == scenario and p == peer and t is not None}


def evaluate_targets(results: list[dict]) -> list[dict]:
    """The project's targets as ratios of the measured times (None where a peer is missing)."""
    t = Lookup(results)
    shared = t.by_size(SHARED, SHM)
    slowest, fastest = max(shared.values(), default=None), min(shared.values(), default=None)
    torch_over_shared = [r for r in (ratio(t(SHARED, TORCH_FD_PRE, s), shared[s]) for s in shared)
                         if r is not None]
    span = "shared " + "..".join(_report.size_label(s) for s in (min(shared), max(shared))) \
        if shared else "shared"
    return [
        target("1 KB not shared: shmtensor time / stdlib time",
               ratio(t(NOT_SHARED, SHM, KB), t(NOT_SHARED, STDLIB, KB)), "<=", 1.3),
        target("1 KB not shared: shmtensor time / stdlib time (issue 14)",
               ratio(t(NOT_SHARED, SHM, KB), t(NOT_SHARED, STDLIB, KB)), "<=", 1.1),
        target("1 KB not shared: torch fd (not pre-shared) time / shmtensor time",
               ratio(t(NOT_SHARED, TORCH_FD, KB), t(NOT_SHARED, SHM, KB)), ">=", 15),
        target(f"{span}: slowest / fastest shmtensor time (size independence)",
               ratio(slowest, fastest), "<=", 1.5),
        target(f"{span}: slowest shmtensor time / stdlib 1 KB not shared time",
               ratio(slowest, t(NOT_SHARED, STDLIB, KB)), "<=", 2),
        target(f"{span}: slowest shmtensor time / stdlib 1 KB not shared time (issue 14)",
               ratio(slowest, t(NOT_SHARED, STDLIB, KB)), "<=", 1.0),
        target(f"{span}: torch fd pre-shared time / shmtensor time, worst size",
               min(torch_over_shared, default=None), ">=", 10),
        target("256 MB not shared: shmtensor time / memcpy 256 MB",
               ratio(t(NOT_SHARED, SHM, 256 * MB), t(FLOOR, MEMCPY, 256 * MB)), "<=", 2),
        target("256 MB not shared: shmtensor time / memcpy 256 MB (issue 14)",
               ratio(t(NOT_SHARED, SHM, 256 * MB), t(FLOOR, MEMCPY, 256 * MB)), "<=", 1.3),
        target("256 MB not shared: torch fd (not pre-shared) time / shmtensor time",
               ratio(t(NOT_SHARED, TORCH_FD, 256 * MB), t(NOT_SHARED, SHM, 256 * MB)), ">=", 7),
    ]


def recycling(results: list[dict]) -> dict | None:
    """The producer's shmtensor counters after sending the 256 MB not-shared arrays."""
    for r in results:
        if (r["scenario"], r["peer"], r["size"]) == (NOT_SHARED, SHM, RECYCLING_SIZE):
            info = r.get("info") or {}
            keys = ("segments_created", "segments_recycled", "arrays_sent_copied")
            return {k: info[k] for k in keys if k in info}
    return None


def print_report(settings: Settings, machine: dict, results: list[dict], targets: list[dict],
                 counters: dict | None) -> None:
    print(f"\nshmtensor {st.__version__} beside its peers (Python {machine['python']}, "
          f"{machine['cpus']} CPUs; spawn, producer in a child, parent times its gets)")
    print(f"per array: the median of {settings.sessions} session(s) (fresh producers), each "
          f"the median of {settings.rounds} rounds; n: arrays timed in all\n")
    print(_report.format_table(results))
    print("\ntargets:")
    print(_report.format_targets(targets))
    if counters is not None:
        print("\nshmtensor producer counters, 256 MB not shared (after warm-up and all rounds):")
        print("  " + ", ".join(f"{k}={v}" for k, v in counters.items()))
