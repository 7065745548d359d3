"""The janitor: unlinks a crashed process's named segments once nobody can need them.

Named segments (the ``file_system`` strategy) outlive their creator.  The first time a
process creates one it starts a janitor: a small process in a session of its own (so a
``killpg`` or Ctrl-C of the job does not take it along), connected by a socket and given
the creator's lease table.  The creator tells it each name it creates and each it unlinks.
When the socket reaches EOF, the creator is gone, however it died; the janitor then unlinks
every remaining name as soon as nobody holds its lease (holders and messages in flight may
still attach by name until then), polling every 50-500 ms, and exits when none is left.

While it runs, the janitor holds an OFD read lock on byte 0 of every segment it tracks
(one description each).  That is how ``shmtensor clean`` tells a segment in use from one
left behind, from any pid namespace (a sidecar, an ``--ipc=host`` container): pids and
/proc are per namespace, OFD locks on a /dev/shm file are not.  If the janitor itself is
killed, ``shmtensor clean`` removes what it left: segments nobody locks, whose creator is
dead and which no live process it can see maps.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import resource
import select

from . import posix_shm
from .ofd_lease import lock_shared, probe_held

_sock: socket.socket | None = None
_proc: subprocess.Popen | None = None
_lock = threading.Lock()


def _send(line: str) -> None:
    if _sock is None:
        return
    try:
        _sock.sendall(line.encode())
    except OSError:
        pass


def track(name: str, slot: int, lease_fds: list[int]) -> None:
    """Tell the janitor (started on first use) about a new named segment; ``lease_fds``:
    the creator's lease table files, slot ``s`` in file ``s % len(lease_fds)``."""
    global _sock, _proc
    with _lock:
        if _sock is None:
            parent, child = socket.socketpair()
            pkg_root = os.path.abspath(__file__)
            for _ in __name__.split("."):  # shmtensor/ipc/janitor.py -> the packages' root
                pkg_root = os.path.dirname(pkg_root)
            env = dict(os.environ)
            env["PYTHONPATH"] = pkg_root + os.pathsep + env.get("PYTHONPATH", "")
            _proc = subprocess.Popen(
                [sys.executable, "-m", __package__, str(child.fileno()),
                 ",".join(map(str, lease_fds)), str(os.getpid())],
                pass_fds=(child.fileno(), *lease_fds), start_new_session=True, env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True)
            child.close()
            _sock = parent
        _send(f"+{slot} {name}\n")


def untrack(name: str) -> None:
    with _lock:
        _send(f"-0 {name}\n")


def own_fds() -> set[int]:
    return {_sock.fileno()} if _sock is not None else set()


def janitor_pid() -> int | None:
    return _proc.pid if _proc is not None else None


def after_fork_in_child() -> None:
    """The child must not keep the parent's janitor waiting: close our copy of its socket."""
    global _sock, _proc, _lock
    _lock = threading.Lock()
    if _sock is not None:
        try:
            _sock.close()
        except OSError:
            pass
    _sock = None
    _proc = None


def running_janitors() -> dict[int, int]:
    """Creator pid -> pid of its live janitor, for every janitor on this machine."""
    import psutil
    out = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if len(cmd) >= 6 and cmd[1:3] == ["-m", __package__] and cmd[5].isdigit():
            out[int(cmd[5])] = p.info["pid"]
    return out


def in_use(name: str) -> bool:
    """True while a janitor holds named segment ``name`` (its creator, or a holder, may
    still need it), as seen from any pid namespace; False when nobody does or it is gone."""
    try:
        fd = os.open(os.path.join(posix_shm.SHM_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return probe_held(fd, 0)
    finally:
        os.close(fd)


class _Locks:
    """The janitor's read lock on byte 0 of each segment it tracks (see module docs).
    A name told before its file exists is locked on a later try."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}
        self.pending: set[str] = set()

    def add(self, name: str) -> None:
        try:
            fd = os.open(os.path.join(posix_shm.SHM_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self.pending.add(name)  # created right after the creator told us
            return
        except OSError:  # no fds left: clean falls back to what /proc shows
            return
        try:
            lock_shared(fd, 0)
        except OSError:
            os.close(fd)
            return
        self.pending.discard(name)
        self.fds[name] = fd

    def drop(self, name: str) -> None:
        self.pending.discard(name)
        fd = self.fds.pop(name, None)
        if fd is not None:
            os.close(fd)

    def retry(self) -> None:
        for name in list(self.pending):
            self.add(name)


def _main(sock_fd: int, lease_fds: list[int]) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:  # one fd per tracked segment: take all the fds we may
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    names: dict[str, set[int]] = {}  # a file may hold several segments (a BatchPool's)
    locks = _Locks()
    sock = socket.socket(fileno=sock_fd)
    buf = b""
    while True:
        if locks.pending:
            select.select([sock], [], [], 0.05)
            locks.retry()
            if not select.select([sock], [], [], 0)[0]:
                continue
        data = sock.recv(65536)
        if not data:
            break
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            op, rest = line[:1], line[1:].decode()
            slot, name = rest.split(" ", 1)
            if op == b"+":
                names.setdefault(name, set()).add(int(slot))
                if name not in locks.fds:
                    locks.add(name)
            else:
                names.pop(name, None)
                locks.drop(name)
    locks.retry()
    delay = 0.05
    while names:
        for name, slots in list(names.items()):
            # the creator's own descriptions of its table files take no locks: they see
            # every holder's
            held = any(probe_held(lease_fds[slot % len(lease_fds)], slot) for slot in slots)
            if not held or not os.path.exists(os.path.join(posix_shm.SHM_DIR, name)):
                posix_shm.unlink_named(name)
                locks.drop(name)
                del names[name]
        if names:
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

