"""A producer actor fills arrays; consumer tasks on two hosts scale them and send them back,
timed with plain Ray and with shmtensor.ray.

With no argument it starts a two-node Ray cluster on this machine, the second node made to
look like another host (``SHMTENSOR_RAY_HOST``): consumers there get the arrays by value,
consumers beside the producer get views of its memory.  ``--address ADDR`` runs on a real
cluster instead (consumers are then spread by Ray; the table says where each ran).

Run it inside the venv: ``python examples/ray_pipeline.py [--arrays 8] [--mb 16]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import ray

import shmtensor

OTHER = "example-other-host"


@ray.remote(num_cpus=0)
class Producer:
    """Fills arrays in shared memory (``shared``) or plain numpy arrays."""

    def __init__(self, shared: bool, nbytes: int, count: int) -> None:
        make = shmtensor.empty if shared else np.empty
        self.arrays = [make(nbytes // 8) for _ in range(count)]

    def fill(self, i: int, value: float):
        self.arrays[i][:] = value
        return self.arrays[i]


@ray.remote(num_cpus=0)
def consume(a):
    """Scale by 2 (in place where allowed: plain Ray hands out read-only arrays) and send
    the array back, with where this ran."""
    import shmtensor.ray as sr
    if not a.flags.writeable:
        a = a * 2
    else:
        a *= 2
    return sr.host_id(), a


def run(shared: bool, count: int, nbytes: int, rounds: int, where: dict) -> dict:
    """Median seconds per round (``count`` arrays filled, consumed ``where``, and back)."""
    producer = Producer.options(**PRODUCER).remote(shared, nbytes, count)
    times = []
    hosts = set()
    for r in range(rounds + 1):  # round 0 warms the workers up
        t0 = time.perf_counter()
        results = ray.get([consume.options(**where).remote(producer.fill.remote(i, i + r))
                           for i in range(count)])
        dt = time.perf_counter() - t0
        for i, (host, a) in enumerate(results):
            hosts.add(host)
            if a[0] != 2 * (i + r) or a[-1] != 2 * (i + r):
                raise AssertionError(f"array {i} came back wrong: {a[0]}")
        if r:
            times.append(dt)
        del results
    ray.kill(producer)
    return {"median_s": statistics.median(times), "hosts": sorted(hosts)}


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
        placements = {"wherever Ray puts them": {}}

    print(f"{args.arrays} arrays of {args.mb} MB: producer actor -> consumer tasks (x2) -> "
          f"driver, {args.rounds} rounds\n")
    results: dict[str, dict] = {}
    try:
        ray.init(address=address)  # plain Ray first: shmtensor.ray, once registered, stays
        for name, where in placements.items():
            results[f"plain Ray|{name}"] = run(False, args.arrays, nbytes, args.rounds, where)
        ray.shutdown()
        import shmtensor.ray as sr
        sr.init(address=address)
        for name, where in placements.items():
            results[f"shmtensor.ray|{name}"] = run(True, args.arrays, nbytes, args.rounds, where)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    print(f"{'consumers':<24}  {'plain Ray':>10}  {'shmtensor.ray':>13}  {'speed-up':>8}")
    for name in placements:
        plain = results[f"plain Ray|{name}"]["median_s"]
        ours = results[f"shmtensor.ray|{name}"]["median_s"]
        print(f"{name:<24}  {plain * 1e3:7.1f} ms  {ours * 1e3:10.1f} ms  {plain / ours:7.1f}x")
    print("\n(time per round: every array filled, scaled by a consumer and back in the driver)"
          "\nshmtensor.ray: consumers on the producer's host scale its arrays in place (a view "
          "of the\nsame memory, nothing copied, and the driver gets that memory back); "
          "consumers on the\nother host get a copy by value from the producer host's agent, "
          "which lands in shared\nmemory there (one copy and one actor call more than plain "
          "Ray, each way).  Plain Ray\ncopies every array into the object store and hands "
          "out read-only views, so each\nconsumer makes a new array.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
