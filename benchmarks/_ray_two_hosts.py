"""The two-host round trip of bench_ray, as a Ray driver in host A of the namespace cluster
(tests/ray_cluster.py): ``python -m benchmarks._ray_two_hosts plain|shm ROUNDS MB``.

An actor on host A holds an array; each round the driver passes the actor's array
(``holder.get.remote()``, an ObjectRef) to a task on host B, which adds 1 and returns it,
and gets the result: actor -> task on the other host -> driver.  Plain Ray: the actor's
return is copied into A's object store, pulled to B, ``a + 1`` makes a new array, which is
copied into B's store and pulled to A (read-only there).  shmtensor.ray: the actor returns
a handle (the driver is on its node); the task gets a copy from A's agent over TCP, into
a shared segment on B, adds 1 in place and returns the handle with the bytes (a result
made off the driver's node carries them: a copy into B's object store, Ray's transfer);
the driver copies them into a shared segment on A (writable, shared).  Prints one JSON line: seconds per round.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import ray

A = {"resources": {"host_a": 1}, "num_cpus": 0}
B = {"resources": {"host_b": 1}, "num_cpus": 0}


@ray.remote(num_cpus=0)
def bump(a):
    if a.flags.writeable:
        a += 1
        return a
    return a + 1


@ray.remote(num_cpus=0)
class Holder:
    def __init__(self, nbytes: int, shared: bool) -> None:
        if shared:
            import shmtensor
            self.a = shmtensor.zeros(nbytes // 8)
        else:
            self.a = np.zeros(nbytes // 8)

    def get(self):
        return self.a


def main() -> int:
    contender, rounds, mb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    shared = contender == "shm"
    if shared:
        import shmtensor.ray as sr
        sr.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    else:
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    try:
        holder = Holder.options(**A).remote(mb << 20, shared)
        times = []
        for r in range(rounds + 1):  # round 0 warms up: workers, agents, mappings
            t0 = time.perf_counter()
            b = ray.get(bump.options(**B).remote(holder.get.remote()))
            dt = time.perf_counter() - t0
            if b[0] != 1 or b[-1] != 1:
                raise AssertionError(f"the round trip lost the update: {b[0]}")
            del b
            if r:
                times.append(dt)
        ray.kill(holder)
    finally:
        ray.shutdown()
    print(json.dumps({"contender": contender, "rounds_s": times}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
