"""Leak checking for code that shares arrays between processes.

``with leak_checker() as lc:`` records the state on entry; on exit it gives asynchronous
releases a bounded time, then raises :class:`LeakError` listing every leak it finds:
shmtensor segments in /dev/shm made by the checked processes, segments made by them that
other processes still map, fds this process opened and did not close, and child processes
still alive.  ``lc.check_pid(pid)`` adds a process (a worker, a producer) to the checked set.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from dataclasses import dataclass, field
from types import TracebackType

import psutil

from shmtensor.ipc import cuda_ipc, janitor, ofd_lease, posix_shm, procfs

__all__ = ["LeakError", "leak_checker", "Leak"]


class LeakError(AssertionError):
    """Something outlived the code under :class:`leak_checker`: an ``AssertionError``, so
    a test that leaks fails.  ``str()`` lists the leaks, one a line.

    :ivar leaks: the :class:`Leak` s found."""

    def __init__(self, leaks: list["Leak"]) -> None:
        self.leaks = leaks
        lines = "\n".join(f"  - {leak}" for leak in leaks)
        super().__init__(f"{len(leaks)} leak(s) found:\n{lines}")


@dataclass
class Leak:
    """One thing :class:`leak_checker` found: ``kind`` is ``"segment"``, ``"fd"``,
    ``"process"`` or ``"cuda-export"``, ``what`` names it (``"/dev/shm/NAME"``,
    ``"pid 123"``, ``"17"``) and ``detail`` says more (size, creator, who maps it, an fd's
    target, a process's command line)."""

    kind: str          # "segment", "fd" or "process"
    what: str
    detail: dict[str, object] = field(default_factory=dict)

    def __str__(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self.detail.items())
        return f"{self.kind} {self.what}" + (f" ({extra})" if extra else "")


def _stdlib_helpers() -> tuple[set[int], set[int]]:
    """Pids and fds of multiprocessing's own per-process helpers (resource tracker,
    fork server): started once, kept for the process's lifetime, not leaks."""
    pids: set[int | None] = set()
    fds: set[int | None] = set()
    try:
        from multiprocessing import forkserver, resource_tracker
        rt = resource_tracker._resource_tracker
        pids.add(getattr(rt, "_pid", None))
        fds.add(getattr(rt, "_fd", None))
        fs = forkserver._forkserver
        pids.add(getattr(fs, "_forkserver_pid", None))
        fds.add(getattr(fs, "_forkserver_alive_fd", None))
    except Exception:  # private attributes moved: report them rather than crash
        pass
    return {p for p in pids if p is not None}, {f for f in fds if f is not None}


# fds that processes keep for their lifetime and that no test can close: /proc and
# cgroup reads in flight (a background thread's look at the memory room), and the CUDA
# driver's device nodes, IPC bookkeeping and eventfds (a context per device made during
# the check keeps them).
_NOT_LEAKS = ("/proc/", "/sys/fs/cgroup/", "/dev/nvidia", "/dev/shm/cuda.shm.")


def _fds() -> dict[int, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
    return out


class leak_checker:
    """A context manager that fails when segments, fds or child processes leak.

    On entry it records the state; on exit (unless the block raised) it collects this
    process's garbage and idle caches, gives asynchronous releases up to ``timeout``
    seconds, then raises :class:`LeakError` listing what is still there: shmtensor
    segments in /dev/shm made by the checked processes, segments made by them that other
    processes still map, fds opened and not closed (with ``check_fds``), child processes
    still alive, and CUDA exports still held.

    :param timeout: seconds to wait for releases that are still on their way.
    :param check_fds: also report fds opened in the block and not closed.

    Example::

        >>> import shmtensor
        >>> from shmtensor.testing import leak_checker
        >>> with leak_checker(timeout=5) as lc:
        ...     a = shmtensor.zeros(1 << 20)
        ...     del a
    """

    def __init__(self, timeout: float = 10.0, check_fds: bool = True) -> None:
        self.timeout = timeout
        self.check_fds = check_fds
        self.checked_pids = {os.getpid()}

    def check_pid(self, pid: int | None) -> None:
        """Also report segments made by process ``pid`` (a worker, a producer) that
        outlive the block; None is ignored, so ``lc.check_pid(p.pid)`` is safe before
        ``p.start()``."""
        if pid is not None:
            self.checked_pids.add(pid)

    def __enter__(self) -> "leak_checker":
        self._fds_before = _fds()
        self._children_before = {p.pid for p in psutil.Process().children(recursive=True)}
        self._named_before = set(procfs.named_segments())
        self._started = time.time()
        return self

    def _cleanup_local(self) -> None:
        import multiprocessing

        import shmtensor
        multiprocessing.active_children()  # reaps exited children the stdlib keeps until then
        gc.collect()
        shmtensor.empty_cache()
        if not cuda_ipc.bad_fork():  # a forked child of a CUDA parent cannot ask the driver
            shmtensor.cuda.ipc_collect()  # imports nothing CUDA until CUDA was used

    def leaks(self) -> list[Leak]:
        """What is still there now (after collecting this process's garbage and idle caches)."""
        self._cleanup_local()
        leaks: list[Leak] = []
        me = os.getpid()
        helper_pids, helper_fds = _stdlib_helpers()
        for child in psutil.Process().children(recursive=True):
            if (child.pid in self._children_before or child.pid == janitor.janitor_pid()
                    or child.pid in helper_pids):
                continue
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    continue
                leaks.append(Leak("process", f"pid {child.pid}",
                                  {"cmdline": " ".join(child.cmdline())[:120]}))
            except psutil.NoSuchProcess:
                continue
        uses = procfs.scan()
        for name, size in procfs.named_segments().items():
            parsed = posix_shm.parse_name(name)
            if (parsed is None or name in self._named_before
                    or parsed[0] not in self.checked_pids):
                continue
            use = uses.get(name)
            leaks.append(Leak("segment", f"/dev/shm/{name}", {
                "size": size, "creator": parsed[0],
                "mapped_by": sorted(use.mapped_by) if use else []}))
        for name, use in uses.items():
            parsed = posix_shm.parse_name(name)
            if (parsed is None or name.endswith("lease") or parsed[0] not in self.checked_pids
                    or parsed[0] == me):
                continue
            others = (use.mapped_by | use.fd_held_by) - {parsed[0]}
            if others and parsed[0] not in others and not psutil.pid_exists(parsed[0]):
                leaks.append(Leak("segment", f"memfd {name}", {
                    "size": use.size, "creator": f"{parsed[0]} (dead)",
                    "mapped_by": sorted(others)}))
        import shmtensor.cuda
        for ex in shmtensor.cuda.exports():
            leaks.append(Leak("cuda-export", f"device {ex['device']} block {ex['base']:#x}", {
                "size": ex["size"], "held_elsewhere": ex["held"]}))
        if self.check_fds:
            now = _fds()
            infrastructure = ofd_lease.own_fds() | janitor.own_fds() | helper_fds
            for fd, target in sorted(now.items()):
                if fd in infrastructure or self._fds_before.get(fd) == target:
                    continue
                if target.startswith(_NOT_LEAKS) or (target == "anon_inode:[eventfd]"
                                                      and "cupy" in sys.modules):
                    continue  # see _NOT_LEAKS
                leaks.append(Leak("fd", str(fd), {"target": target}))
        return leaks

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            return
        deadline = time.monotonic() + self.timeout
        delay = 0.02
        while True:
            found = self.leaks()
            if not found or time.monotonic() >= deadline:
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        if found:
            raise LeakError(found)
