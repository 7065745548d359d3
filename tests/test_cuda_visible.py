"""Which GPUs a process sees (``CUDA_VISIBLE_DEVICES``), counted without initialising CUDA.

The parsing runs everywhere (no GPU): torch's own tables, and the answers driver 580
gave on a machine with two GPUs.  The fallback without NVML runs against a fake libcuda
built here (needs a C compiler), and against the real driver where there is one.
"""

import ctypes
import os
import shutil
import subprocess
import sys

import pytest

import shmtensor.cuda
from shmtensor.ipc import cuda_ipc

# The UUIDs of the two GPUs the driver's answers below were measured on.
TWO = ["GPU-cbfb7d47-672c-b4d6-4ea2-891a0cffc516", "GPU-6b7493c1-a008-7a27-ba3a-a95f7887993b"]


@pytest.mark.parametrize("spec, expected", [
    ("1gpu2,2ampere", [1, 2]),  # the rest of an entry is ignored
    ("0, 1, 2, -1, 3", [0, 1, 2]),  # a negative ends the list
    ("0, 1, 2, 1", []),  # an ordinal named twice: no device at all
    ("2, +3, -0, 5", [2, 3, 0, 5]),  # unary signs
    ("one,two,3,4", []),  # unreadable first entry: nothing
    ("4,3,two,one", [4, 3]),  # ... later: the list ends there
    ("GPU-9e8d35e3", ["GPU-9e8d35e3"]),
    ("GPU-123, 2", ["GPU-123"]),  # ordinals do not mix with UUIDs
    ("MIG-89c850dc", ["MIG-89c850dc"]),
    ("", []),
    ("+", []),  # a sign without digits (torch raises ValueError here)
    (None, list(range(64))),
])
def test_visible_devices_are_parsed_as_torch_parses_them(spec, expected):
    assert cuda_ipc.parse_visible_devices(spec) == expected


UUIDS = ["GPU-9942190a-aa31-4ff1-4aa9-c388d80f85f1", "GPU-9e8d35e3-a134-0fdd-0e01-23811fdbd293",
         "GPU-e429a63e-c61c-4795-b757-5132caeb8e70", "GPU-eee1dfbc-0a0f-6ad8-5ff6-dc942a8b9d98",
         "GPU-bbcd6503-5150-4e92-c266-97cc4390d04e", "GPU-472ea263-58d7-410d-cc82-f7fdece5bd28",
         "GPU-e56257c4-947f-6a5b-7ec9-0f45567ccf4e", "GPU-1c20e77d-1c1a-d9ed-fe37-18b8466a78ad"]


@pytest.mark.parametrize("candidates, expected", [
    (["GPU-9e8d35e3"], [1]),
    (["GPU-e4", "GPU-9e8d35e3"], [2, 1]),
    (["GPU-9e8d35e3", "GPU-1", "GPU-47"], [1, 7, 5]),
    (["GPU-123", "GPU-9e8d35e3"], []),  # the first unknown prefix ends the list
    (["GPU-9e8d35e3", "GPU-123", "GPU-47"], [1]),
    (["GPU-9e8d35e3", "GPU-e", "GPU-47"], [1]),  # ... and so does an ambiguous one
    (["GPU-9e8d35e3", "GPU-47", "GPU-9e8"], []),  # a device named twice: none
])
def test_uuid_prefixes_resolve_as_torch_resolves_them(candidates, expected):
    assert cuda_ipc.uuids_to_ordinals(candidates, UUIDS) == expected


@pytest.fixture
def nvml_two(monkeypatch):
    """NVML reports the two GPUs the driver's answers were measured on."""
    monkeypatch.setattr(cuda_ipc, "nvml_uuids", lambda: list(TWO))


