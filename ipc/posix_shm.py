"""Shared-memory segments: anonymous memfds and named POSIX objects in /dev/shm.

Some facts this module is built on (Linux):

* ``memfd_create`` gives a file with no name in any directory: it lives while an fd or a
  mapping refers to it, so it cannot leak past the processes that use it, even after SIGKILL.
  Its name shows in ``/proc/PID/fd`` and ``/proc/PID/maps`` as ``/memfd:NAME (deleted)``,
  which is how tools attribute it.
* A named segment is a file on the tmpfs mounted at /dev/shm.  It outlives every process
  until someone unlinks it; :mod:`ipc.janitor` is the someone after a crash.
* tmpfs allocates pages lazily.  A store into a page that cannot be allocated kills the
  process with SIGBUS.  ``posix_fallocate`` at creation reserves every page up front, so a
  full /dev/shm becomes a Python exception here instead.
* Every name starts with ``shmtensor_<pid>_<token>_``: the creator's pid and a per-process
  random token (pids are reused), so ``shmtensor ls`` can say who made what.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys

__all__ = [
    "PREFIX", "SHM_DIR", "HAVE_MEMFD", "ShmSpaceError", "process_tag", "segment_name", "segment_key",
    "parse_name", "create_memfd", "create_named", "open_named", "unlink_named", "map_fd", "Mapping",
    "fd_limit_error",
]

PREFIX = "shmtensor"
SHM_DIR = "/dev/shm"
HAVE_MEMFD = hasattr(os, "memfd_create")
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_POPULATE_FROM = 1 << 20
_CHECK_MEMORY_FROM = 64 << 20

_tag: str | None = None

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class ShmSpaceError(MemoryError):
    """Raised when shared memory for a segment cannot be reserved (instead of a later SIGBUS)."""


def process_tag() -> str:
    """``<pid>_<token>``: names this process's segments; a fresh token after fork."""
    global _tag
    if _tag is None or not _tag.startswith(f"{os.getpid()}_"):
        _tag = f"{os.getpid()}_{os.urandom(3).hex()}"  # what secrets.token_hex does
    return _tag


def segment_name(serial: int | str) -> str:
    return f"{PREFIX}_{process_tag()}_{serial}"


def segment_key(path: str) -> str:
    """The bare name in ``/dev/shm/NAME`` or ``/memfd:NAME (deleted)`` (as /proc shows them)."""
    name = path.rsplit("/", 1)[-1]
    if name.startswith("memfd:"):
        name = name[len("memfd:"):]
    return name.split(" ", 1)[0]


def parse_name(name: str) -> tuple[int, str, str] | None:
    """``(creator_pid, token, serial)`` of a shmtensor name, or None for any other name."""
    parts = segment_key(name).split("_")
    if len(parts) != 4 or parts[0] != PREFIX or not parts[1].isdigit():
        return None
    return int(parts[1]), parts[2], parts[3]


def _mb(n: float) -> str:
    """A size for messages, in binary units (1 MiB = 2**20 bytes, as the sizes here are)."""
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 1024:,.1f} KiB"


def _space_error(size: int, named: bool, err: OSError) -> ShmSpaceError:
    free = _available(named)
    if named:
        msg = (f"{SHM_DIR} has {_mb(free)} free, this array needs {_mb(size)}: run the container "
               f"with a larger --shm-size (or remount {SHM_DIR} bigger), free space with "
               f"'shmtensor clean', or use the file_descriptor strategy")
    else:
        msg = (f"could not reserve {_mb(size)} of anonymous shared memory ({err.strerror}; about "
               f"{_mb(free)} of memory available): free memory, send smaller arrays, or raise the "
               f"memory limit of this container")
    return ShmSpaceError(errno.ENOSPC, msg)


