"""CUDA facts for sharing device memory, without initialising CUDA where it must not.

Facts this module is built on:

* NVML answers device counts and UUIDs without creating a CUDA context, so counting
  devices never initialises CUDA (a parent that forks workers stays fork-safe).  The
  devices a process sees are NVML's, filtered and ordered by ``CUDA_VISIBLE_DEVICES``
  (indices or ``GPU-``/``MIG-`` UUID prefixes; an invalid entry hides it and all after it).
* A forked child of a process that initialised CUDA cannot use CUDA.  The driver then fails
  with an opaque error; :func:`check_not_bad_fork` says what happened and what to do.
* Legacy CUDA IPC hands out a handle for a whole ``cudaMalloc`` allocation; memory pools
  sub-allocate, so the handle is for the allocation's base, found with
  ``cuMemGetAddressRange``, plus the array's offset in it.

The driver entry points CuPy does not bind go through a small ctypes layer over libcuda
and libnvidia-ml, checked call by call (``_check``): it needs no extra package.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

__all__ = ["nvml_device_count", "nvml_uuids", "visible_uuids", "address_range", "buffer_id",
           "cuda_initialized", "bad_fork", "check_not_bad_fork", "check_can_initialize",
           "CudaIpcError", "BAD_FORK_MESSAGE"]

BAD_FORK_MESSAGE = ("Cannot re-initialize CUDA in forked subprocess; use the spawn or "
                    "forkserver start method")


class CudaIpcError(RuntimeError):
    """A CUDA driver or NVML call failed; the message names the call and the error."""


_lock = threading.Lock()
_nvml = None
_cuda = None


def _load(names):
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _libnvml():
    global _nvml
    with _lock:
        if _nvml is None:
            lib = _load(["libnvidia-ml.so.1", "libnvidia-ml.so"])
            if lib is None or lib.nvmlInit_v2() != 0:
                _nvml = False
            else:
                _nvml = lib
    return _nvml or None


def nvml_uuids() -> list[str]:
    """Every device's UUID (``GPU-...``) in NVML order; empty without a driver."""
    lib = _libnvml()
    if lib is None:
        return []
    count = ctypes.c_uint()
    if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
        return []
    out = []
    for i in range(count.value):
        handle = ctypes.c_void_p()
        buf = ctypes.create_string_buffer(96)
        if (lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0
                or lib.nvmlDeviceGetUUID(handle, buf, 96) != 0):
            return out
        out.append(buf.value.decode())
    return out


def visible_uuids(env: str | None = None) -> list[str]:
    """The UUIDs of the devices this process can see, in CUDA's order."""
    uuids = nvml_uuids()
    spec = os.environ.get("CUDA_VISIBLE_DEVICES") if env is None else env
    if spec is None:
        return uuids
    out: list[str] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            break
        if item.isdigit():
            i = int(item)
            if i >= len(uuids) or uuids[i] in out:
                break
            out.append(uuids[i])
        else:
            matches = [u for u in uuids if u.startswith(item) or u.startswith("GPU-" + item)]
            if len(matches) != 1 or matches[0] in out:
                break
            out.append(matches[0])
    return out


def nvml_device_count() -> int:
    return len(visible_uuids())


def _libcuda():
    global _cuda
    with _lock:
        if _cuda is None:
            _cuda = _load(["libcuda.so.1", "libcuda.so"]) or False
    return _cuda or None


def _check(call: str, err: int) -> None:
    if err != 0:
        lib = _libcuda()
        name = ctypes.c_char_p()
        if lib is not None:
            lib.cuGetErrorName(err, ctypes.byref(name))
        raise CudaIpcError(f"{call} failed with {name.value.decode() if name.value else err}")


def cuda_initialized() -> bool:
    """True once this process has initialised the CUDA driver (asks it without initialising)."""
    lib = _libcuda()
    if lib is None:
        return False
    count = ctypes.c_int()
    return lib.cuDeviceGetCount(ctypes.byref(count)) == 0  # CUDA_ERROR_NOT_INITIALIZED otherwise


