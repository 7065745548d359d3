"""Per-stage wall and CPU time per array of the CUDA relay (a diagnostic for bench_cuda).

``python3 -m benchmarks._profile_relay_stages [--timers | --cprofile] MODE...`` on the GPU
machine, MODE "ipc" (CuPy's pool, legacy IPC) or "vmm" (shmtensor.cuda.set_allocator()).
Each stage reports its own time per array from its ``N0``-th array to its ``N``-th; the
forwarder also splits its loop into get, copy and put.  With ``--timers`` it wraps the
library calls on its path in timers (each adds about 1 us to what it wraps) and prints
them; with ``--cprofile`` it runs its steady part under cProfile and prints the functions
with the most time of their own, per array (cProfile slows Python calls more than C ones:
read the counts and the order, not the sum).
"""
from __future__ import annotations

import collections
import resource
import sys
import time

N, N0 = 10_000, 1_000
TIMED = [("shmtensor._reductions", "dumps"), ("shmtensor._reductions", "loads"),
         ("shmtensor.cuda._ipc", "_export"), ("shmtensor.cuda._vmm", "lane_dumps"),
         ("shmtensor.cuda._vmm", "lane_loads"), ("shmtensor.cuda._events", "order"),
         ("shmtensor.cuda._events", "order_now"), ("shmtensor.cuda._events", "stream_wait"),
         ("shmtensor.ipc.ofd_lease", "inflight_fd"), ("shmtensor.ipc.ofd_lease", "hold"),
         ("shmtensor.ipc.scm_rights", "try_send_frame"),
         ("shmtensor.cuda._release", "poll"), ("shmtensor.cuda._release", "drain"),
         ("shmtensor.cuda._vmm", "malloc")]


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _sys() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def _use(mode: str) -> None:
    if mode == "vmm":
        import shmtensor.cuda
        shmtensor.cuda.set_allocator()


def _timers() -> tuple[dict, collections.Counter]:
    """Wrap the calls of ``TIMED`` in timers (before the allocator is set, so that CuPy
    calls the wrapped ``malloc``)."""
    import importlib
    spent: dict = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    for module, name in TIMED:
        mod = importlib.import_module(module)
        real = getattr(mod, name)

        def timed(*args, _real=real, _name=name, **kwargs):
            t = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                spent[_name] += time.perf_counter() - t
                calls[_name] += 1
        setattr(mod, name, timed)
    return spent, calls


def send(q, out, e, mode):
    import cupy as cp
    _use(mode)
    for i in range(N):
        if i == N0:
            t, c = time.perf_counter(), _cpu()
        q.put(cp.full([5], i, dtype=cp.int64))
    out.put(("producer", (time.perf_counter() - t) / (N - N0), (_cpu() - c) / (N - N0), ""))
    e.wait(600)


def _cprofile_text(prof, n: int, top: int = 40) -> str:
    import pstats
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    text = ""
    for (file, line, name), (cc, nc, tt, ct, _) in rows:
        where = f"{file.rsplit('/', 2)[-1]}:{line}" if line else file
        text += (f"\n    {tt / n * 1e6:6.2f} us own {ct / n * 1e6:6.2f} us cum "
                 f"{nc / n:5.2f} calls  {name} ({where})")
    return text


def forward(q1, q2, out, e, mode, timers):
    import shmtensor
    prof = None
    if timers == "cprofile":
        import cProfile
        prof, timers = cProfile.Profile(), False
    spent, calls = _timers() if timers else ({}, collections.Counter())
    _use(mode)
    split = [0.0, 0.0, 0.0]
    for i in range(N):
        if i == N0:
            t, c, k = time.perf_counter(), _cpu(), _sys()
            split = [0.0, 0.0, 0.0]
            spent.clear()
            calls.clear()
            if prof is not None:
                prof.enable()
        a = time.perf_counter()
        x = q1.get()
        b = time.perf_counter()
        y = x.copy()
        del x
        m = time.perf_counter()
        q2.put(y)
        del y
        split[0] += b - a
        split[1] += m - b
        split[2] += time.perf_counter() - m
    if prof is not None:
        prof.disable()
    n = N - N0
    info = shmtensor.debug_info()
    text = (f"(system {(_sys() - k) / n * 1e6:.0f} us) "
            f"get {split[0] / n * 1e6:.0f} copy {split[1] / n * 1e6:.0f} put "
            f"{split[2] / n * 1e6:.0f} us; handles open {info.get('cuda_opened')}, "
            f"chunks exported {info.get('cuda_exports')}")
    for name, s in sorted(spent.items(), key=lambda kv: -kv[1]):
        text += f"\n    {name:<16} {s / n * 1e6:6.1f} us/array in {calls[name] / n:.2f} calls"
    if prof is not None:
        text += _cprofile_text(prof, n)
    out.put(("forwarder", (time.perf_counter() - t) / n, (_cpu() - c) / n, text))
    e.wait(600)


def total(q2, out, e, mode):
    import cupy as cp
    _use(mode)
    s = cp.zeros([5], dtype=cp.int64)
    for i in range(N):
        if i == N0:
            t, c = time.perf_counter(), _cpu()
        s += q2.get()
    right = int(s[0]) == N * (N - 1) // 2
    out.put(("summer", (time.perf_counter() - t) / (N - N0), (_cpu() - c) / (N - N0),
             "sum right" if right else "SUM WRONG"))
    e.wait(600)


def main(modes: list[str], timers: bool | str) -> None:
    import shmtensor.multiprocessing as smp
    ctx = smp.get_context("spawn")
    for mode in modes:
        q1, q2, out, e = ctx.Queue(), ctx.Queue(), ctx.SimpleQueue(), ctx.Event()
        procs = [ctx.Process(target=send, args=(q1, out, e, mode)),
                 ctx.Process(target=forward, args=(q1, q2, out, e, mode, timers)),
                 ctx.Process(target=total, args=(q2, out, e, mode))]
        for p in procs:
            p.start()
        for _ in procs:
            stage, wall, cpu, text = out.get()
            print(f"{mode} {stage:<9} wall {wall * 1e6:4.0f} us, CPU {cpu * 1e6:4.0f} us per array"
                  f"  {text}", flush=True)
        e.set()
        for p in procs:
            p.join(60)
            if p.exitcode != 0:
                print(f"{p.name} exited with {p.exitcode}", flush=True)


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if not a.startswith("-")] or ["ipc", "vmm"],
         "cprofile" if "--cprofile" in sys.argv else "--timers" in sys.argv)