def fd_limit_error(err: OSError, what: str) -> OSError:
    """``err`` (EMFILE/ENFILE) as an error that names the limit and the fix; others as is."""
    if err.errno not in (errno.EMFILE, errno.ENFILE):
        return err
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        n = len(os.listdir("/proc/self/fd"))
    except OSError:  # which itself needs an fd
        n = soft if err.errno == errno.EMFILE else "?"
    scope = "this process" if err.errno == errno.EMFILE else "the whole system"
    return OSError(err.errno, f"no file descriptor left for {what} ({scope}: {n} open, "
                   f"ulimit -n {soft}): raise the limit (ulimit -n, or "
                   "resource.setrlimit(RLIMIT_NOFILE)), or keep fewer received arrays, "
                   "queues and connections alive")


def _available(named: bool) -> int:
    if named:
        st = os.statvfs(SHM_DIR)  # shutil.disk_usage's free, without importing shutil
        return st.f_bavail * st.f_frsize
    try:
        import psutil
        return psutil.virtual_memory().available
    except Exception:  # psutil missing or /proc unreadable: let fallocate decide
        return 1 << 62


def _reserve(fd: int, size: int, named: bool) -> None:
    # Refuse up front what cannot fit: fallocate would first take every free page, then
    # fail.  Small segments skip the (slower) memory check: they cannot do that harm.
    if (named or size >= _CHECK_MEMORY_FROM) and size > _available(named):
        raise _space_error(size, named, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    try:
        os.ftruncate(fd, size)
        if size:
            os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM):  # EFBIG is RLIMIT_FSIZE, not space
            raise _space_error(size, named, e) from None
        raise


def create_memfd(name: str, size: int) -> int:
    """An anonymous segment of ``size`` bytes, every page reserved; returns its fd."""
    if not HAVE_MEMFD:
        raise OSError(errno.ENOSYS, "memfd_create is not available on this platform: use the "
                      "file_system sharing strategy")
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
    except OSError as e:
        raise fd_limit_error(e, "a new shared-memory segment") from None
    try:
        _reserve(fd, size, named=False)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_named(name: str, size: int) -> int:
    """A segment at /dev/shm/NAME (mode 0600, must not exist), every page reserved."""
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise fd_limit_error(e, "a new shared-memory segment") from None
    try:
        _reserve(fd, size, named=True)
    except BaseException:
        os.close(fd)
        unlink_named(name)
        raise
    return fd


def open_named(name: str) -> int:
    try:
        return os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT, f"shared-memory segment {name!r} is gone from {SHM_DIR}: its creator "
            "released it before this process attached (was the message read after every holder "
            "let go?), or something outside shmtensor removed it") from None
    except OSError as e:
        raise fd_limit_error(e, f"attaching segment {name!r}") from None


def unlink_named(name: str) -> bool:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
        return True
    except FileNotFoundError:
        return False


class Mapping:
    """A shared, writable mapping of a segment fd that keeps no fd open.

    CPython's ``mmap.mmap`` keeps a duplicate of the fd for each mapping (before 3.13's
    ``trackfd=False``), which would cost one fd per received array; this maps through libc
    instead and exposes the memory as a ctypes buffer.  ``close`` unmaps: call it only once
    nothing refers to ``buffer`` (shmtensor's anchors guarantee that).
    """

    __slots__ = ("address", "size", "buffer")

    def __init__(self, fd: int, size: int, populate: bool = False, offset: int = 0) -> None:
        flags = mmap.MAP_SHARED
        if populate and size >= _POPULATE_FROM:
            flags |= _MAP_POPULATE
        length = max(size, 1)
        addr = _libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, offset)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"cannot map a {_mb(length)} segment: {os.strerror(err)}"
                          + (" (vm.max_map_count reached? fewer live arrays, or raise it)"
                             if err == errno.ENOMEM else ""))
        self.address = addr
        self.size = length
        self.buffer = (ctypes.c_char * length).from_address(addr)

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer = None
            _libc.munmap(self.address, self.size)


def map_fd(fd: int, size: int, populate: bool = False, offset: int = 0) -> Mapping:
    """Map ``size`` bytes of ``fd`` from ``offset`` (a page multiple) shared and writable
    (at least one byte: mmap needs it)."""
    return Mapping(fd, size, populate, offset)


if sys.platform != "linux":  # pragma: no cover - documented platform limits
    SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
