"""shmtensor.ray: shared arrays between Ray tasks and actors (the Ray issue).

One two-node Ray cluster on this machine for the whole module; the second node says it is
another host (``SHMTENSOR_RAY_HOST``), so arrays reach it by value.  CuPy cases need CuPy
and a GPU and are skipped elsewhere.
"""

from __future__ import annotations

import gc
import os
import sys
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="needs Ray: pip install 'shmtensor[ray]'")

from ray.cluster_utils import Cluster  # noqa: E402

import shmtensor  # noqa: E402
import shmtensor.ray as sr  # noqa: E402
from shmtensor.ipc import posix_shm  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

# Workers cannot import this module: its functions and classes travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

OTHER = "shmtensor-test-other-host"
HERE = {"resources": {"here": 0.01}, "num_cpus": 0}
THERE = {"resources": {"there": 0.01}, "num_cpus": 0}
DEADLINE = 20.0


def shm_names() -> set[str]:
    return {n for n in os.listdir(posix_shm.SHM_DIR) if n.startswith(posix_shm.PREFIX + "_")}


def poll(cond, what: str, timeout: float = DEADLINE):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster():
    before = shm_names()
    c = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, include_dashboard=False, object_store_memory=80 << 20,
        resources={"here": 1}))
    try:
        c.add_node(num_cpus=1, object_store_memory=80 << 20, resources={"there": 1},
                   env_vars={sr._host.ENV: OTHER})
        sr.init(address=c.address, namespace="shmtensor-tests")
        yield c
    finally:
        nodes = [c.head_node, *c.worker_nodes]
        ray.shutdown()
        c.shutdown()
        # Ray registers an atexit closure per node that keeps the node and its GCS client.
        # From Python 3.13 on, a child forked by multiprocessing clears the atexit registry
        # (popen_fork), which frees that client there and shuts gRPC down in the child: it
        # dies of SIGSEGV before running its target, and later tests that fork a producer
        # wait for it for good.  Drop the clients here, in the parent, where that is safe.
        for node in nodes:
            if node is not None and hasattr(node, "_gcs_client"):
                node._gcs_client = None
        from shmtensor.ray import _exports
        assert _exports.wait_released(DEADLINE), "exports still held after Ray shut down"

        def clean() -> bool:
            gc.collect()
            shmtensor.empty_cache()  # our own idle segments, unheld once the exports went
            return not (shm_names() - before)

        # every process of the cluster is gone: their janitors unlink what they left
        poll(clean, f"/dev/shm still has {sorted(shm_names() - before)} after Ray shut down")


@ray.remote
def add_one(a):
    a += 1
    return a


@ray.remote
def describe(a):
    import shmtensor
    import shmtensor.ray as sr
    return sr.host_id(), shmtensor.is_shared(a), bool(a.flags.writeable), float(a.sum())


@ray.remote
def make(n, value, strategy):
    import shmtensor
    shmtensor.set_sharing_strategy(strategy)
    a = shmtensor.empty(n)
    a[:] = value
    return a


@ray.remote
class Producer:
    def __init__(self, strategy):
        import shmtensor
        shmtensor.set_sharing_strategy(strategy)
        self.kept = []

    def fill(self, n, value, keep=True):
        import shmtensor
        a = shmtensor.full(n, value, dtype=np.float64)
        if keep:
            self.kept.append(a)
        return a

    def sums(self):
        return [float(a.sum()) for a in self.kept]

    def drop(self):
        import shmtensor
        self.kept.clear()
        gc.collect()
        shmtensor.empty_cache()

    def exports(self):
        import shmtensor.ray as sr
        return sr.exports_held()

    def pid(self):
        return os.getpid()


def test_task_argument_same_host_is_the_same_memory(cluster, strategy):
    a = shmtensor.zeros(1000)
    b = ray.get(add_one.options(**HERE).remote(a))
    assert (a == 1).all()                       # the task's write is ours
    assert np.shares_memory(a, b)               # and what it returned is our memory
    b += 1
    assert (a == 2).all()
    host, shared, writeable, total = ray.get(describe.options(**HERE).remote(a[::2]))
    assert (host, shared, writeable, total) == (sr.host_id(), True, True, 2 * 500)


def test_other_host_gets_a_correct_copy(cluster, strategy):
    a = shmtensor.zeros((100, 10), dtype=np.int32)
    a[:] = np.arange(1000, dtype=np.int32).reshape(100, 10)
    view = a[::3, 1::2]
    host, shared, writeable, total = ray.get(describe.options(**THERE).remote(view))
    assert host == OTHER and shared and writeable  # landed in shared memory over there
    assert total == float(view.sum())
    b = ray.get(add_one.options(**THERE).remote(view))
    assert (a == np.arange(1000).reshape(100, 10)).all()  # by value: ours untouched
    assert (b == view + 1).all() and b.flags.writeable and not np.shares_memory(a, b)
    assert shmtensor.is_shared(b)


