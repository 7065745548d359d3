"""GPU part of scripts/bench (run on a CUDA machine): shmtensor beside torch.multiprocessing.

1. The seed's send_many: N small arrays relayed through three processes (producer ->
   forwarder that copies -> summer); per-array time past start-up: the summer's own time
   from its N0-th array to its N-th, / (N - N0), median of REPEATS relays, run in rounds
   (each round runs every contender once, so a drift in the machine's speed hits all alike).
2. A 1 GiB array sent again and again once its allocation is open: time per get().

Usage: python -m benchmarks.bench_cuda [--json FILE] (scripts/gpu_check runs it; scripts/bench
includes it as its "cuda" section where a GPU is visible).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

from . import _report
from ._report import Section

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))  # the CUDA test helpers are the relay's stages

N, N0, SIZE = 10_000, 1_000, 5
REPEATS = 7


def _relay(ctx, targets, count: int) -> dict:
    """One relay of ``count`` arrays: wall time from starting the three stages to the summed
    result (checked), and the summer's own time from its N0-th array to its last."""
    q1, q2, q3 = ctx.Queue(), ctx.Queue(), ctx.Queue()
    e = ctx.Event()
    send, forward, total = targets
    procs = [ctx.Process(target=send, args=(q1, e, count)),
             ctx.Process(target=forward, args=(q1, q2, e, count)),
             ctx.Process(target=total, args=(q2, q3, e, count))]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    result, steady_s = q3.get(timeout=600)
    wall = time.perf_counter() - t0
    assert int(result[0]) == count * (count - 1) // 2
    del result
    e.set()
    for p in procs:
        p.join(60)
    return {"wall_s": wall, "per_array_s": steady_s / (count - N0)}


