"""The driver calls shmtensor makes per message, through its ctypes layer (ipc.cuda_ipc,
ipc.cuda_vmm) and through NVIDIA's cuda-bindings, timed side by side on a CUDA machine.

This is the evidence for docs/architecture.md's "ctypes or cuda-bindings" judgment.
Usage: python -m benchmarks.bench_driver_calls (prints a table; needs CuPy and a GPU).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time


def _per_call(fn, n: int = 20000, rounds: int = 5) -> float:
    best = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t) / n)
    return statistics.median(best)


def main() -> None:
    import cupy as cp
    from cuda.bindings import driver

    from shmtensor.ipc import cuda_ipc, cuda_vmm
    a = cp.zeros(1 << 20, dtype=cp.uint8)
    ptr = a.data.ptr + 4096
    rows = []
    rows.append(("cuMemGetAddressRange", _per_call(lambda: cuda_ipc.address_range(ptr)),
                 _per_call(lambda: driver.cuMemGetAddressRange(ptr))))
    lib = cuda_ipc._libcuda()
    import ctypes
    count = ctypes.c_int()
    rows.append(("cuDeviceGetCount", _per_call(lambda: lib.cuDeviceGetCount(ctypes.byref(count))),
                 _per_call(lambda: driver.cuDeviceGetCount())))
    g = cuda_vmm.granularity(0)

    def vmm_ctypes():
        h = cuda_vmm.create(0, g)
        p = cuda_vmm.map_handle(0, h, g)
        fd = cuda_vmm.export_fd(0, h)
        cuda_vmm.release(0, h)
        cuda_vmm.unmap(0, p, g)
        os.close(fd)

    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    prop.requestedHandleTypes = (
        driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    acc = driver.CUmemAccessDesc()
    acc.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    acc.location.id = 0
    acc.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE

    def vmm_bindings():
        _, h = driver.cuMemCreate(g, prop, 0)
        _, p = driver.cuMemAddressReserve(g, 0, 0, 0)
        driver.cuMemMap(p, g, 0, h, 0)
        driver.cuMemSetAccess(p, g, [acc], 1)
        _, fd = driver.cuMemExportToShareableHandle(
            h, driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
        driver.cuMemRelease(h)
        driver.cuMemUnmap(p, g)
        driver.cuMemAddressFree(p, g)
        os.close(fd)

    rows.append(("VMM slab: create, map, export, unmap", _per_call(vmm_ctypes, 300, 3),
                 _per_call(vmm_bindings, 300, 3)))
    imp = subprocess.run([sys.executable, "-X", "importtime", "-c",
                          "import cuda.bindings.driver"], capture_output=True, text=True)
    total = [line for line in imp.stderr.splitlines() if line.rstrip().endswith("cuda.bindings.driver")]
    print(f"{'call':<40} {'ctypes':>10} {'cuda-bindings':>14}")
    for name, c, b in rows:
        print(f"{name:<40} {c * 1e6:9.2f}us {b * 1e6:13.2f}us")
    print("import cuda.bindings.driver:", total[-1].split("|")[1].strip() + " us" if total else "?")


if __name__ == "__main__":
    main()