@ray.remote
def echo_plus(a, k):
    """``a`` and a new array made from it here (for a task on another host: by value both
    ways, the second as a result carrying its bytes)."""
    import shmtensor
    b = shmtensor.empty(a.shape, a.dtype)
    b[...] = a + k
    return [shmtensor.is_shared(a), a.shape, float(a.sum()), b, b.T]


def test_empty_and_strided_arrays_cross_hosts(cluster):
    for a in (shmtensor.zeros(0), shmtensor.zeros((0, 3)),
              shmtensor.full((20, 30), 2.0)[::3, ::-2],  # strided, negative
              shmtensor.full((6, 4), 1.0, dtype=np.float32).T):  # Fortran order
        shared, shape, total, b, bt = ray.get(echo_plus.options(**THERE).remote(a, 1))
        assert tuple(shape) == a.shape and total == float(a.sum())
        assert shared is True or a.size == 0
        assert (b == a + 1).all() and (bt == (a + 1).T).all() and b.dtype == a.dtype
        assert b.flags.writeable and bt.flags.writeable


def test_made_on_another_host_arrives_by_value(cluster, strategy):
    b = ray.get(make.options(**THERE).remote(5000, 7.0, strategy))
    assert b.shape == (5000,) and (b == 7.0).all() and shmtensor.is_shared(b)


def test_actor_to_task_and_back_mutated_in_place(cluster, strategy):
    p = Producer.options(**HERE).remote(strategy)
    try:
        a = ray.get(p.fill.remote(250_000, 1.0))  # 2 MB, its own segment
        assert a.flags.writeable and shmtensor.is_shared(a)
        ref = p.fill.remote(300, 2.0)           # a slab array, left as a Ray reference
        ray.get(add_one.options(**HERE).remote(a))
        assert (a == 2.0).all()
        assert ray.get(p.sums.remote()) == [2.0 * 250_000, 2.0 * 300]
        ray.get(add_one.options(**HERE).remote(ref))  # an ObjectRef argument: resolved
        assert ray.get(p.sums.remote())[1] == 3.0 * 300
    finally:
        ray.kill(p)


def test_ray_put_get_and_plain_arrays(cluster, strategy):
    a = shmtensor.full(10_000, 3.0)
    ref = ray.put(a)
    b = ray.get(ref)
    assert np.shares_memory(a, b) and b.flags.writeable
    del a, b
    gc.collect()
    c = ray.get(ref)                            # the reference keeps the memory
    assert (c == 3.0).all()
    ro = shmtensor.full(100, 5)
    ro.flags.writeable = False
    got = ray.get(describe.options(**HERE).remote(ro))
    assert got[2] is False                      # read-only stays read-only
    plain = np.arange(1 << 18, dtype=np.float32)  # not shared: Ray's own path
    host, shared, writeable, total = ray.get(describe.options(**HERE).remote(plain))
    assert (shared, writeable, total) == (False, False, float(plain.sum()))
    assert (ray.get(ray.put(plain)) == plain).all()
    odd = np.arange(12.0).reshape(3, 4)[:, ::2]  # not contiguous, not shared
    assert (ray.get(ray.put(odd)) == odd).all()


def test_memory_outlives_the_sender_dropping_it(cluster, strategy):
    p = Producer.options(**HERE).remote(strategy)
    try:
        ref = p.fill.remote(200_000, 4.0, keep=False)  # the actor keeps nothing
        ray.wait([ref], timeout=DEADLINE)
        ray.get(p.drop.remote())                # its caches emptied: only the export holds
        assert ray.get(p.exports.remote()) == 1
        for _ in range(3):
            assert (ray.get(add_one.options(**HERE).remote(ref)) >= 5.0).all()
        del ref
        poll(lambda: ray.get(p.exports.remote()) == 0,
             "the actor still holds its export after every reference is gone")
    finally:
        ray.kill(p)


@pytest.mark.parametrize("callback", [True, False], ids=["callback", "polled"])
def test_export_released_when_references_go(cluster, callback, monkeypatch):
    from shmtensor.ray import _exports
    monkeypatch.setattr(_exports, "USE_CALLBACK", callback)
    monkeypatch.setattr(_exports, "GRACE", 0.1)
    before = sr.exports_held()
    a = shmtensor.full(1000, 1.0)
    refs = [ray.put(a), ray.put([a])]  # one segment, serialized twice: one export
    assert sr.exports_held() == before + 1
    del a
    time.sleep(0.3)  # past the grace: only Ray's references hold it now
    del refs[0]
    gc.collect()
    time.sleep(0.3)
    assert sr.exports_held() == before + 1  # the other object still holds it
    assert (ray.get(refs[0])[0] == 1.0).all()
    del refs
    poll(lambda: sr.exports_held() == before, "exports held after their references went")


