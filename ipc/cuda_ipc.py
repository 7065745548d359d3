"""CUDA facts for sharing device memory, without initialising CUDA where it must not.

Facts this module is built on:

* NVML answers device counts and UUIDs without creating a CUDA context, so counting
  devices never initialises CUDA (a parent that forks workers stays fork-safe).  The
  devices a process sees are NVML's, filtered by ``CUDA_VISIBLE_DEVICES`` as CUDA reads it
  (:func:`parse_visible_devices`, torch's reading, which matched driver 580 on every string
  tried).  NVML cannot resolve ``MIG-`` entries to CUDA devices, and may be missing where
  libcuda is not: then the driver itself is asked, in a child process (:func:`device_count`).
* A forked child of a process that initialised CUDA cannot use CUDA.  The driver then fails
  with an opaque error; :func:`check_not_bad_fork` says what happened and what to do.
* Legacy CUDA IPC hands out a handle for a whole ``cudaMalloc`` allocation; memory pools
  sub-allocate, so the handle is for the allocation's base, found with
  ``cuMemGetAddressRange``, plus the array's offset in it.
* Driver calls act on the calling thread's current context, and a thread that has made no
  CUDA call has none (``CUDA_ERROR_INVALID_CONTEXT``): a pool's task thread or a queue's
  feeder thread pickling an array.  The runtime (CuPy's calls) makes its device's primary
  context current on a thread's first call; ctypes calls here run inside :class:`Current`.
  Asked for the IPC handle of another context's event, the driver (580) crashes the
  process, and no call says which context an event is of: the caller names the event's
  device (:func:`event_handle`).

The driver entry points CuPy does not bind go through a small ctypes layer over libcuda
and libnvidia-ml, checked call by call (``_check``): it needs no extra package.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from typing import Literal, Protocol, cast

__all__ = ["device_count", "parse_visible_devices", "uuids_to_ordinals", "nvml_device_count",
           "nvml_uuids", "address_range", "buffer_id", "Current", "active_devices",
           "event_handle", "cuda_initialized", "bad_fork", "check_not_bad_fork",
           "check_can_initialize", "CudaIpcError", "BAD_FORK_MESSAGE"]

BAD_FORK_MESSAGE = ("Cannot re-initialize CUDA in forked subprocess; use the spawn or "
                    "forkserver start method")


class CudaIpcError(RuntimeError):
    """A CUDA driver or NVML call failed; the message names the call and the error."""


class _Library(Protocol):
    """A loaded C library (libcuda, libnvidia-ml) as ctypes calls it: every entry point
    used here returns a C ``int`` (``CUresult``, ``nvmlReturn_t``), ctypes' default."""

    def __getattr__(self, name: str) -> Callable[..., int]: ...


_lock = threading.Lock()
_nvml: _Library | Literal[False] | None = None  # False: not loadable, or nvmlInit failed
_cuda: _Library | Literal[False] | None = None  # False: not loadable


def _load(names: list[str]) -> _Library | None:
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _libnvml() -> _Library | None:
    global _nvml
    with _lock:
        if _nvml is None:
            lib = _load(["libnvidia-ml.so.1", "libnvidia-ml.so"])
            if lib is None or lib.nvmlInit_v2() != 0:
                _nvml = False
            else:
                _nvml = lib
    return _nvml or None


def nvml_uuids() -> list[str] | None:
    """Every device's UUID (``GPU-...``) in NVML order; None when NVML cannot tell."""
    lib = _libnvml()
    if lib is None:
        return None
    count = ctypes.c_uint()
    if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
        return None
    out = []
    for i in range(count.value):
        handle = ctypes.c_void_p()
        buf = ctypes.create_string_buffer(96)
        if (lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0
                or lib.nvmlDeviceGetUUID(handle, buf, 96) != 0):
            return None
        out.append(buf.value.decode())
    return out


