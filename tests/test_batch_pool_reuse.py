"""A BatchPool slot dropped in its own process is free again: settling a pinned segment
must not spin (it did, forever, when the settle loop kept it as the one to settle)."""

import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import gc, numpy as np, shmtensor
    pool = shmtensor.BatchPool((4, 16), np.float32, slots=2)
    for i in range(20):                       # 10x more batches than slots
        batch = pool.acquire(timeout=10)
        batch[...] = i
        del batch
        gc.collect()
    print("ok", shmtensor.debug_info()["segments_own_live"] >= 0)
""")


def test_batch_pool_slots_come_back_in_their_own_process():
    r = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok True", r.stdout + r.stderr
