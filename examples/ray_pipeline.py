"""A producer actor fills arrays; consumer tasks scale them and send them back, timed with
plain Ray and with shmtensor.ray, with where every consumer ran and why each row is as
fast as it is.

With no argument it starts a two-node Ray cluster on this machine, the second node made to
look like another host (``SHMTENSOR_RAY_HOST``; the bytes between the "hosts" then cross
this machine's loopback): consumers beside the producer get views of its memory,
consumers on the other host get copies.  ``--address ADDR`` runs on a real cluster:
consumers are spread over its nodes (Ray's ``SPREAD``), and the table says which host
each ran on.

Run it inside the venv: ``python examples/ray_pipeline.py [--arrays 8] [--mb 16]``.
"""

from __future__ import annotations

import argparse
import collections
import socket
import statistics
import sys
import time

import numpy as np
import ray

import shmtensor

OTHER = "example-other-host"


def where() -> tuple[str, str]:
    """This process's host, as shmtensor tells hosts apart (its identity), and a name for
    it: the Ray node, its IP and its host (the hostname, or the identity the example gave
    the second node)."""
    import os

    import shmtensor.ray as sr
    node = ray.get_runtime_context().get_node_id()[:8]
    host = os.environ.get("SHMTENSOR_RAY_HOST") or socket.gethostname()
    return sr.host_id(), f"node {node} at {ray.util.get_node_ip_address()}, host {host}"


@ray.remote(num_cpus=0)
class Producer:
    """Fills arrays in shared memory (``shared``) or plain numpy arrays."""

    def __init__(self, shared: bool, nbytes: int, count: int) -> None:
        make = shmtensor.empty if shared else np.empty
        self.arrays = [make(nbytes // 8) for _ in range(count)]

    def where(self) -> tuple[str, str]:
        return where()

    def fill(self, i: int, value: float):
        self.arrays[i][:] = value
        return self.arrays[i]


@ray.remote(num_cpus=0)
def consume(a):
    """Scale by 2 (in place where allowed: plain Ray hands out read-only arrays) and send
    the array back, with where this ran and whether it got a writable shared array."""
    import shmtensor
    got_shared = shmtensor.is_shared(a) and a.flags.writeable
    if not a.flags.writeable:
        a = a * 2
    else:
        a *= 2
    return where(), got_shared, a


def run(shared: bool, count: int, nbytes: int, rounds: int, placement: dict) -> dict:
    """Seconds per round (``count`` arrays filled, consumed, and back in the driver), and
    where the consumers ran."""
    producer = Producer.options(**PRODUCER).remote(shared, nbytes, count)
    home, home_name = ray.get(producer.where.remote())
    times = []
    ran: collections.Counter[str] = collections.Counter()
    crossed = views = 0
    for r in range(rounds + 1):  # round 0 warms the workers up
        t0 = time.perf_counter()
        results = ray.get([consume.options(**placement).remote(producer.fill.remote(i, i + r))
                           for i in range(count)])
        dt = time.perf_counter() - t0
        for i, ((host, name), got_shared, a) in enumerate(results):
            if a[0] != 2 * (i + r) or a[-1] != 2 * (i + r):
                raise AssertionError(f"array {i} came back wrong: {a[0]}")
            if r:
                ran[name] += 1
                crossed += host != home
                views += host == home and got_shared
        if r:
            times.append(dt)
        del results
    ray.kill(producer)
    return {"times": times, "ran": ran, "crossed": crossed, "views": views,
            "consumed": count * rounds, "producer": home_name}


def why(shared: bool, res: dict) -> str:
    """Why the row is as fast as it is, from what happened in it."""
    n, crossed = res["consumed"], res["crossed"]
    if not shared:
        text = ("every array copied into the producer's object store; consumers get "
                "read-only views and make new arrays (a * 2), which are copied into the "
                "store again")
        if crossed:
            text += f"; {crossed} of {n} went to another host and back by Ray's transfer"
        return text
    parts = []
    if res["views"]:
        parts.append(f"{res['views']} of {n} consumers scaled a view of the producer's "
                     "memory in place and the driver got that memory back: nothing copied")
    if crossed:
        parts.append(f"{crossed} of {n} crossed hosts: there, the producer's agent sent "
                     "the bytes over TCP into a shared segment (one copy each side); back, "
                     "a result made off the driver's node carried its bytes through Ray's "
                     "object store (Ray's transfer: Ray keeps, moves and re-makes it as a "
                     "plain array), copied into a shared segment on the driver's host")
    return "; ".join(parts) or "nothing consumed"


PRODUCER: dict = {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", help="a running Ray cluster (default: start two nodes here)")
    ap.add_argument("--arrays", type=int, default=8)
    ap.add_argument("--mb", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    nbytes = args.mb << 20

    cluster = None
    if args.address is None:
        from ray.cluster_utils import Cluster

        import shmtensor.ray._host as host
        cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=2, include_dashboard=False, object_store_memory=512 << 20,
            resources={"host_a": 100}))
        cluster.add_node(num_cpus=2, object_store_memory=512 << 20, resources={"host_b": 100},
                         env_vars={host.ENV: OTHER})
        address = cluster.address
        PRODUCER.update(resources={"host_a": 1})
        placements = {"beside the producer": {"resources": {"host_a": 1}},
                      "on the other host": {"resources": {"host_b": 1}}}
    else:
        address = args.address
        placements = {"spread over the nodes": {"scheduling_strategy": "SPREAD"}}

    print(f"{args.arrays} arrays of {args.mb} MB: producer actor -> consumer tasks (x2) -> "
          f"driver, {args.rounds} rounds\n")
    results: dict[str, dict] = {}
    try:
        ray.init(address=address)  # plain Ray first: shmtensor.ray, once registered, stays
        for name, placement in placements.items():
            results[f"plain Ray|{name}"] = run(False, args.arrays, nbytes, args.rounds,
                                               placement)
        ray.shutdown()
        import shmtensor.ray as sr
        sr.init(address=address)
        for name, placement in placements.items():
            results[f"shmtensor.ray|{name}"] = run(True, args.arrays, nbytes, args.rounds,
                                                   placement)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()

    def ms(ts: list[float]) -> str:
        return f"{statistics.median(ts) * 1e3:7.1f} ms ({min(ts) * 1e3:.0f}-{max(ts) * 1e3:.0f})"

    print(f"{'consumers':<22}  {'plain Ray (range)':>24}  {'shmtensor.ray (range)':>24}  "
          f"{'speed-up':>8}")
    for name in placements:
        plain, ours = results[f"plain Ray|{name}"], results[f"shmtensor.ray|{name}"]
        speed = statistics.median(plain["times"]) / statistics.median(ours["times"])
        print(f"{name:<22}  {ms(plain['times']):>24}  {ms(ours['times']):>24}  {speed:7.1f}x")
    print("\n(time per round: every array filled, scaled by a consumer and back in the "
          "driver; median, and the range over the rounds)")
    for key, res in results.items():
        peer, name = key.split("|")
        hosts = ", ".join(f"{h} x{c}" for h, c in sorted(res["ran"].items()))
        print(f"\n{peer}, consumers {name} (producer on {res['producer']}):\n"
              f"  consumers ran on: {hosts}\n  {why(peer == 'shmtensor.ray', res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
