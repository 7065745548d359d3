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
import re
import stat
import sys
from typing import cast

from . import shm_space
from .scm_rights import close_fds

__all__ = [
    "PREFIX", "SHM_DIR", "HAVE_MEMFD", "ShmSpaceError", "process_tag", "segment_name", "segment_key",
    "parse_name", "check_name", "create_memfd", "create_named", "open_named", "open_regular",
    "check_extent", "unlink_named", "map_into", "Mapping", "fd_limit_error", "space_error",
]

PREFIX = "shmtensor"
SHM_DIR = "/dev/shm"
HAVE_MEMFD = hasattr(os, "memfd_create")
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_POPULATE_FROM = 1 << 20
_NAME = re.compile(PREFIX + r"_[0-9]+_[0-9a-f]+_[0-9]+(?:-[0-9a-f]+)?")

_tag: str | None = None

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class ShmSpaceError(MemoryError):
    """Raised when shared memory for a segment cannot be reserved (instead of a later SIGBUS
    or an OOM kill).  ``needed``: the bytes asked for; ``free``: what was free."""

    errno = errno.ENOSPC

    def __init__(self, message: str, needed: int = 0, free: int = 0, named: bool = False,
                 where: str = "") -> None:
        super().__init__(message)
        self.needed, self.free, self.named, self.where = needed, free, named, where


def process_tag() -> str:
    """``<pid>_<token>``: names this process's segments; a fresh token after fork."""
    global _tag
    if _tag is None or not _tag.startswith(f"{os.getpid()}_"):
        _tag = f"{os.getpid()}_{os.urandom(3).hex()}"  # what secrets.token_hex does
    return _tag


def segment_name(serial: int | str, unguessable: bool = False) -> str:
    """``shmtensor_<pid>_<token>_<serial>``.  ``unguessable`` (names made in /dev/shm, which
    every local user can write) appends 32 random bits: a user who has seen one name cannot
    make the next one first and so make this process's allocations fail."""
    if unguessable:
        serial = f"{serial}-{os.urandom(4).hex()}"
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


def space_error(needed: int, named: bool, free: int, where: str,
                slab: int = 0) -> ShmSpaceError:
    """The error for ``needed`` bytes that do not fit in the ``free`` bytes of ``where``
    (``slab``: the size of the slab a small array was to be carved from)."""
    what = f"this array needs {_mb(needed)}" + (f" (in a {_mb(slab)} slab)" if slab else "")
    if named and where.startswith(SHM_DIR):
        fix = (f"run the container with a larger --shm-size (or remount {SHM_DIR} bigger), use "
               "the file_descriptor sharing strategy (memfds are not counted against "
               f"{SHM_DIR}), or keep fewer shared arrays alive")
    elif "cgroup" in where:
        fix = ("raise the container's memory limit (--memory), keep fewer shared arrays "
               "alive, or send smaller ones")
    else:
        fix = "free memory, keep fewer shared arrays alive, or send smaller ones"
    return ShmSpaceError(f"no room for shared memory: {where} has {_mb(free)} free and {what}"
                         f" (idle shared memory of this process was given back first): {fix}",
                         needed, free, named, where)


def fd_limit_error(err: OSError, what: str) -> OSError:
    """``err`` (EMFILE/ENFILE) as an error that names the limit and the fix; others as is."""
    if err.errno not in (errno.EMFILE, errno.ENFILE):
        return err
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    n: int | str  # "?": the count itself could not be had
    try:
        n = len(os.listdir("/proc/self/fd"))
    except OSError:  # which itself needs an fd
        n = soft if err.errno == errno.EMFILE else "?"
    scope = "this process" if err.errno == errno.EMFILE else "the whole system"
    return OSError(err.errno, f"no file descriptor left for {what} ({scope}: {n} open, "
                   f"ulimit -n {soft}): raise the limit (ulimit -n, or "
                   "resource.setrlimit(RLIMIT_NOFILE)), or keep fewer received arrays, "
                   "queues and connections alive")


def _reserve(fd: int, size: int, named: bool) -> None:
    # Refuse up front what cannot fit: under a cgroup limit fallocate would not fail but
    # call the OOM killer, and on a full tmpfs it first takes every free page.
    short = shm_space.shortfall(size, named, SHM_DIR) if size else None
    if short is not None:
        raise space_error(size, named, *short)
    try:
        os.ftruncate(fd, size)
        if size:
            os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM):  # EFBIG is RLIMIT_FSIZE, not space
            shm_space.forget()
            # 1 << 62 bytes never fit: a (free, where) pair, never None
            free, where = cast("tuple[int, str]", shm_space.shortfall(1 << 62, named, SHM_DIR))
            raise space_error(size, named, free, where) from None
        raise
    shm_space.note_reserved(size)


def create_memfd(name: str, size: int) -> int:
    """An anonymous segment of ``size`` bytes, every page reserved; returns its fd."""
    if not HAVE_MEMFD:
        raise OSError(errno.ENOSYS, "memfd_create is not available on this platform: use the "
                      "file_system sharing strategy")
    # the fd, stored by the C calls that open it (extend of a map: no signal handler runs
    # between the open and the store), so an exception raised anywhere after finds it here
    made: list[int] = []
    try:
        try:
            made.extend(map(os.memfd_create, (name,), (os.MFD_CLOEXEC,)))
        except OSError as e:
            raise fd_limit_error(e, "a new shared-memory segment") from None
        _reserve(made[0], size, named=False)
    except BaseException:
        close_fds(made)
        raise
    return made[0]