def _leading_int(s: str) -> int:
    """The integer ``s`` starts with (an optional sign, then digits, as ``strtol`` reads
    it: ``1gpu2`` is 1, ``-0`` is 0), or -1 when it starts with none."""
    i = 1 if s[:1] in ("+", "-") else 0
    j = i
    while j < len(s) and s[j] in "0123456789":
        j += 1
    return int(s[:j]) if j > i else -1


def parse_visible_devices(spec: str | None) -> list[int] | list[str]:
    """``CUDA_VISIBLE_DEVICES`` as CUDA reads it (torch's ``_parse_visible_devices``): unset,
    the first 64 ordinals; starting with ``GPU-`` or ``MIG-``, the entries up to the first
    without that prefix (not stripped); else ordinals, each entry stripped and read as its
    leading integer, up to the first negative or unreadable one.  A repeated entry makes the
    list empty (CUDA then sees no device)."""
    if spec is None:
        return list(range(64))
    if spec.startswith(("GPU-", "MIG-")):
        prefix = spec[:4]
        ids: list[str] = []
        for item in spec.split(","):
            if item in ids:
                return []
            if not item.startswith(prefix):
                break
            ids.append(item)
        return ids
    ordinals: list[int] = []
    for item in spec.split(","):
        n = _leading_int(item.strip())
        if n in ordinals:
            return []
        if n < 0:
            break
        ordinals.append(n)
    return ordinals


def uuids_to_ordinals(candidates: list[str], uuids: list[str]) -> list[int]:
    """The NVML ordinals of UUID prefixes ``candidates`` (torch's
    ``_transform_uuid_to_ordinals``): up to the first that matches no UUID or several; a
    device named twice makes the list empty."""
    out: list[int] = []
    for candidate in candidates:
        found = [i for i, uuid in enumerate(uuids) if uuid.startswith(candidate)]
        if len(found) != 1:
            break
        if found[0] in out:
            return []
        out.append(found[0])
    return out


def nvml_device_count(spec: str | None) -> int:
    """The devices ``CUDA_VISIBLE_DEVICES=spec`` leaves visible, by NVML (torch's
    ``_device_count_nvml``); -1 when NVML cannot tell: not loadable or failing, or ``MIG-``
    entries (NVML's MIG UUIDs do not map to CUDA ordinals without CUDA)."""
    visible = parse_visible_devices(spec)
    if not visible:
        return 0
    if isinstance(visible[0], str):
        if visible[0].startswith("MIG-"):
            return -1
        uuids = nvml_uuids()
        return -1 if uuids is None else len(uuids_to_ordinals(visible, uuids))
    uuids = nvml_uuids()
    if uuids is None:
        return -1
    for i, ordinal in enumerate(visible):
        if ordinal >= len(uuids):  # the first ordinal past the last device ends the list
            return i
    return len(visible)


# Run in a child with CUDA_VISIBLE_DEVICES as here: the driver's own count, whatever the
# variable says (MIG instances too), without initialising CUDA in this process.
_COUNT_IN_CHILD = """import ctypes
n = ctypes.c_int(0)
try:
    lib = ctypes.CDLL("libcuda.so.1")
except OSError:
    lib = None
ok = lib is not None and lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(n)) == 0
print(n.value if ok else 0)
"""
COUNT_TIMEOUT_S = 60.0
_child_counts: dict[str | None, int] = {}  # CUDA_VISIBLE_DEVICES -> the driver's count


def _count_in_child(spec: str | None) -> int:
    """The driver's device count under ``CUDA_VISIBLE_DEVICES=spec``, asked once per
    ``spec`` in a child process (``cuInit`` there, not here); 0 if the child fails."""
    n = _child_counts.get(spec)
    if n is None:
        import subprocess
        env = dict(os.environ)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        if spec is not None:
            env["CUDA_VISIBLE_DEVICES"] = spec
        try:
            out = subprocess.run([sys.executable, "-I", "-S", "-c", _COUNT_IN_CHILD], env=env,
                                 capture_output=True, text=True, timeout=COUNT_TIMEOUT_S,
                                 stdin=subprocess.DEVNULL)
            n = int(out.stdout) if out.returncode == 0 else 0
        except (OSError, ValueError, subprocess.TimeoutExpired):
            n = 0
        _child_counts[spec] = n
    return n


