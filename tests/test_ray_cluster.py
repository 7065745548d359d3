"""shmtensor.ray across real hosts: a two-host Ray cluster built by the test itself.

Two namespace "hosts" (network, mount, UTS and pid namespaces, private /dev/shm; a veth
pair, 10.200.0.1 and .2: see ray_cluster.py), a Ray head in A and a worker node in B, one
cluster for the module.  The drivers (ray_cluster_driver.py) run in host A and report in
JSON.  Host B is killed by the last test.  Needs root, ``ip`` and ``unshare``; skipped
elsewhere with the reason.
"""

from __future__ import annotations

import json
import os
import time

import pytest

pytest.importorskip("ray", reason="needs Ray: pip install 'shmtensor[ray]'")

import ray_cluster  # noqa: E402

from shmtensor.ipc import posix_shm  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_cluster_driver.py")
PREFIX = posix_shm.PREFIX + "_"


def shm_names() -> set[str]:
    return {n for n in os.listdir(posix_shm.SHM_DIR) if n.startswith(PREFIX)}


@pytest.fixture(scope="module")
def cluster():
    why = ray_cluster.unavailable()
    if why:
        pytest.skip(f"a two-host cluster cannot be built here: {why}")
    before = shm_names()
    c = ray_cluster.TwoHosts(cpus=1, store_mb=200)
    c.start()
    try:
        yield c
    finally:
        c.stop()
        assert not c.leftovers(), f"left after teardown: {c.leftovers()}"
        assert not (shm_names() - before), "the hosts' memory reached this machine's /dev/shm"


def no_shm_left(c, host) -> list[str]:
    """Poll until ``host``'s /dev/shm has no shmtensor name (drivers and their workers
    done: janitors and the last releases run a moment later); what is left."""
    deadline = time.monotonic() + 20
    while True:
        left = c.shm(host, PREFIX)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_same_host_is_zero_copy_and_writable(cluster):
    r = cluster.driver(DRIVER, "same")
    assert r == {"task_wrote_ours": True, "shares": True, "writeable": True,
                 "actor_sees_our_write": True, "returned_shared": True, "host": True,
                 "view": [True, True, 500.0]}


def test_other_host_gets_the_values(cluster):
    r = cluster.driver(DRIVER, "other")
    assert all(r.values()), r


def test_pool_on_both_hosts(cluster):
    r = cluster.driver(DRIVER, "pool")
    assert r["a"] == {"values": [0.0, 2.0, 4.0, 6.0], "in_place": [0.0, 2.0, 4.0, 6.0]}
    # host B got copies: the doubled copies come back, ours (doubled by A) stay
    assert r["b"] == {"values": [0.0, 4.0, 8.0, 12.0], "in_place": [0.0, 2.0, 4.0, 6.0]}


def test_agents_belong_to_the_job(cluster):
    r = cluster.driver(DRIVER, "agents")
    mine = [a for a in r["agents"] if f"-{r['job']}-" in a]
    assert len(mine) == 2, r  # one per node, started by shmtensor.ray.init
    deadline = time.monotonic() + 30
    while True:  # the job ended: its agents end with it
        left = cluster.driver(DRIVER, "listed")["agents"]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert left == []


def test_a_job_that_ends_mid_fetch_leaves_nothing(cluster):
    """The driver exits (no shutdown) while tasks on B fetch its array from A's agent:
    the job's agents, workers and memory go with it."""
    r = cluster.driver(DRIVER, "abandon")
    assert r["started"] == r["tasks"], r
    deadline = time.monotonic() + 30
    while True:
        left = [a for a in cluster.driver(DRIVER, "listed")["agents"] if f"-{r['job']}-" in a]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert left == []
    assert no_shm_left(cluster, cluster.a) == []
    assert no_shm_left(cluster, cluster.b) == []


def test_nothing_left_in_either_hosts_shm(cluster):
    assert no_shm_left(cluster, cluster.a) == []
    assert no_shm_left(cluster, cluster.b) == []


def test_worker_host_dies(cluster):
    """Arrays made on host B, B killed before the driver on A reads them: shmtensor
    recovers where plain Ray recovers (a re-run task, a prefetched copy), raises Ray's
    ObjectLostError where it raises, OwnerDiedError for an object whose owner died with B;
    never a RaySystemError."""
    p = cluster.driver_popen(DRIVER, "death")
    try:
        ready = json.loads(p.stdout.readline() or "{}")
        assert ready.get("ready"), p.stderr.read()[-5000:] if p.poll() is not None else ready
        cluster.kill_worker_host()
        out, err = p.communicate("go\n", timeout=180)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=30)
    assert p.returncode == 0, err[-6000:]
    r = json.loads(out.strip().splitlines()[-1])
    outcomes = r["outcomes"]
    for case in ("task retried", "task no retry", "actor", "prefetched", "actor prefetched",
                 "owner died"):
        plain, shm = outcomes[f"plain/{case}"], outcomes[f"shm/{case}"]
        if plain["result"] == "error":
            assert "ObjectLostError" in plain["classes"], plain  # the baseline: Ray's own
        assert shm["result"] in ("data", "error"), (case, shm)
        if shm["result"] == "error":
            assert "ObjectLostError" in shm["classes"], (case, shm)
            assert "RaySystemError" not in shm["classes"], (case, shm)
            assert "Agent" not in shm["message"], (case, shm)
        assert shm["result"] == plain["result"], (case, plain, shm)  # recovered as Ray
    # lineage reconstruction: the task re-ran on host A
    assert outcomes["shm/task retried"]["result"] == "data", outcomes["shm/task retried"]
    # Ray's prefetch copied the bytes the result carried: a writable shared array here
    assert outcomes["shm/prefetched"]["result"] == "data", outcomes["shm/prefetched"]
    assert outcomes["shm/prefetched"]["is_shared"] is True
    assert outcomes["shm/actor prefetched"]["result"] == "data"
    # the owner of an object died with its node: Ray's OwnerDiedError, for both
    assert "OwnerDiedError" in outcomes["shm/owner died"]["classes"], outcomes
    assert r["exports_left"] == 0  # the receiver on B died: our export was let go
    assert no_shm_left(cluster, cluster.a) == []