def test_killed_actors_arrays_are_reclaimed(cluster):
    before = shm_names()
    p = Producer.options(**HERE).remote("file_system")
    pid = ray.get(p.pid.remote())
    held = ray.get(p.fill.remote(100_000, 1.0))
    refs = [p.fill.remote(100_000, 2.0) for _ in range(3)]
    ray.wait(refs, num_returns=len(refs), timeout=DEADLINE)
    mine = poll(lambda: {n for n in shm_names() - before if n.startswith(
        f"{posix_shm.PREFIX}_{pid}_")}, "the actor's named segments")
    ray.kill(p)
    poll(lambda: not os.path.exists(f"/proc/{pid}") or
         open(f"/proc/{pid}/stat").read().split()[2] == "Z", "the actor to die")
    assert (held == 1.0).all()                  # a view we hold survives its maker
    # what only Ray held is gone with it: Ray's error for an object whose owner died (the
    # sender owned the hold), not a RaySystemError wrapping shmtensor's
    with pytest.raises(ray.exceptions.OwnerDiedError, match=f"process {pid}") as e:
        ray.get(refs[0], timeout=DEADLINE)
    assert isinstance(e.value, sr.SenderGone)
    del held, refs
    gc.collect()
    poll(lambda: not (mine & shm_names()),
         f"{sorted(mine & shm_names())} left in /dev/shm after the actor was killed")


@ray.remote
def put_shared(n):
    import shmtensor
    return [ray.put(shmtensor.full(n, 1.0))]  # an ObjectRef in a list: handed back as is


def test_a_result_off_the_drivers_node_carries_its_bytes(cluster):
    """A task's shared result made on a node other than the driver's carries its bytes
    into that node's object store, as a plain array's would be (Ray keeps, moves, spills
    and reconstructs them); on the driver's node, and in a worker's put, only the handle."""
    from ray.experimental import get_object_locations
    n = 1 << 17  # 1 MiB
    there = [n["NodeID"] for n in ray.nodes() if n["Resources"].get("there")]
    ref = make.options(**THERE).remote(n, 2.0, "file_system")
    here = make.options(**HERE).remote(n, 3.0, "file_system")
    put = ray.get(put_shared.options(**THERE).remote(n))[0]
    ray.wait([ref, here, put], num_returns=3, timeout=DEADLINE, fetch_local=False)
    locs = get_object_locations([ref, here, put])
    assert locs[ref]["object_size"] > n * 8 and locs[ref]["node_ids"] == there
    assert locs[here]["object_size"] < 64 << 10
    assert locs[put]["object_size"] < 64 << 10
    b = ray.get(ref)
    assert (b == 2.0).all() and shmtensor.is_shared(b) and b.flags.writeable
    assert (ray.get(here) == 3.0).all() and (ray.get(put) == 1.0).all()


def test_carried_results_are_spilled_and_restored(cluster):
    """More results carried on the other node than its object store holds: Ray spills
    some to disk and restores them when read, as it does plain arrays."""
    from ray.experimental import get_object_locations
    n = 3 << 20  # 24 MiB each, 5 of them: the node's store holds 80 MiB
    refs = [make.options(**THERE).remote(n, float(i), "file_system") for i in range(5)]
    ray.wait(refs, num_returns=len(refs), timeout=60, fetch_local=False)
    spilled = poll(lambda: [i for i, loc in enumerate(get_object_locations(refs).values())
                            if loc.get("did_spill")], "nothing spilled", timeout=60)
    for i, ref in enumerate(refs):
        a = ray.get(ref, timeout=60)
        assert a.shape == (n,) and a[0] == i and a[-1] == i and shmtensor.is_shared(a)
        del a
    assert spilled  # and those came back from disk


class Probe:
    """Says, once rebuilt, whether shmtensor.ray judged its serialization a task's result."""

    def __init__(self, result=None):
        self.result = result

    def __reduce__(self):
        from shmtensor.ray import _exports
        return Probe, (_exports.is_result(),)


@ray.remote
def probe_result():
    return Probe()


@ray.remote
def probe_put():
    return [ray.put(Probe())]


@ray.remote
def probe_arg(p):
    return p.result


@ray.remote
def probe_nested():
    return ray.get(probe_arg.options(**HERE).remote(Probe()))


@ray.remote
def probe_generator():
    yield Probe()
    yield Probe()