def device_count() -> int:
    """The CUDA devices this process sees, without initialising CUDA here: once this
    process initialised CUDA, the driver's count; else NVML's with ``CUDA_VISIBLE_DEVICES``
    applied; where NVML cannot tell (missing, or ``MIG-`` entries), the driver's count in a
    child process, asked once per value of the variable; 0 without libcuda."""
    lib = _libcuda()
    if lib is None:
        return 0
    count = ctypes.c_int()
    if lib.cuDeviceGetCount(ctypes.byref(count)) == 0:  # initialised here: its own answer
        return count.value
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    n = nvml_device_count(spec)
    return n if n >= 0 else _count_in_child(spec)


def _libcuda() -> _Library | None:
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


def _primary(lib: _Library, device: int) -> ctypes.c_void_p:
    """``device``'s primary context (the one CuPy and the runtime use), retained once."""
    ctx = _contexts.get(device)
    if ctx is None:
        with _lock:
            ctx = _contexts.get(device)
            if ctx is None:
                _check("cuInit", lib.cuInit(0))
                dev, ctx = ctypes.c_int(), ctypes.c_void_p()
                _check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), device))
                _check("cuDevicePrimaryCtxRetain",
                       lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
                _contexts[device] = ctx
    return ctx


class Current:
    """Make ``device``'s primary context current for the driver calls inside, on any
    thread (one that never made a CUDA call has no context): pushed, and popped after,
    unless it is current already, which costs one ``cuCtxGetCurrent``."""

    __slots__ = ("device", "pushed")

    def __init__(self, device: int) -> None:
        self.device = device
        self.pushed = False

    def __enter__(self) -> _Library:
        lib = _libcuda()
        if lib is None:
            raise CudaIpcError("libcuda.so.1 is not loadable: is the NVIDIA driver installed?")
        ctx = _primary(lib, self.device)
        cur = ctypes.c_void_p()
        if lib.cuCtxGetCurrent(ctypes.byref(cur)) != 0 or cur.value != ctx.value:
            _check("cuCtxPushCurrent", lib.cuCtxPushCurrent_v2(ctx))
            self.pushed = True
        return lib

    def __exit__(self, *exc: object) -> None:
        if self.pushed:  # so libcuda was loaded (__enter__ pushed with it): not None
            self.pushed = False
            cast(_Library, _libcuda()).cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


def active_devices() -> list[int]:
    """The devices whose primary context is active in this process (CUDA initialised)."""
    lib = _libcuda()
    if lib is None:
        raise CudaIpcError("libcuda.so.1 is not loadable: is the NVIDIA driver installed?")
    count = ctypes.c_int()
    _check("cuDeviceGetCount", lib.cuDeviceGetCount(ctypes.byref(count)))
    out = []
    for device in range(count.value):
        flags, active = ctypes.c_uint(), ctypes.c_int()
        if (lib.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active))
                == 0 and active.value):
            out.append(device)
    return out


def event_handle(event: int, device: int) -> bytes:
    """The IPC handle of ``event``, a CUevent of ``device``'s primary context (as CuPy's
    are), asked under that context on any thread.  The caller must know the device: no
    call names an event's context, and asked under another the driver (580) crashes the
    process."""
    buf = ctypes.create_string_buffer(64)  # CUipcEventHandle
    with Current(device) as lib:
        _check("cuIpcGetEventHandle", lib.cuIpcGetEventHandle(buf, ctypes.c_void_p(event)))
    return buf.raw


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