def _summary(runs: list[dict]) -> dict:
    """The median of a contender's relays (per array past the first N0)."""
    runs = sorted(runs, key=lambda r: r["per_array_s"])
    mid = runs[len(runs) // 2]
    return {"per_array_s": mid["per_array_s"], "wall_s": mid["wall_s"],
            "runs_per_array_s": [r["per_array_s"] for r in runs]}


def _timed_sum(q2, q3, e, count, make_zeros):
    """The last stage: sum what arrives; time from the N0-th array to the last."""
    s = make_zeros()
    t = None
    for i in range(count):
        if i == N0:
            t = time.perf_counter()
        s += q2.get()
    q3.put((s, time.perf_counter() - t))
    e.wait(600)


def _shm_send(q, e, count, mode):
    import numpy as np
    import cuda_helpers as ch
    ch.send_and_delete(q, e, np.int64, count, SIZE, mode)


def _shm_forward(q1, q2, e, count, mode):
    import cuda_helpers as ch
    ch.receive_and_send(q1, q2, e, count, mode)


def _shm_sum(q2, q3, e, count, mode):
    import cupy as cp
    import cuda_helpers as ch
    ch.use(mode)
    _timed_sum(q2, q3, e, count, lambda: cp.zeros([SIZE], dtype=cp.int64))


def _relay_shm(mode: str):
    """One relay with shmtensor; ``mode``: "vmm" (each stage allocates with
    shmtensor.cuda.set_allocator()) or "ipc" (CuPy's default pool, legacy CUDA IPC)."""
    import functools
    import shmtensor.multiprocessing as smp
    stages = tuple(functools.partial(f, mode=mode) for f in (_shm_send, _shm_forward, _shm_sum))
    return lambda: _relay(smp.get_context("spawn"), stages, N)


def _torch_send(q, e, count):
    import torch
    for i in range(count):
        q.put(torch.full([SIZE], i, device="cuda", dtype=torch.long))
    e.wait(600)


def _torch_forward(q1, q2, e, count):
    for _ in range(count):
        q2.put(q1.get().clone())
    e.wait(600)


def _torch_sum(q2, q3, e, count):
    import torch
    _timed_sum(q2, q3, e, count, lambda: torch.zeros([SIZE], device="cuda", dtype=torch.long))


def _relay_torch():
    import torch.multiprocessing as tmp
    return lambda: _relay(tmp.get_context("spawn"), (_torch_send, _torch_forward, _torch_sum), N)


def _big_sender(q, e, reps, mode):
    import cupy as cp
    import shmtensor.cuda
    make = shmtensor.cuda.ones if mode == "vmm" else cp.ones
    a = make(1 << 27, dtype=cp.float64)  # 1 GiB
    for _ in range(reps):
        q.put(a)
    e.wait(120)


def _big_array(mode: str, reps: int = 50) -> dict:
    import shmtensor.multiprocessing as smp
    ctx = smp.get_context("spawn")
    q, e = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_big_sender, args=(q, e, reps, mode))
    p.start()
    t0 = time.perf_counter()
    first = q.get(timeout=120)
    t_first = time.perf_counter() - t0
    times = []
    for _ in range(reps - 1):
        t = time.perf_counter()
        a = q.get(timeout=120)
        times.append(time.perf_counter() - t)
        assert a.nbytes == 1 << 30
    ok = float(first[:10].sum()) == 10.0
    del first, a
    e.set()
    p.join(60)
    times.sort()
    return {"first_get_s": t_first, "median_get_s": times[len(times) // 2], "values_ok": ok}


def measure() -> dict:
    relays = {"shmtensor_relay": _relay_shm("vmm"), "shmtensor_relay_cupy_pool": _relay_shm("ipc")}
    if importlib.util.find_spec("torch") is not None:
        relays["torch_relay"] = _relay_torch()
    # Rounds, each running every contender once: a device machine's speed drifts during a
    # run (a fresh one speeds up over its first minutes), which would favour whoever ran last.
    runs: dict[str, list] = {label: [] for label in relays}
    for i in range(REPEATS):
        for label, relay in relays.items():
            runs[label].append(relay())
            print(f"  cuda         round {i + 1} {label}: "
                  f"{runs[label][-1]['per_array_s'] * 1e6:.0f} us per array",
                  file=sys.stderr, flush=True)
    res = {label: _summary(r) for label, r in runs.items()}
    res.setdefault("torch_relay", None)
    if res["torch_relay"] is not None:
        res["round_ratios"] = [t["per_array_s"] / v["per_array_s"]
                               for t, v in zip(runs["torch_relay"], runs["shmtensor_relay"])]
    for mode, label in (("ipc", "big_array"), ("vmm", "big_array_vmm")):
        res[label] = _big_array(mode)
    return res


def section(res: dict) -> Section:
    torch = res["torch_relay"]
    rows = [(f"relay of {N:,} arrays of {SIZE} int64, 3 processes ({label})",
             f"{r['per_array_s'] * 1e6:.0f} us/array",
             " / ".join(f"{x * 1e6:.0f}" for x in r["runs_per_array_s"]), f"{r['wall_s']:.2f} s")
            for label, r in (("shmtensor, shared VMM allocator", res["shmtensor_relay"]),
                             ("shmtensor, CuPy's pool (legacy IPC)",
                              res["shmtensor_relay_cupy_pool"]),
                             ("torch.multiprocessing", torch)) if r is not None]
    rows += [(f"1 GiB array re-sent once open ({label})",
              f"{b['median_get_s'] * 1e6:.0f} us/get", "",
              f"first get {b['first_get_s'] * 1e3:.0f} ms")
             for label, b in (("legacy IPC", res["big_array"]), ("VMM", res["big_array_vmm"]))]
    table = _report.format_rows(("what", "per item (median)", "runs, us", "wall"), rows)
    per = res["shmtensor_relay"]["per_array_s"]
    targets = [
        _report.target("relay per array: torch.multiprocessing / shmtensor (VMM allocator)",
                       _report.ratio(torch["per_array_s"] if torch else None, per), ">=", 6,
                       section="cuda"),
        _report.target("relay per array: torch.multiprocessing / shmtensor (CuPy's pool, "
                       "legacy IPC)",
                       _report.ratio(torch["per_array_s"] if torch else None,
                                     res["shmtensor_relay_cupy_pool"]["per_array_s"]), ">=", 3,
                       section="cuda"),
        _report.target("1 GiB array get once its allocation is open (legacy IPC)",
                       res["big_array"]["median_get_s"] * 1e3, "<=", 1, unit="ms",
                       section="cuda"),
        _report.target("1 GiB array get once its allocation is open (VMM)",
                       res["big_array_vmm"]["median_get_s"] * 1e3, "<=", 1, unit="ms",
                       section="cuda"),
    ]
    return Section(key="cuda", title="CUDA: CuPy arrays between processes (GPU machine)",
                   table=table, targets=targets, data=res,
                   notes=[f"per array: the last stage's own time from its {N0:,}th array to "
                          f"its {N:,}th, / {N - N0:,} (start-up excluded); median of "
                          f"{REPEATS} relays, run in rounds (each round runs every contender "
                          "once)"] + ([
                       "torch / shmtensor (VMM) within each round: " + ", ".join(
                           f"{x:.2f}x" for x in res["round_ratios"])]
                       if res.get("round_ratios") else []))


def run() -> Section:
    """The CUDA section of scripts/bench: measured where CuPy sees a GPU, else said so."""
    import shmtensor.cuda
    if not shmtensor.cuda.is_available():
        return Section(key="cuda", title="CUDA: skipped (no visible GPU, or CuPy not installed)",
                       table="run scripts/gpu_check on a GPU machine (its log has this section)",
                       targets=[], data={"skipped": True})
    return section(measure())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    sec = section(measure())
    print(sec.render(), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"targets": sec.targets, **sec.data}, f, indent=2)
    return 0 if all(t["pass"] for t in sec.targets) else 1


if __name__ == "__main__":
    sys.exit(main())
