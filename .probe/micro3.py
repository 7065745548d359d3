import os, sys, time
sys.path.insert(0, os.getcwd())
N = 5000
def patch(variant):
    from shmtensor.cuda import _ipc
    if "noorder" in variant:
        _ipc._order = lambda cp, h: None
    if "nowait" in variant:
        _ipc.wait_event = lambda cp, h: None
def consumer(q, out, variant):
    import cupy as cp, shmtensor.cuda
    patch(variant)
    shmtensor.cuda.set_allocator()
    cp.zeros(1)
    out.put("ready")
    t0 = None
    tl = 0.0
    for i in range(N):
        t1 = time.perf_counter()
        x = q.get()
        if t0 is None: t0 = time.perf_counter()
        else: tl += time.perf_counter() - t1
        del x
    out.put((time.perf_counter() - t0, tl))

def main(variant):
    import cupy as cp, numpy as np, shmtensor, shmtensor.cuda, shmtensor.multiprocessing as smp
    patch(variant)
    shmtensor.cuda.set_allocator()
    if variant == "cpu":
        arrs = [shmtensor.full([5], i, np.int64) for i in range(N)]
    else:
        arrs = [cp.full([5], i, cp.int64) for i in range(N)]
    cp.cuda.Device().synchronize()
    ctx = smp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(q, out, variant)); p.start()
    assert out.get() == "ready"
    t = time.perf_counter()
    busy = "busy" in variant
    for a in arrs:
        if busy:
            a += 0
        q.put(a)
    tp = time.perf_counter() - t
    tc, tl = out.get(); p.join()
    print(f"{variant:16s} put {tp/N*1e6:.1f} us/array; consumer get+del {tc/N*1e6:.1f} us/array (in get {tl/N*1e6:.1f})", flush=True)
    del arrs

if __name__ == "__main__":
    main(sys.argv[1])
