import os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "tests")
import numpy as np

N = 10000

def consumer(q, out, mode):
    import cupy as cp
    import shmtensor.cuda
    from shmtensor import _reductions
    if mode == "vmm": shmtensor.cuda.set_allocator()
    cp.zeros(1); s = cp.zeros(5, cp.int64); s += s
    x = q.get(); del x
    out.put("ready")
    x = q.get(); del x
    tr = tl = td = tc = 0.0
    t0 = time.perf_counter()
    for _ in range(N - 1):
        a = time.perf_counter()
        with q._rlock:
            data, fds = q._reader.recv_frame()
        q._sem.release()
        b = time.perf_counter()
        x = _reductions.loads(data, fds)
        c = time.perf_counter()
        y = x.copy()
        d = time.perf_counter()
        del x, y
        e = time.perf_counter()
        tr += b - a; tl += c - b; tc += d - c; td += e - d
    total = time.perf_counter() - t0
    out.put((total, tr, tl, tc, td))

def main(mode):
    import cupy as cp
    import shmtensor.cuda, shmtensor.multiprocessing as smp
    if mode == "vmm": shmtensor.cuda.set_allocator()
    ctx = smp.get_context("spawn")
    t = time.perf_counter(); arrs = [cp.full([5], i, cp.int64) for i in range(N)]; cp.cuda.Device().synchronize()
    print(f"[{mode}] cp.full x{N}: {(time.perf_counter()-t)/N*1e6:.1f} us each")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(q, out, mode)); p.start()
    q.put(arrs[0]); assert out.get() == "ready"
    from shmtensor import _queues
    tf = 0.0
    t = time.perf_counter()
    for a in arrs[1:]:
        t1 = time.perf_counter()
        f = _queues.Frame(a)
        tf += time.perf_counter() - t1
        del f
        q.put(a)
    tp = time.perf_counter() - t
    print(f"[{mode}] of which Frame(): {tf/(N-1)*1e6:.1f} us", flush=True)
    total, tr, tl, tc, td = out.get()
    p.join()
    n = N - 1
    print(f"[{mode}] producer put: {tp/n*1e6:.1f} us/array; consumer total {total/n*1e6:.1f} us/array: "
          f"recv {tr/n*1e6:.1f}, loads {tl/n*1e6:.1f}, copy {tc/n*1e6:.1f}, del {td/n*1e6:.1f}", flush=True)
    # in-process costs
    from shmtensor import _reductions
    x = arrs[5]
    t = time.perf_counter()
    for _ in range(N):
        data, c = _reductions.dumps(x); fds = c.wire_fds(); c.release()
    print(f"[{mode}] dumps+wire_fds+release: {(time.perf_counter()-t)/N*1e6:.1f} us")
    t = time.perf_counter()
    for _ in range(N):
        fd = os.open(f"/proc/self/fd/{q._reader.fileno()}", os.O_RDWR) if False else os.dup(0); os.close(fd)
    print(f"dup+close: {(time.perf_counter()-t)/N*1e6:.2f} us")
    from ipc import ofd_lease
    tbl = ofd_lease.own_table()
    t = time.perf_counter()
    for _ in range(N):
        fd = ofd_lease.inflight_fd(tbl.id, [3]); os.close(fd)
    print(f"inflight_fd+close: {(time.perf_counter()-t)/N*1e6:.2f} us")
    t = time.perf_counter()
    for _ in range(N):
        with cp.cuda.Device(0): pass
    print(f"Device ctx: {(time.perf_counter()-t)/N*1e6:.2f} us")
    t = time.perf_counter()
    for _ in range(N):
        m = shmtensor.cuda.malloc(40); del m
    print(f"shmtensor.cuda.malloc+free: {(time.perf_counter()-t)/N*1e6:.2f} us")
    pool = cp.get_default_memory_pool()
    t = time.perf_counter()
    for _ in range(N):
        m = pool.malloc(40); del m
    print(f"cupy pool malloc+free: {(time.perf_counter()-t)/N*1e6:.2f} us")
    y = arrs[3]
    t = time.perf_counter()
    for _ in range(N):
        z = y.copy(); del z
    print(f"copy+del in-process: {(time.perf_counter()-t)/N*1e6:.2f} us")
    import cProfile, pstats
    pr = cProfile.Profile(); pr.enable()
    for _ in range(2000):
        m = shmtensor.cuda.malloc(40); del m
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(8)
    del arrs

if __name__ == "__main__":
    main(sys.argv[1])