@ray.remote
class Prober:
    def __init__(self, p=None):
        self.created_with = None if p is None else p.result

    def created(self):
        return self.created_with

    def result(self):
        return Probe()

    def arg(self, p):
        return p.result

    def put(self):
        return [ray.put(Probe())]

    def call(self, other):
        return ray.get(other.arg.remote(Probe()))

    def generator(self):
        yield Probe()

    def create(self):
        other = Prober.options(**THERE).remote(Probe())
        try:
            return ray.get(other.created.remote())
        finally:
            ray.kill(other)


@ray.remote
class AsyncProber:
    async def result(self):
        import asyncio
        await asyncio.sleep(0)
        return Probe()

    async def put(self):
        return [ray.put(Probe())]


def test_results_told_from_arguments_and_puts(cluster):
    """Only a task's result carries its bytes: each way Ray serializes something in a
    worker, as shmtensor.ray judges it."""
    g = ray.get
    assert g(probe_result.options(**THERE).remote()).result is True
    assert g(g(probe_put.options(**THERE).remote())[0]).result is False
    assert g(probe_nested.options(**THERE).remote()) is False  # a nested task's argument
    assert [g(r).result for r in probe_generator.options(**THERE).remote()] == [True, True]
    actors = [Prober.options(**THERE).remote(),
              Prober.options(**THERE, max_concurrency=2).remote()]  # threaded
    try:
        for a in actors:
            assert g(a.result.remote()).result is True
            assert g(g(a.put.remote())[0]).result is False
            assert [g(r).result for r in a.generator.remote()] == [True]
        assert g(actors[0].call.remote(actors[1])) is False  # an actor method's argument
        assert g(actors[0].create.remote()) is False  # an actor's creation argument
        aio = AsyncProber.options(**THERE).remote()
        actors.append(aio)
        assert g(aio.result.remote()).result is True
        assert g(g(aio.put.remote())[0]).result is False
    finally:
        for a in actors:
            ray.kill(a)


def test_sender_gone_is_a_clear_error():
    from shmtensor.ray import _host, _numpy
    h = _numpy.Handle(_host.host_id(), "node", 2 ** 22 + 1, 5, -1, "x", "file_system", 10,
                      "t", 1, 0, (1,), (8,), np.dtype(float), True)
    with pytest.raises(_host.SenderGone, match="exited"):
        _numpy.rebuild(h)


def _double(a):
    a *= 2
    return float(a.sum())


def test_pool_map_in_place(cluster):
    arrays = [shmtensor.full(1000, float(i)) for i in range(4)]
    with sr.Pool(1, ray_remote_args={"resources": {"here": 0.01}, "num_cpus": 0}) as pool:
        sums = pool.map(_double, arrays)
        assert pool.apply(_double, (arrays[1],)) == 4.0 * 1000
    assert sums == [2.0 * i * 1000 for i in range(4)]
    assert [float(a[0]) for a in arrays] == [0.0, 4.0, 4.0, 6.0]  # in place; [1] twice


def test_pool_rejects_bad_process_count():
    with pytest.raises(ValueError, match="at least 1"):
        sr.Pool(0)


def test_runtime_env_refuses_a_second_hook():
    with pytest.raises(ValueError, match="register"):
        sr.runtime_env({"worker_process_setup_hook": "mine.setup"})
    assert sr.runtime_env()["worker_process_setup_hook"] == sr.SETUP_HOOK


# --- CuPy --------------------------------------------------------------------------------

def _gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


GPU_ENV = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
cuda = pytest.mark.skipif(not _gpu(), reason="needs CuPy and a CUDA device")


@ray.remote
def cupy_add_one(a):
    import cupy
    assert isinstance(a, cupy.ndarray)
    a += 1
    cupy.cuda.get_current_stream().synchronize()
    return a


@pytest.mark.requires_cuda
@cuda
def test_cupy_same_host_is_the_same_device_memory(cluster):
    import cupy
    a = cupy.zeros(1 << 20, dtype=cupy.float32)
    b = ray.get(cupy_add_one.options(runtime_env=GPU_ENV, **HERE).remote(a))
    assert float(a.sum()) == float(1 << 20)     # the task's write is ours
    assert b.data.ptr == a.data.ptr
    b += 1
    assert float(a[0]) == 2.0


@pytest.mark.requires_cuda
@cuda
def test_cupy_other_host_gets_a_copy(cluster):
    import cupy
    a = cupy.arange(1000, dtype=cupy.float64)
    b = ray.get(cupy_add_one.options(runtime_env=GPU_ENV, **THERE).remote(a))
    assert (b == a + 1).all() and float(a[0]) == 0.0