# CUDA_VISIBLE_DEVICES -> cuDeviceGetCount after cuInit in a fresh process, driver 580.159.04,
# two H200s (torch 2.11's _device_count_nvml gave the same for each, and -1 for MIG-).
DRIVER_580 = [("", 0), ("0", 1), ("1", 1), ("0,1", 2), ("1,0", 2), ("+1", 1), (" 1", 1),
              ("1 ", 1), ("0,0", 0), ("1,0,1", 0), ("1gpu2", 1), ("0, 1", 2), ("-1", 0),
              ("-0", 1), ("0,-1,1", 1), ("2", 0), ("0,2,1", 1), ("+0,+1", 2), ("x", 0),
              ("0,x,1", 1), ("GPU-", 0), ("GPU-cbfb7d47", 1), ("GPU-cbfb7d47,GPU-6b7493c1", 2),
              ("GPU-cbfb7d47, GPU-6b7493c1", 1), ("GPU-cbfb7d47,0", 1), ("0,GPU-6b7493c1", 1),
              ("GPU-cbfb7d47,GPU-cbfb7d47", 0), ("cbfb7d47", 0), ("GPU-zzz", 0),
              ("GPU-6b7493c1,GPU-zzz,GPU-cbfb7d47", 1), (" GPU-cbfb7d47", 0),
              ("GPU-cbfb7d47-672c-b4d6-4ea2-891a0cffc516", 1), (None, 2)]


@pytest.mark.parametrize("spec, driver", DRIVER_580)
def test_nvml_count_is_what_the_driver_counted(nvml_two, spec, driver):
    assert cuda_ipc.nvml_device_count(spec) == driver


def test_mig_entries_and_a_missing_nvml_leave_nvml_without_an_answer(nvml_two, monkeypatch):
    assert cuda_ipc.nvml_device_count("MIG-89c850dc-1a2b") == -1
    assert cuda_ipc.nvml_device_count("0,1") == 2
    monkeypatch.setattr(cuda_ipc, "nvml_uuids", lambda: None)
    assert cuda_ipc.nvml_device_count("0,1") == -1
    assert cuda_ipc.nvml_device_count("GPU-cbfb7d47") == -1
    assert cuda_ipc.nvml_device_count("0,0") == 0  # no device, whatever NVML says


class _Driver:
    """A libcuda stand-in: ``count`` once initialised, CUDA_ERROR_NOT_INITIALIZED before."""

    def __init__(self, count=None):
        self.count = count

    def cuDeviceGetCount(self, ref):
        if self.count is None:
            return 3
        ref._obj.value = self.count
        return 0


@pytest.fixture
def unloadable_nvml(monkeypatch):
    """libnvidia-ml cannot be loaded (a container without it, a driver without NVML)."""
    real = cuda_ipc._load
    monkeypatch.setattr(cuda_ipc, "_load", lambda names: None if "nvidia-ml" in names[0]
                        else real(names))
    monkeypatch.setattr(cuda_ipc, "_nvml", None)
    assert cuda_ipc.nvml_uuids() is None


def test_without_nvml_the_driver_is_asked_in_a_child_once_per_value(unloadable_nvml,
                                                                    monkeypatch):
    monkeypatch.setattr(cuda_ipc, "_libcuda", lambda: _Driver())
    monkeypatch.setattr(cuda_ipc, "_child_counts", {})
    asked = []

    def run(args, env, **kwargs):
        assert args[:3] == [sys.executable, "-I", "-S"]
        asked.append(env.get("CUDA_VISIBLE_DEVICES"))
        return subprocess.CompletedProcess(args, 0, "5\n", "")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert shmtensor.cuda.device_count() == 5
    assert shmtensor.cuda.device_count() == 5
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert shmtensor.cuda.device_count() == 5
    assert asked == ["0,1", None]  # once per value of the variable
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,0")
    assert shmtensor.cuda.device_count() == 0  # no device, whatever the driver has
    assert asked == ["0,1", None]


