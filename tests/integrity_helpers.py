"""Process targets and message generators for tests/test_integrity.py (importable by
spawned children)."""

import os
import resource
import threading

import numpy as np

import shmtensor

DTYPES = [np.uint8, np.int16, np.int32, np.int64, np.float32, np.float64, np.complex64,
          np.bool_, ">i4", [("a", "<i4"), ("b", "<f8")]]
# Size classes of an array's bytes: 0 B, small, medium (slab), large (own segment).
SIZES = [(0, 1), (1, 2048), (2048, 300_000), (300_000, 4 << 20)]
SIZE_P = [0.05, 0.6, 0.3, 0.05]


def _array(rng: np.random.Generator) -> np.ndarray:
    dt = np.dtype(DTYPES[rng.integers(len(DTYPES))])
    lo, hi = SIZES[rng.choice(len(SIZES), p=SIZE_P)]
    n = int(rng.integers(lo, hi)) // dt.itemsize
    raw = np.frombuffer(rng.bytes(n * dt.itemsize), np.uint8)
    if dt == np.bool_:
        raw = raw & 1
    a = raw.view(dt)
    if n >= 12 and rng.random() < 0.5:
        a = a[: n - n % 6].reshape(-1, 2, 3) if rng.random() < 0.5 else a[: n - n % 4].reshape(-1, 4)
    if rng.random() < 0.5:
        a = shmtensor.share_memory(a)  # born shared: crosses as a handle
    else:
        a = a.copy()
    r = rng.random()
    if a.ndim >= 2 and r < 0.15:
        a = a.T
    elif a.size > 2 and r < 0.3:
        a = a[1::2]
    elif a.size > 2 and r < 0.4:
        a = a[::-1]
    if rng.random() < 0.1:
        a.flags.writeable = False
    return a


def _node(rng: np.random.Generator, depth: int):
    r = rng.random()
    if depth >= 2 or r < 0.5:
        return _array(rng)
    n = int(rng.integers(0, 4))
    if r < 0.7:
        return tuple(_node(rng, depth + 1) for _ in range(n))
    if r < 0.85:
        return [_node(rng, depth + 1) for _ in range(n)]
    return {f"k{i}": _node(rng, depth + 1) for i in range(n)}


def make_message(seed: int):
    """A random nested message of arrays (dtypes, shapes, views, shared and plain, 0 B to
    4 MB), the same for the same seed in any process."""
    return _node(np.random.default_rng(seed), 0)


def mismatch(got, want, path="msg") -> str | None:
    """Where ``got`` differs from ``want`` (type, dtype, shape, bytes, read-only), or None."""
    if isinstance(want, np.ndarray):
        if not isinstance(got, np.ndarray):
            return f"{path}: {type(got).__name__} instead of an array"
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{path}: {got.dtype}{got.shape} instead of {want.dtype}{want.shape}"
        if got.tobytes() != want.tobytes():
            return f"{path}: different bytes"
        if got.flags.writeable != want.flags.writeable:
            return f"{path}: writeable {got.flags.writeable} instead of {want.flags.writeable}"
        return None
    if type(got) is not type(want) or len(got) != len(want):
        return f"{path}: {type(got).__name__} of {len(got)} instead of {len(want)}"
    if isinstance(want, dict):
        if got.keys() != want.keys():
            return f"{path}: keys {sorted(got)} instead of {sorted(want)}"
        pairs = [(got[k], want[k], f"{path}[{k!r}]") for k in want]
    else:
        pairs = [(g, w, f"{path}[{i}]") for i, (g, w) in enumerate(zip(got, want))]
    for g, w, p in pairs:
        m = mismatch(g, w, p)
        if m:
            return m
    return None


def _put_from_threads(q, threads: int, run) -> None:
    """``run(t)`` in ``threads`` threads at once, then flush ``q`` and close it."""
    ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    q.close()
    q.join_thread()


def stress_produce(q, threads: int, per_thread: int, base_seed: int) -> None:
    """``threads`` threads each put ``per_thread`` random messages ``(t, i, message)``
    (seed ``base_seed + t * per_thread + i``), then ``(t, None, None)``."""
    def run(t):
        for i in range(per_thread):
            q.put((t, i, make_message(base_seed + t * per_thread + i)))
        q.put((t, None, None))

    _put_from_threads(q, threads, run)


def put_full_arrays(q, threads: int, per_thread: int, size: int) -> None:
    """The issue's reproduction: each thread puts ``(v, np.full(size, v))``."""
    def run(t):
        for i in range(per_thread):
            v = t * per_thread + i
            q.put((v, np.full(size, v, dtype=np.int64)))

    _put_from_threads(q, threads, run)


def limit_fds(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def nfds() -> int:
    return len(os.listdir("/proc/self/fd"))


def produce_under_limit(q, out, n: int, size: int, limit: int, shared: bool) -> None:
    """Put ``n`` arrays of ``size`` int64 (value i) under ``ulimit -n limit``; report the
    fds this process has open once everything is sent."""
    limit_fds(limit)
    for i in range(n):
        a = shmtensor.full((size,), i, dtype=np.int64) if shared else np.full(size, i, np.int64)
        q.put(a)
    q.close()
    q.join_thread()
    out.put(("producer", nfds()))


def keep_under_limit(q, out, n: int, limit: int, done) -> None:
    """Receive ``n`` arrays under ``ulimit -n limit`` and keep them all; report whether
    each holds its index, and the fds open while all are alive; wait for ``done``."""
    limit_fds(limit)
    kept = [q.get(timeout=120) for _ in range(n)]
    ok = all(int(k[0]) == i and int(k[-1]) == i for i, k in enumerate(kept))
    out.put(("consumer", ok, len(kept), nfds()))
    done.wait(120)


def hold_many_under_limit(out, n: int, limit: int, strategy: str) -> None:
    """``n`` shared arrays alive at once in one process under ``ulimit -n limit``."""
    limit_fds(limit)
    shmtensor.set_sharing_strategy(strategy)
    arrays = [shmtensor.full((256,), i) for i in range(n)]
    ok = all(a[0] == i and a[-1] == i for i, a in enumerate(arrays))
    out.put((ok, nfds()))


def _result(i):
    return np.full(100_000 // 8, i, dtype=np.int64)


def pool_map_under_limit(out, n: int, limit: int, method: str) -> None:
    """``Pool(2).map`` returning ``n`` arrays of 100 KB under ``ulimit -n limit``."""
    import shmtensor.multiprocessing as smp
    limit_fds(limit)
    with smp.get_context(method).Pool(2) as pool:
        res = pool.map(_result, range(n))
        ok = len(res) == n and all(int(r[0]) == i and int(r[-1]) == i for i, r in enumerate(res))
        out.put((ok, nfds()))
