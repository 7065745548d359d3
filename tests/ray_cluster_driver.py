"""Drivers for the two-host cluster tests (tests/test_ray_cluster.py), run in host A.

``python ray_cluster_driver.py CASE`` connects to the cluster (``RAY_ADDRESS``) with
``shmtensor.ray.init``, runs CASE and prints its findings as one JSON line.  ``death``
prints a first line (``ready``) once its arrays exist on host B and waits for a line on
stdin (host B has been killed meanwhile) before reading them.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import shmtensor
import shmtensor.ray as sr

A = {"resources": {"host_a": 1}, "num_cpus": 0}
B = {"resources": {"host_b": 1}, "num_cpus": 0}


@ray.remote
def add_one(a):
    a += 1
    return a


@ray.remote
def describe(a):
    import shmtensor
    import shmtensor.ray as sr
    return (sr.host_id(), ray.get_runtime_context().get_node_id(), shmtensor.is_shared(a),
            bool(a.flags.writeable), float(a.sum()))


@ray.remote
def make(n, value, shared=True):
    import shmtensor
    a = shmtensor.empty(n) if shared else np.empty(n)
    a[:] = value
    return a


@ray.remote
class Producer:
    def __init__(self):
        self.kept = []

    def fill(self, n, value, shared=True):
        a = shmtensor.full(n, value, dtype=np.float64) if shared else np.full(n, value)
        self.kept.append(a)
        return a

    def first(self):
        return [float(a[0]) for a in self.kept]

    def put(self, n, value, shared=True):
        """An object this actor owns (it dies with it): an ObjectRef in a list."""
        return [ray.put(self.fill(n, value, shared))]


def _double(a):
    a *= 2
    return a


def nodes() -> dict[str, str]:
    """node id -> its IP, for the alive nodes."""
    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}


def b_node() -> str:
    return next(nid for nid, ip in nodes().items() if ip == "10.200.0.2")


@ray.remote
class Holder:
    def hold(self, refs):
        self.refs = refs  # ObjectRefs in a list: borrowed, not resolved
        return len(refs)


def case_same() -> dict:
    a = shmtensor.zeros(1000)
    b = ray.get(add_one.options(**A).remote(a))
    p = Producer.options(**A).remote()
    c = ray.get(p.fill.remote(250_000, 1.0))  # the actor's own memory, returned
    c[0] = 9.0
    seen = ray.get(p.first.remote())[0]
    info = ray.get(describe.options(**A).remote(a[::2]))
    return {"task_wrote_ours": bool((a == 1).all()), "shares": bool(np.shares_memory(a, b)),
            "writeable": bool(b.flags.writeable), "actor_sees_our_write": seen == 9.0,
            "returned_shared": shmtensor.is_shared(c) and bool(c.flags.writeable),
            "host": info[0] == sr.host_id(), "view": list(info[2:])}


def case_other() -> dict:
    a = shmtensor.zeros((100, 10), dtype=np.int32)
    a[:] = np.arange(1000, dtype=np.int32).reshape(100, 10)
    view = a[::3, 1::2]
    host, node, shared, writeable, total = ray.get(describe.options(**B).remote(view))
    b = ray.get(add_one.options(**B).remote(view))
    big = ray.get(make.options(**B).remote(8 << 20, 7.0))  # 64 MiB made on host B
    p = Producer.options(**B).remote()
    c = ray.get(p.fill.remote(300_000, 3.0))
    # what a handle brings to B comes from A's agent: killed, then not reachable
    x = shmtensor.full(300_000, 5.0)
    refs = [ray.put(x)]
    replaced = ray.get(fetch_after.options(**B).remote(refs, "kill"))
    x[:] = 6.0
    refs = [ray.put(x)]
    through_store = ray.get(fetch_after.options(**B).remote(refs, "closed"))
    return {"agent_replaced": replaced == [True, True, True],
            "through_store": through_store == [True, True, True],
            "other_host": host != sr.host_id(), "node_is_b": nodes().get(node) == "10.200.0.2",
            "landed_shared": bool(shared and writeable), "sum": total == float(view.sum()),
            "ours_untouched": bool((a == np.arange(1000).reshape(100, 10)).all()),
            "copy_right": bool((b == view + 1).all()) and not np.shares_memory(a, b),
            "copy_shared": shmtensor.is_shared(b) and bool(b.flags.writeable),
            "big": bool(big.shape == (8 << 20,) and (big == 7.0).all()),
            "actor": bool((c == 3.0).all()) and shmtensor.is_shared(c)}


@ray.remote
def fetch_after(refs, sabotage):
    """In a task on B: read ``refs[0]`` (an array put on A: from A's agent), break the way
    to that agent (``kill`` it, or make its port ``closed`` to this process), read again."""
    from shmtensor.ray import _agent, _direct
    job = ray.get_runtime_context().get_job_id()
    a_node = next(nid for nid, ip in nodes().items() if ip == "10.200.0.1")
    key = (job, a_node)
    ray.get(refs[0])  # the endpoint of A's agent now known here
    if sabotage == "kill":
        ray.kill(ray.get_actor(_agent._name(job, a_node), _agent.NAMESPACE))
    else:
        _agent._endpoints[key] = _direct.Endpoint("10.200.0.1", 1, b"x" * _direct.TOKEN_BYTES)
    a = ray.get(refs[0])
    expect = 5.0 if sabotage == "kill" else 6.0
    return [bool((a == expect).all()), shmtensor.is_shared(a),
            sabotage == "kill" or key not in _agent._endpoints]


def case_pool() -> dict:
    arrays = [shmtensor.full(1000, float(i)) for i in range(4)]
    out = {}
    for where, args in (("a", A), ("b", B)):
        with sr.Pool(1, ray_remote_args=args) as pool:
            res = pool.map(_double, arrays)
        out[where] = {"values": [float(r[0]) for r in res],
                      "in_place": [float(a[0]) for a in arrays]}
    return out


def _outcome(ref, expect: float, n: int) -> dict:
    """What ray.get(ref) gave: the data, or the error's class names and message."""
    t0 = time.monotonic()
    try:
        a = ray.get(ref, timeout=60)
        ok = bool(a.shape == (n,) and (a == expect).all())
        return {"result": "data" if ok else "wrong", "s": time.monotonic() - t0}
    except Exception as e:
        return {"result": "error", "s": time.monotonic() - t0,
                "classes": [c.__name__ for c in type(e).__mro__],
                "message": str(e)[:2000], "traceback": traceback.format_exc()[-3000:]}


def _shared_writable(ref) -> bool | None:
    try:
        a = ray.get(ref, timeout=60)
    except Exception:
        return None
    return shmtensor.is_shared(a) and bool(a.flags.writeable)


def case_death() -> dict:
    """Arrays made on host B (plain numpy and shared) by a task with retries, a task without,
    an actor, and a task whose result the driver prefetched; then B dies."""
    here = sr.host_id()
    b = b_node()
    soft = {"scheduling_strategy": NodeAffinitySchedulingStrategy(b, soft=True),
            "num_cpus": 0}
    n = 1 << 20  # 8 MiB: Ray's plain path keeps it in B's object store
    p = Producer.options(**B, max_restarts=0).remote()
    refs = {}
    for kind, shared in (("plain", False), ("shm", True)):
        refs[f"{kind}/task retried"] = make.options(max_retries=3, **soft).remote(n, 1.0, shared)
        refs[f"{kind}/task no retry"] = make.options(max_retries=0, **soft).remote(n, 2.0, shared)
        refs[f"{kind}/actor"] = p.fill.remote(n, 3.0, shared)
        refs[f"{kind}/prefetched"] = make.options(max_retries=0, **soft).remote(n, 4.0, shared)
        refs[f"{kind}/actor prefetched"] = p.fill.remote(n, 5.0, shared)
        refs[f"{kind}/owner died"] = ray.get(p.put.remote(n, 6.0, shared))[0]
    expect = {"task retried": 1.0, "task no retry": 2.0, "actor": 3.0, "prefetched": 4.0,
              "actor prefetched": 5.0, "owner died": 6.0}
    ray.wait(list(refs.values()), num_returns=len(refs), timeout=60, fetch_local=False)
    pre = [r for k, r in refs.items() if k.endswith("prefetched")]
    ray.wait(pre, num_returns=len(pre), timeout=60, fetch_local=True)
    # a receiver on B borrows a reference to an array of ours (its memory, our export)
    x = shmtensor.full(1000, 5.0)
    held = [ray.put(x)]
    holder = Holder.options(**B).remote()
    ray.get(holder.hold.remote(held))
    del x
    print(json.dumps({"ready": True, "b_node": b}), flush=True)
    sys.stdin.readline()  # host B is dead now
    t0 = time.monotonic()
    while b in nodes() and time.monotonic() < t0 + 60:
        time.sleep(0.1)
    detected = time.monotonic() - t0
    out = {k: _outcome(r, expect[k.split("/")[1]], n) for k, r in refs.items()}
    out["shm/prefetched"]["is_shared"] = _shared_writable(refs["shm/prefetched"])
    del held
    deadline = time.monotonic() + 30
    while sr.exports_held() and time.monotonic() < deadline:
        time.sleep(0.1)
    return {"b_node": b, "here": here, "outcomes": out, "detected_s": detected,
            "exports_left": sr.exports_held()}


def case_agents() -> dict:
    """The agents alive: this job's (started by shmtensor.ray.init), once up, and any
    other's (a job's agents end with it)."""
    import gc

    from shmtensor.ray import _agent
    gc.collect()  # the driver keeps no handle: named actors live on regardless
    job = ray.get_runtime_context().get_job_id()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        agents = _agent.live_agents()
        if len([a for a in agents if f"-{job}-" in a]) >= 2:
            break
        time.sleep(0.2)
    return {"agents": agents, "job": job}


@ray.remote
def keep_fetching(refs, started):
    """On B: read the array put on A (64 MiB from A's agent) again and again."""
    ray.get(started.signal.remote())
    while True:
        ray.get(refs[0])


@ray.remote(num_cpus=0)
class Signal:
    def __init__(self):
        self.count = 0

    def signal(self):
        self.count += 1

    def seen(self):
        return self.count


def case_abandon() -> dict:
    """The driver exits at once (no shutdown) while tasks on B fetch its array: what of
    the job is left is for the test to find (nothing)."""
    x = shmtensor.full(8 << 20, 1.0)
    refs = [ray.put(x)]
    started = Signal.options(**A).remote()
    tasks = [keep_fetching.options(**B).remote(refs, started) for _ in range(2)]
    deadline = time.monotonic() + 60
    while ray.get(started.seen.remote()) < len(tasks) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # a fetch under way
    print(json.dumps({"job": ray.get_runtime_context().get_job_id(),
                      "started": ray.get(started.seen.remote()), "tasks": len(tasks)}),
          flush=True)
    os._exit(0)


def case_listed() -> dict:
    """The agents alive, seen from a plain Ray driver (no shmtensor.ray.init)."""
    from shmtensor.ray import _agent
    return {"agents": _agent.live_agents()}


def main() -> int:
    case = sys.argv[1]
    init = ray.init if case == "listed" else sr.init
    init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    try:
        out = globals()[f"case_{case}"]()
    finally:
        ray.shutdown()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