def test_mig_entries_ask_the_driver_in_a_child(nvml_two, monkeypatch):
    monkeypatch.setattr(cuda_ipc, "_libcuda", lambda: _Driver())
    monkeypatch.setattr(cuda_ipc, "_count_in_child", lambda spec: 1 if spec.startswith("MIG-")
                        else pytest.fail("asked a child with NVML able to answer"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-89c850dc-1a2b-5c6d-7e8f-0123456789ab")
    assert shmtensor.cuda.device_count() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-6b7493c1")
    assert shmtensor.cuda.device_count() == 1


def test_once_cuda_is_initialised_the_driver_answers(nvml_two, monkeypatch):
    monkeypatch.setattr(cuda_ipc, "_libcuda", lambda: _Driver(count=4))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # changed after initialisation: no effect
    assert shmtensor.cuda.device_count() == 4


def test_without_libcuda_there_is_no_device(nvml_two, monkeypatch):
    monkeypatch.setattr(cuda_ipc, "_libcuda", lambda: None)
    assert shmtensor.cuda.device_count() == 0 and not shmtensor.cuda.is_available()


# A libcuda that logs each cuInit (pid and CUDA_VISIBLE_DEVICES) and counts the entries of
# CUDA_VISIBLE_DEVICES once initialised: which process initialised CUDA, and with what.
FAKE_LIBCUDA = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static int inited;
int cuInit(unsigned flags) {
    const char *spec = getenv("CUDA_VISIBLE_DEVICES");
    FILE *f = fopen(getenv("FAKE_CUDA_LOG"), "a");
    fprintf(f, "%d %s\n", (int)getpid(), spec ? spec : "<unset>");
    fclose(f);
    inited = 1;
    return 0;
}
int cuDeviceGetCount(int *count) {
    const char *spec = getenv("CUDA_VISIBLE_DEVICES");
    if (!inited) return 3;
    *count = 1;
    for (; spec && *spec; spec++) *count += *spec == ',';
    return 0;
}
int cuGetErrorName(int err, const char **name) { *name = "FAKE"; return 0; }
"""

_PROBE = ("import os, sys\n"
          "import shmtensor.cuda as c\n"
          "from shmtensor.ipc import cuda_ipc\n"
          "cuda_ipc._nvml = False  # NVML unloadable\n"
          "print(os.getpid(), c.device_count(), c.device_count(), c.is_available() in (0, 1))\n")


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler for a fake libcuda")
def test_the_fallback_initialises_cuda_in_a_child_only(tmp_path):
    src = tmp_path / "fake.c"
    src.write_text(FAKE_LIBCUDA)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"), str(src)],
                   check=True, timeout=60)
    log = tmp_path / "init.log"
    spec = "MIG-a1b2c3d4,MIG-e5f6a7b8"  # NVML could not answer even where it is loadable
    env = dict(os.environ, LD_LIBRARY_PATH=f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}",
               FAKE_CUDA_LOG=str(log), CUDA_VISIBLE_DEVICES=spec)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pid, first, second, _ = out.stdout.split()
    assert (first, second) == ("2", "2")  # the fake driver's count, asked once
    inits = log.read_text().splitlines()
    assert len(inits) == 1, inits
    child_pid, seen = inits[0].split(" ", 1)
    assert child_pid != pid and seen == spec  # initialised in a child, with our variable


requires_gpu = pytest.mark.skipif(not shmtensor.cuda.is_available(),
                                  reason="needs CuPy and a visible CUDA device")


@pytest.mark.requires_cuda
@requires_gpu
def test_without_nvml_the_real_driver_counts_and_cuda_stays_uninitialised():
    code = ("import cupy, os, json\n"
            "from shmtensor.ipc import cuda_ipc\n"
            "cuda_ipc._nvml = False  # NVML unloadable\n"
            "out = {}\n"
            "for spec in (None, '0', '0,0', 'MIG-zzz', 'GPU-zzz'):\n"
            "    os.environ.pop('CUDA_VISIBLE_DEVICES', None)\n"
            "    if spec is not None:\n"
            "        os.environ['CUDA_VISIBLE_DEVICES'] = spec\n"
            "    out[str(spec)] = cuda_ipc.device_count()\n"
            "out['initialised'] = cuda_ipc.cuda_initialized()\n"
            "os.environ.pop('CUDA_VISIBLE_DEVICES', None)\n"
            "out['cupy'] = cupy.cuda.runtime.getDeviceCount()\n"
            "print(json.dumps(out))\n")
    import json
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["initialised"] is False
    assert got["None"] == got["cupy"] >= 1
    assert (got["0"], got["0,0"], got["MIG-zzz"], got["GPU-zzz"]) == (1, 0, 0, 0)
