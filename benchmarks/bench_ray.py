"""Ray, one host: a 64 MB array from an actor to a task and back, mutated in place.

The round trip, timed in the actor: it passes its array to a task
(``ray.get(bump.remote(self.a))``), the task adds 1 to every element and returns the
array, and the actor has the result as its own writable array again.

* plain Ray (no shmtensor loaded in the session): the actor's argument is copied into
  the object store; the task's argument is a read-only view there, so the task makes a new
  array (``a + 1``, one pass) and returns it (a second copy into the object store); the
  actor copies the read-only result into its own array (``np.copyto``): three copies
  plus the pass.
* shmtensor.ray: the actor's array is shared (``shmtensor.zeros``); the task gets a view of
  the same memory and adds 1 in place (``a += 1``); the actor gets its own memory back.

Each contender runs in its own Ray session (``address="local"``, 2 CPUs, no dashboard),
warmed by one round trip first; the median of ``rounds`` counts.

Two hosts, where the namespace cluster of tests/ray_cluster.py can be built (root, ``ip``,
``unshare``): an actor on host A returns its array to a task on host B, which adds 1 and
returns it to the driver on A (:mod:`benchmarks._ray_two_hosts`).  Plain Ray and
shmtensor.ray run as alternate jobs on one cluster (interleaved sets); the ratio is the
median of the sets' ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from . import _report
from ._report import MB, Section, ratio, target, time_label

NBYTES = 64 * MB
PLAIN, SHM = "plain Ray", "shmtensor.ray"
TWO = " (two hosts)"
REPO = Path(__file__).resolve().parent.parent
STORE = 512 * MB  # object store: the plain round trip keeps a few 64 MB copies in it


def _ray_args() -> dict:
    return dict(address="local", num_cpus=2, include_dashboard=False,
                object_store_memory=STORE, log_to_driver=False)


def _remotes(ray, shared: bool):
    def bump(a):
        if a.flags.writeable:
            a += 1
            return a
        return a + 1

    bump = ray.remote(num_cpus=0)(bump)

    class Holder:
        def __init__(self, nbytes: int):
            if shared:
                import shmtensor
                self.a = shmtensor.zeros(nbytes // 8)
            else:
                self.a = np.zeros(nbytes // 8)

        def round_trips(self, rounds: int) -> list[float]:
            """Seconds per round trip, timed here; each round checked."""
            times = []
            for _ in range(rounds):
                expected = self.a[0] + 1
                t0 = time.perf_counter()
                b = ray.get(bump.remote(self.a))
                if not np.shares_memory(b, self.a):
                    np.copyto(self.a, b)  # plain Ray: a read-only copy came back
                times.append(time.perf_counter() - t0)
                del b
                if self.a[0] != expected or self.a[-1] != expected:
                    raise AssertionError(f"round trip lost the update: {self.a[0]}")
            return times

    return ray.remote(num_cpus=0)(Holder)


def round_trips(shared: bool, rounds: int) -> list[float]:
    """Seconds per round trip, in a fresh Ray session (warmed by one round first)."""
    import ray
    if shared:
        import shmtensor.ray as sr
        sr.init(**_ray_args())
    else:
        ray.init(**_ray_args())
    try:
        holder = _remotes(ray, shared).remote(NBYTES)
        ray.get(holder.round_trips.remote(1))  # warm: workers up, mappings made
        times = ray.get(holder.round_trips.remote(rounds))
        ray.kill(holder)
        return times
    finally:
        ray.shutdown()


def measure(rounds: int) -> dict[str, list[float]]:
    """Plain Ray first: once shmtensor.ray registers its serializers in this process they
    stay registered for the rest of it."""
    out = {}
    for peer, shared in ((PLAIN, False), (SHM, True)):
        out[peer] = round_trips(shared, rounds)
        print(f"  ray          {peer:<14} {time_label(statistics.median(out[peer])):>10}",
              file=sys.stderr, flush=True)
    return out


def _cluster_module():
    """tests/ray_cluster.py (the two-host namespace cluster), loaded by path."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("ray_cluster",
                                                  REPO / "tests" / "ray_cluster.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure_two_hosts(sets: int, rounds: int) -> tuple[dict[str, list[float]], list[float],
                                                       str | None]:
    """Seconds per round trip across two namespace hosts, plain Ray and shmtensor.ray as
    alternate jobs (``sets`` of each); also each set's plain / shmtensor ratio, and why
    nothing was measured (None when it was)."""
    rc = _cluster_module()
    why = rc.unavailable()
    if why:
        return {}, [], why
    times: dict[str, list[float]] = {PLAIN + TWO: [], SHM + TWO: []}
    ratios = []
    script = str(REPO / "benchmarks" / "_ray_two_hosts.py")
    cwd = os.getcwd()
    os.chdir(REPO)  # the drivers run from the repository (shmtensor importable)
    try:
        with rc.TwoHosts(cpus=2, store_mb=STORE // MB) as cluster:
            for _ in range(sets):
                med = {}
                for peer, who in ((PLAIN, "plain"), (SHM, "shm")):
                    ts = cluster.driver(script, who, str(rounds), str(NBYTES // MB),
                                        timeout=300)["rounds_s"]
                    times[peer + TWO] += ts
                    med[peer] = statistics.median(ts)
                    print(f"  ray 2 hosts  {peer:<14} {time_label(med[peer]):>10}",
                          file=sys.stderr, flush=True)
                ratios.append(med[PLAIN] / med[SHM])
    finally:
        os.chdir(cwd)
    return times, ratios, None


def section(times: dict[str, list[float]], two_hosts: tuple[dict[str, list[float]],
                                                           list[float], str | None]
            | None = None) -> Section:
    two_times, two_ratios, two_why = two_hosts or ({}, [], "not asked for")
    times = {**times, **two_times}
    med = {peer: statistics.median(ts) for peer, ts in times.items()}
    rows = [(peer, time_label(med[peer]), time_label(min(ts)), time_label(max(ts)), len(ts))
            for peer, ts in times.items()]
    targets = [target(f"{PLAIN} time / {SHM} time", ratio(med.get(PLAIN), med.get(SHM)),
                      ">=", 5, section="ray")]
    notes = ["timed in the actor: ray.get(bump.remote(self.a)), until the actor has the "
             "result as its own writable array",
             "plain Ray: the argument and the task's result are copied into the "
             "object store, the task's input is read-only there (a + 1 makes a new "
             "array) and the actor copies the result into its array",
             "shmtensor.ray: the task adds 1 in place in the actor's own memory"]
    if two_ratios:
        targets.append(target(f"two hosts: {PLAIN} time / {SHM} time",
                              statistics.median(two_ratios), ">=", 1.0, section="ray"))
        notes += [f"two hosts (namespaces joined by a veth pair, one machine): actor on A "
                  f"-> task on B (+1) -> driver on A, timed in the driver; "
                  f"{len(two_ratios)} interleaved sets, ratios "
                  + ", ".join(f"{r:.2f}x" for r in two_ratios),
                  "two hosts, shmtensor.ray: there, A's agent sends the bytes over TCP "
                  "straight into a shared segment on B; back, the task's result carries "
                  "its bytes through Ray's object store (as plain Ray's does, so Ray keeps "
                  "and re-makes it), copied into a shared segment on A (plain Ray: a copy "
                  "into the object store and Ray's transfer each way)"]
    else:
        notes.append(f"two hosts: not measured ({two_why})")
    return Section(
        key="ray",
        title=f"Ray: a {NBYTES // MB} MB float64 array, actor -> task -> actor (one host) "
              "or driver (two hosts), mutated (+1): time per round trip",
        table=_report.format_rows(("peer", "median", "best", "worst", "rounds"), rows),
        targets=targets,
        data={"array_bytes": NBYTES, "rounds_s": times,
              "median_s": med, "two_hosts_ratios": two_ratios},
        notes=notes)


def run(quick: bool = False) -> Section:
    """The Ray section of scripts/bench (skipped when Ray is not installed)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return Section(key="ray", title="Ray: skipped (pip install 'shmtensor[ray]')",
                       table="", targets=[], data={"skipped": True})
    return section(measure(5 if quick else 10),
                   measure_two_hosts(2 if quick else 3, 5 if quick else 10))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--sets", type=int, default=3, help="two hosts: interleaved sets")
    ap.add_argument("--one-host", action="store_true", help="skip the two-host rows")
    args = ap.parse_args()
    sec = section(measure(args.rounds),
                  None if args.one_host else measure_two_hosts(args.sets, args.rounds))
    print(sec.render(), flush=True)
    return 0 if all(t["pass"] for t in sec.targets) else 1


if __name__ == "__main__":
    sys.exit(main())
