"""Which host this process is on, and reaching another process's fds on it.

Two processes share memory by name or through ``/proc/PID/fd`` only when they run on one
kernel, with one /dev/shm, in one pid namespace: the host identity is those four facts
(hostname, boot id, pid namespace, /dev/shm device).  ``SHMTENSOR_RAY_HOST`` replaces it
(read once per process): tests give one Ray node of this machine another identity so
that it behaves as a second host.
"""

from __future__ import annotations

import os
import socket

ENV = "SHMTENSOR_RAY_HOST"
_host: list[str] = []


def host_id() -> str:
    """This process's host identity (see the module docstring)."""
    if not _host:
        override = os.environ.get(ENV)
        if override:
            _host.append(override)
        else:
            parts = [socket.gethostname()]
            try:
                with open("/proc/sys/kernel/random/boot_id") as f:
                    parts.append(f.read().strip())
            except OSError:
                parts.append("?")
            for path in ("/proc/self/ns/pid", "/dev/shm"):
                try:
                    st = os.stat(path)
                    parts.append(f"{st.st_dev}:{st.st_ino}")
                except OSError:
                    parts.append("?")
            _host.append("/".join(parts))
    return _host[0]


class SenderGone(RuntimeError):
    """The process that sent an array through Ray has exited before this receiver
    attached, and its hold on the memory went with it."""


class NotReachable(OSError):
    """The sender's fds are not reachable from here (another pid namespace, no permission
    to read /proc/PID/fd): the data must come by value."""


def open_peer_fd(pid: int, fd: int, expect: str, flags: int = os.O_RDWR) -> int:
    """A new description of the file behind fd ``fd`` of process ``pid``, checked to be
    ``expect`` (a substring of what ``/proc/self/fd`` shows for it): a recycled pid or fd
    number is refused rather than attached."""
    try:
        new = os.open(f"/proc/{pid}/fd/{fd}", flags | os.O_CLOEXEC)
    except FileNotFoundError:
        if os.path.exists(f"/proc/{pid}"):
            raise SenderGone(f"process {pid} no longer has the fd that held this array "
                             "(it let go of it: the Ray reference was released)") from None
        raise SenderGone(f"process {pid} has exited") from None
    except PermissionError as e:
        raise NotReachable(e.errno, f"cannot open /proc/{pid}/fd/{fd}: {e.strerror}") from None
    try:
        target = os.readlink(f"/proc/self/fd/{new}")
    except OSError:
        target = ""
    if expect not in target:
        os.close(new)
        raise SenderGone(f"fd {fd} of process {pid} is now {target!r}, not {expect!r}: the "
                         "sender exited or let go, and the number was reused")
    return new