def create_named(name: str, size: int) -> int:
    """A segment at /dev/shm/NAME (mode 0600, must not exist), every page reserved."""
    path = os.path.join(SHM_DIR, name)
    made: list[int] = []
    try:
        try:
            made.extend(map(os.open, (path,),
                            (os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,), (0o600,)))
        except OSError as e:
            raise fd_limit_error(e, "a new shared-memory segment") from None
        _reserve(made[0], size, named=True)
    except BaseException:
        if made:  # created here (O_EXCL): ours to remove
            close_fds(made)
            unlink_named(name)
        raise
    return made[0]



def check_name(name: str) -> str:
    """``name`` itself when it is a segment name of ours (never a path), else ValueError."""
    if type(name) is not str or not _NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a shmtensor segment name ({PREFIX}_PID_TOKEN_SERIAL):"
                         " a corrupt or forged message; nothing was opened")
    return name


def open_regular(path: str, flags: int, out: list[int] | None = None) -> int:
    """``path`` opened with ``flags`` without following a symlink or blocking on a FIFO,
    and only if it is a regular file (anything else raises OSError, nothing left open).
    ``out``: the caller's list, which the fd joins in the step that opens it (C from the
    open to the store), so an exception a signal handler raises finds it there, for the
    caller to close; an fd refused leaves the list as -1."""
    made: list[int] = [] if out is None else out
    i = len(made)
    made.extend(map(os.open, (path,), (flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,)))
    fd = made[i]
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file: not a segment")
    except BaseException:
        made[i] = -1; os.close(fd)  # noqa: E702 (one line: given up and closed together)
        raise
    return fd


def open_named(name: str, out: list[int] | None = None) -> int:
    """The segment /dev/shm/NAME opened read-write (``name`` checked: never a path);
    ``out`` as :func:`open_regular`'s."""
    path = os.path.join(SHM_DIR, check_name(name))
    try:
        return open_regular(path, os.O_RDWR, out)
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT, f"shared-memory segment {name!r} is gone from {SHM_DIR}: its creator "
            "released it before this process attached (was the message read after every holder "
            "let go?), or something outside shmtensor removed it") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(e.errno, f"{path} is a symbolic link, not a segment: not "
                          "followed") from None
        raise fd_limit_error(e, f"attaching segment {name!r}") from None


def check_extent(fd: int, offset: int, size: int, key: str) -> None:
    """Refuse to map ``size`` bytes at ``offset`` of ``fd`` unless the file is a regular
    one that holds them: mapped past its end, the first read would be a SIGBUS."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"segment {key!r} came with an fd that is not a shared-memory file: "
                         "a corrupt or forged message; not mapped")
    if size < 0 or offset < 0 or offset % mmap.PAGESIZE or offset + size > st.st_size:
        raise ValueError(f"segment {key!r}: the message says {size} bytes at offset {offset}, "
                         f"its file holds {st.st_size}: a corrupt or forged message; not mapped")


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
    instead and exposes the memory as a ctypes buffer.  Made by :func:`map_into`.
    ``close`` unmaps: call it only once nothing refers to ``buffer`` (shmtensor's anchors
    guarantee that).
    """

    __slots__ = ("address", "size", "buffer")

    address: int | None
    size: int
    buffer: ctypes.Array[ctypes.c_char] | None

    def close(self) -> None:
        """Unmap (once: a second call, or one on a mapping whose ``mmap`` failed or never
        ran, does nothing)."""
        address = self.address
        if address:
            self.address = self.buffer = None
            _libc.munmap(address, self.size)


def map_into(out: list[Mapping], fd: int, size: int, populate: bool = False,
             offset: int = 0) -> Mapping:
    """Map ``size`` bytes of ``fd`` from ``offset`` (a page multiple) shared and writable
    (at least one byte: mmap needs it), appending the mapping to ``out`` before it maps:
    the address is stored by the step that maps (libc's ``mmap`` called and its result set
    on the mapping from C, with no point between where a signal handler runs), so an
    exception raised anywhere finds the mapping in ``out``, for its owner to close."""
    m = Mapping.__new__(Mapping)
    m.address, m.size, m.buffer = None, max(size, 1), None
    out.append(m)
    flags = mmap.MAP_SHARED
    if populate and size >= _POPULATE_FROM:
        flags |= _MAP_POPULATE
    any(map(setattr, (m,), ("address",), map(
        _libc.mmap, (None,), (m.size,), (mmap.PROT_READ | mmap.PROT_WRITE,), (flags,),
        (fd,), (offset,))))
    if m.address in (None, _MAP_FAILED):
        m.address = None
        err = ctypes.get_errno()
        raise OSError(err, f"cannot map a {_mb(m.size)} segment: {os.strerror(err)}"
                      + (" (vm.max_map_count reached? fewer live arrays, or raise it)"
                         if err == errno.ENOMEM else ""))
    m.buffer = (ctypes.c_char * m.size).from_address(m.address)
    return m


if sys.platform != "linux":  # pragma: no cover - documented platform limits
    SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
