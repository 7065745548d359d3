"""Profile each stage of the CUDA relay (a diagnostic for bench_cuda; prints to stdout)."""
import cProfile
import io
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, "tests")


def stage(name, fn, *args):
    pr = cProfile.Profile()
    pr.enable()
    fn(*args)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    print(f"==== {name}\n{s.getvalue()[:3500]}", flush=True)


def p1(q1, e, n, mode):
    import cuda_helpers as ch
    stage("producer", ch.send_and_delete, q1, e, np.int64, n, 5, mode)


def p2(q1, q2, e, n, mode):
    import cuda_helpers as ch
    stage("forwarder", ch.receive_and_send, q1, q2, e, n, mode)


def p3(q2, q3, e, n, mode):
    import cuda_helpers as ch
    stage("summer", ch.receive_and_send_sum, q2, q3, e, np.int64, n, 5, mode)


if __name__ == "__main__":
    import shmtensor.multiprocessing as smp
    ctx = smp.get_context("spawn")
    n = 3000
    mode = sys.argv[1] if len(sys.argv) > 1 else "vmm"
    q1, q2, q3, e = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    ps = [ctx.Process(target=p1, args=(q1, e, n, mode)),
          ctx.Process(target=p2, args=(q1, q2, e, n, mode)),
          ctx.Process(target=p3, args=(q2, q3, e, n, mode))]
    t = time.perf_counter()
    for p in ps:
        p.start()
    r = q3.get(timeout=300)
    print("total", time.perf_counter() - t, int(r[0]) == n * (n - 1) // 2, flush=True)
    del r
    e.set()
    for p in ps:
        t = time.perf_counter()
        p.join(60)
        print(f"join {p.name}: {time.perf_counter() - t:.2f} s, exit code {p.exitcode}", flush=True)
