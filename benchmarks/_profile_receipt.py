"""What a consumer pays to receive one small array, frames already queued: a shared 1 KB
array's one-array message against the stdlib's 1 KB pickle.

``python -m benchmarks._profile_receipt [ROUNDS]``: a spawned producer sends a batch of
frames and waits; the parent waits until they are there, then times reading, loading and
dropping each (no producer running meanwhile), and acknowledges.  Prints the best and the
median batch, per get, for both, twice, in turn.
"""

from __future__ import annotations

import multiprocessing
import pickle
import sys
import time

import numpy as np

import shmtensor as st
import shmtensor.multiprocessing as smp
from shmtensor import _reductions

from ._harness import check_exit_codes, stop_processes

BATCH = 50  # the stdlib's 1 KB frames of one batch fit in a pipe's 64 KiB
TIMEOUT = 60.0


def produce_shared(conn, ack, rounds: int) -> None:
    a = st.zeros(128)
    for _ in range(rounds):
        for _ in range(BATCH):
            data, ctx = _reductions.dumps(a)
            try:
                conn.send_frame(data, ctx.wire_fds())
            finally:
                ctx.release()
        ack.recv()


def produce_plain(conn, ack, rounds: int) -> None:
    a = np.ones(128)
    for _ in range(rounds):
        for _ in range(BATCH):
            conn.send_bytes(pickle.dumps(a, pickle.HIGHEST_PROTOCOL))
        ack.recv()


def _settle_batch(r) -> None:
    """Wait for the batch's first frame, then a moment for the rest (the producer sends a
    batch in well under a millisecond)."""
    if not r.poll(TIMEOUT):
        raise TimeoutError("the producer sent nothing")
    time.sleep(0.01)


def session(shared: bool, rounds: int) -> list[float]:
    ctx = smp.get_context("spawn") if shared else multiprocessing.get_context("spawn")
    r, w = ctx.Pipe(duplex=False)
    ack_r, ack_w = multiprocessing.Pipe(duplex=False)
    p = ctx.Process(target=produce_shared if shared else produce_plain, args=(w, ack_r, rounds))
    p.start()
    per_get = []
    try:
        for _ in range(rounds):
            _settle_batch(r)
            t0 = time.perf_counter()
            if shared:
                for _ in range(BATCH):
                    data, fds = r.recv_frame()
                    x = _reductions.loads(data, fds)
                    del x
            else:
                for _ in range(BATCH):
                    x = pickle.loads(r.recv_bytes())
                    del x
            per_get.append((time.perf_counter() - t0) / BATCH)
            ack_w.send(None)
    finally:
        stop_processes([p])
    check_exit_codes([p], "receipt producer")
    return sorted(per_get)


def main(rounds: int) -> None:
    for shared in (False, True, False, True):
        t = session(shared, rounds)
        label = "shmtensor, shared 1 KB (one-array message)" if shared else "stdlib, 1 KB pickle"
        print(f"{label:<44} best {t[0] * 1e6:6.2f} us, median {t[len(t) // 2] * 1e6:6.2f} us "
              "per get")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
