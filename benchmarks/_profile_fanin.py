"""CPU per array on each side of a queue: shmtensor's shared 1 MB against the stdlib's 1 KB
plain.  ``python -m benchmarks._profile_fanin [N] [--cprofile]``: one spawned producer puts
N arrays; the parent takes them; both report their CPU time (user + system) per array, and
with ``--cprofile`` the consumer's top functions."""

from __future__ import annotations

import cProfile
import multiprocessing
import pstats
import resource
import sys

import numpy as np

import shmtensor as st
import shmtensor.multiprocessing as smp


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def produce(shared: bool, n: int, q, out) -> None:
    a = st.zeros(1 << 17) if shared else np.ones(128)
    q.put(a)
    c0 = cpu()
    for _ in range(n):
        q.put(a)
    q.put(None)
    q.close()
    q.join_thread()
    out.put((cpu() - c0) / n)


def main(n: int, profile: bool) -> None:
    for shared in (False, True):
        ctx = smp.get_context("spawn") if shared else multiprocessing.get_context("spawn")
        q, out = ctx.Queue(64), ctx.SimpleQueue()
        p = ctx.Process(target=produce, args=(shared, n, q, out))
        p.start()
        q.get()
        prof = cProfile.Profile() if profile else None
        c0 = cpu()
        if prof:
            prof.enable()
        while q.get() is not None:
            pass
        if prof:
            prof.disable()
        consumer = (cpu() - c0) / n
        producer = out.get()
        p.join(30)
        print(f"{'shmtensor shared 1 MB' if shared else 'stdlib 1 KB plain':<22} CPU per array:"
              f" producer {producer * 1e6:6.1f} us, consumer {consumer * 1e6:6.1f} us")
        if prof:
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 20000,
         "--cprofile" in sys.argv)