def address_range(ptr: int) -> tuple[int, int]:
    """``(base, size)`` of the allocation holding device pointer ``ptr`` (current context)."""
    lib = _libcuda()
    if lib is None:
        raise CudaIpcError("libcuda.so.1 is not loadable: is the NVIDIA driver installed?")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check("cuMemGetAddressRange", lib.cuMemGetAddressRange_v2(
        ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)))
    return base.value, size.value


_POINTER_ATTRIBUTE_BUFFER_ID = 7  # CU_POINTER_ATTRIBUTE_BUFFER_ID


def buffer_id(ptr: int) -> int:
    """The driver's id of the allocation holding ``ptr``: unique for the process's life, so
    an allocation freed and made again at the same address has a new one."""
    lib = _libcuda()
    if lib is None:
        raise CudaIpcError("libcuda.so.1 is not loadable: is the NVIDIA driver installed?")
    out = ctypes.c_uint64()
    _check("cuPointerGetAttribute", lib.cuPointerGetAttribute(
        ctypes.byref(out), _POINTER_ATTRIBUTE_BUFFER_ID, ctypes.c_uint64(ptr)))
    return out.value


_contexts: dict[int, ctypes.c_void_p] = {}  # device ordinal -> its retained primary context


class Current:
    """Make ``device``'s primary context (the one CuPy and the runtime use; retained once
    per process) current for the driver calls inside, on any thread."""

    __slots__ = ("device",)

    def __init__(self, device: int) -> None:
        self.device = device

    def __enter__(self):
        lib = _libcuda()
        if lib is None:
            raise CudaIpcError("libcuda.so.1 is not loadable: is the NVIDIA driver installed?")
        ctx = _contexts.get(self.device)
        if ctx is None:
            _check("cuInit", lib.cuInit(0))
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            _check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), self.device))
            _check("cuDevicePrimaryCtxRetain",
                   lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
            _contexts[self.device] = ctx
        _check("cuCtxPushCurrent", lib.cuCtxPushCurrent_v2(ctx))
        return lib

    def __exit__(self, *exc) -> None:
        _libcuda().cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


def close_mem_handle(device: int, ptr: int) -> None:
    """``cuIpcCloseMemHandle`` of a handle opened on ``device``.  Through ctypes the GIL
    is released for the call (20-90 us), which CuPy's own wrapper keeps."""
    with Current(device) as lib:
        _check("cuIpcCloseMemHandle", lib.cuIpcCloseMemHandle(ctypes.c_uint64(ptr)))


_bad_fork = False
_parent_had_cuda = False


def _before_fork() -> None:
    global _parent_had_cuda
    # Only ask the driver when something here may have used it (CuPy imported, or us).
    _parent_had_cuda = bool(_cuda or "cupy" in sys.modules) and cuda_initialized()


def _after_fork_in_child() -> None:
    global _bad_fork, _lock
    _lock = threading.Lock()
    _bad_fork = _bad_fork or _parent_had_cuda
    _contexts.clear()  # the parent's contexts


def bad_fork() -> bool:
    """True in a forked child of a process that had initialised CUDA."""
    return _bad_fork


def check_not_bad_fork() -> None:
    if _bad_fork:
        raise RuntimeError(BAD_FORK_MESSAGE)


_CUDA_ERROR_NOT_INITIALIZED = 3


def check_can_initialize() -> None:
    """Before a process's first CUDA use: raise the fork error if this is a forked child of a
    process that had initialised CUDA, even one that forked before this module was imported
    (no fork hook saw it).  ``cuInit`` then fails with CUDA_ERROR_NOT_INITIALIZED (measured
    with driver 580), where in any other process it initialises the driver, as the first
    use would anyway."""
    global _bad_fork
    check_not_bad_fork()
    lib = _libcuda()
    if lib is not None and lib.cuInit(0) == _CUDA_ERROR_NOT_INITIALIZED:
        _bad_fork = True
        raise RuntimeError(BAD_FORK_MESSAGE)


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
