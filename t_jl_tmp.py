import time, numpy as np
from joblib import Parallel, delayed
from benchmarks._peers import total
def scale(a):
    a *= 2
    return a
if __name__ == "__main__":
    arrs = [np.full(4<<20, 1.0) for _ in range(32)]
    Parallel(n_jobs=2, backend="loky")(delayed(total)(a) for a in [np.ones(10)]*2)
    for mode in ("r+", "c"):
      for i in range(3):
        t=time.perf_counter(); r=Parallel(n_jobs=2, backend="loky", mmap_mode=mode)(delayed(scale)(a) for a in arrs); print(mode, time.perf_counter()-t, type(r[0]), r[0][0]); del r
