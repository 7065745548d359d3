"""The CUDA API where CUDA cannot be used: no CuPy, no GPU (runs everywhere)."""

import subprocess
import sys

from shmtensor.cuda import _vmm

BLOCK_CUPY = "import sys; sys.modules['cupy'] = None; "


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_CUPY + code], capture_output=True,
                          text=True, timeout=60)


def test_without_cupy_the_cuda_api_says_how_to_install_it():
    out = _run("import shmtensor.cuda as c\n"
               "print(c.is_available())\n"
               "for f in (lambda: c.zeros(3), lambda: c.malloc(8), c.set_allocator):\n"
               "    try:\n"
               "        f()\n"
               "    except ImportError as e:\n"
               "        print('ImportError', e)\n"
               "print(c.ipc_collect(), c.exports())\n")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "False"
    assert len([line for line in lines if line.startswith("ImportError")]) == 3
    assert all("pip install 'shmtensor[cuda12]'" in line and "[cuda13]" in line
               for line in lines if line.startswith("ImportError"))
    assert lines[-1] == "0 []"


def test_without_cupy_arrays_still_cross():
    out = _run("import numpy as np, shmtensor, shmtensor.multiprocessing as mp\n"
               "q = mp.get_context('spawn').SimpleQueue()\n"
               "q.put(shmtensor.ones(4)); print(float(q.get().sum()))\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "4.0"


def test_debug_info_has_the_cuda_counters_before_cuda_is_used():
    keys = ("cuda_exports", "cuda_opened", "cuda_events", "cuda_vmm_slabs", "cuda_vmm_bytes",
            "cuda_vmm_blocks_held", "cuda_vmm_mapped")
    out = _run(f"import shmtensor; info = shmtensor.debug_info(); print([info[k] for k in {keys}])")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([0] * len(keys))


def test_vmm_block_sizes(monkeypatch):
    monkeypatch.setitem(_vmm._granularity, 0, 2 << 20)
    assert [_vmm._block_size(0, n) for n in (0, 1, 512, 513, 4096, 5000)] == [
        512, 512, 512, 1024, 4096, 8192]
    assert _vmm._block_size(0, 1 << 20) == 1 << 20  # the largest that shares a slab
    assert _vmm._block_size(0, (1 << 20) + 1) == 2 << 20  # a slab of its own
    assert _vmm._block_size(0, 5 << 20) == 6 << 20  # whole granules
