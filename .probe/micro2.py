import os, sys, time
sys.path.insert(0, os.getcwd())
N = 5000
def consumer(q, out):
    import cupy as cp, shmtensor.cuda
    shmtensor.cuda.set_allocator()
    cp.zeros(1)
    out.put("ready")
    t0 = None
    for i in range(N):
        x = q.get()
        if t0 is None: t0 = time.perf_counter()
        del x
    out.put(time.perf_counter() - t0)

def main():
    import cupy as cp, shmtensor.cuda, shmtensor.multiprocessing as smp
    from shmtensor import _queues, _reductions
    shmtensor.cuda.set_allocator()
    arrs = [cp.full([5], i, cp.int64) for i in range(N)]
    cp.cuda.Device().synchronize()
    t = time.perf_counter(); fr = [_queues.Frame(a) for a in arrs]; dt = time.perf_counter() - t
    print(f"Frame() distinct arrays, first send of each block: {dt/N*1e6:.1f} us"); del fr
    t = time.perf_counter(); fr = [_queues.Frame(a) for a in arrs]; dt = time.perf_counter() - t
    print(f"Frame() distinct arrays, again: {dt/N*1e6:.1f} us"); del fr
    import cProfile, pstats
    pr = cProfile.Profile(); pr.enable()
    fr = [_queues.Frame(a) for a in arrs[:2000]]
    pr.disable(); del fr; pstats.Stats(pr).sort_stats("tottime").print_stats(10)
    ctx = smp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(q, out)); p.start()
    assert out.get() == "ready"
    tf = 0.0
    t = time.perf_counter()
    for a in arrs:
        t1 = time.perf_counter(); q.put(a); tf += time.perf_counter() - t1
    tp = time.perf_counter() - t
    tc = out.get(); p.join()
    print(f"put to a live consumer: {tp/N*1e6:.1f} us/array; consumer get+del {tc/N*1e6:.1f} us/array", flush=True)
    del arrs

if __name__ == "__main__":
    main()
