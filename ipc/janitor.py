"""The janitor: unlinks a crashed process's named segments once nobody can need them.

Named segments (the ``file_system`` strategy) outlive their creator.  The first time a
process creates one it starts a janitor: a small process in a session of its own (so a
``killpg`` or Ctrl-C of the job does not take it along), connected by a socket and given
the creator's lease table.  The creator tells it each name it creates and each it unlinks.
When the socket reaches EOF, the creator is gone, however it died; the janitor then unlinks
every remaining name as soon as nobody holds its lease (holders and messages in flight may
still attach by name until then), polling every 50-500 ms, and exits when none is left.

The creator keeps every name it told (and has not unlinked) in a registry here.  When a
write finds the janitor gone (killed, OOM-killed), a new one is started and told every
name in it, so what was made before the death is still cleaned after the creator's.  The
writes use ``MSG_NOSIGNAL``: a program that set SIGPIPE to its default is not killed by a
janitor's death.  A janitor killed while its creator makes no more names is noticed only
at the next one; meanwhile, and after the creator's death, ``shmtensor clean`` removes
what it left.

While it runs, the janitor holds an OFD read lock on byte 0 of every segment it tracks
(one description each).  That is how ``shmtensor clean`` tells a segment in use from one
left behind, from any pid namespace (a sidecar, an ``--ipc=host`` container): pids and
/proc are per namespace, OFD locks on a /dev/shm file are not.  If the janitor itself is
killed, ``shmtensor clean`` removes what it left: segments nobody locks, whose creator is
dead and which no live process it can see maps.  It opens only regular files owned by its
own user (see :mod:`.procfs`): a FIFO or symlink put at a name before the creator makes it
is never waited on or followed.
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

from . import posix_shm, procfs
from .ofd_lease import lock_shared, probe_held

# The janitor runs isolated (-I: no current directory, no PYTHON* variables, no user site;
# -S: no site-packages, .pth files or sitecustomize) with one entry added after the
# standard library: the folder this package was imported from.  So a module planted in the
# directory a job starts from never runs inside it (as root, for a root job), and neither
# does anything else on the job's path; the package itself and the standard library are
# all it imports.  -c, not -m: with -m the path would have to come from PYTHONPATH.
_BOOT = ("import sys; sys.path.append(sys.argv.pop(1)); "
         "from shmtensor.ipc.janitor import main; main(sys.argv[1:])")

_lock = threading.Lock()
_sock: socket.socket | None = None
_proc: subprocess.Popen[bytes] | None = None
_names: dict[str, set[int]] = {}  # the live registry: every name told and its lease slots
_lease_fds: list[int] = []


def _package_root() -> str:
    """The folder the shmtensor package was imported from (a checkout for an editable
    install, site-packages for a wheel); not resolved: shmtensor/ipc may be a link."""
    root = os.path.abspath(__file__)
    for _ in __name__.split("."):  # shmtensor/ipc/janitor.py -> the packages' root
        root = os.path.dirname(root)
    return root


def _start() -> None:
    """Start a janitor and tell it every live name (the first one, or one after the last
    died: it is not our peer any more, and what it was told is told again)."""
    global _sock, _proc
    if _proc is not None:
        _proc.poll()  # reap the dead one
    parent, child = socket.socketpair()
    try:
        _proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _BOOT, _package_root(), str(child.fileno()),
             ",".join(map(str, _lease_fds)), str(os.getpid())],
            pass_fds=(child.fileno(), *_lease_fds), start_new_session=True, cwd="/",
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True)
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    _sock = parent
    lines = "".join(f"+{slot} {name}\n" for name, slots in _names.items() for slot in slots)
    if lines:
        _sock.sendall(lines.encode(), socket.MSG_NOSIGNAL)


def _send(line: str) -> None:
    """Send ``line`` to the janitor; one that is gone (EPIPE, ECONNRESET) is replaced by a
    new one that hears every live name.  MSG_NOSIGNAL: a program that set SIGPIPE to
    SIG_DFL is not killed by a dead janitor."""
    global _sock
    if _sock is not None:
        try:
            _sock.sendall(line.encode(), socket.MSG_NOSIGNAL)
            return
        except OSError:
            _sock.close()
            _sock = None
    if _names:
        try:
            _start()
        except OSError:  # no fds or processes left: tried again at the next name
            if _sock is not None:
                _sock.close()
            _sock = None


def track(name: str, slot: int, lease_fds: list[int]) -> None:
    """Tell the janitor (started on first use) about a new named segment; ``lease_fds``:
    the creator's lease table files, slot ``s`` in file ``s % len(lease_fds)``."""
    global _lease_fds
    with _lock:
        _lease_fds = list(lease_fds)
        _names.setdefault(name, set()).add(slot)
        _send(f"+{slot} {name}\n")


def untrack(name: str) -> None:
    with _lock:
        if _names.pop(name, None) is not None:
            _send(f"-0 {name}\n")


def own_fds() -> set[int]:
    return {_sock.fileno()} if _sock is not None else set()


def janitor_pid() -> int | None:
    return _proc.pid if _proc is not None else None


def after_fork_in_child() -> None:
    """The child must not keep the parent's janitor waiting: close our copy of its socket.
    The parent's names are its janitor's, not the child's."""
    global _sock, _proc, _lock, _names, _lease_fds
    _lock = threading.Lock()
    if _sock is not None:
        try:
            _sock.close()
        except OSError:
            pass
    _sock = None
    _proc = None
    _names = {}
    _lease_fds = []


def running_janitors() -> dict[int, int]:
    """Creator pid -> pid of its live janitor, for every janitor on this machine."""
    import psutil
    out = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if _BOOT in cmd and cmd[-1].isdigit():
            out[int(cmd[-1])] = p.info["pid"]
    return out


def in_use(name: str) -> bool:
    """True while a janitor holds named segment ``name`` (its creator, or a holder, may
    still need it), as seen from any pid namespace; False when nobody does, it is gone, or
    it is not a regular file (see :mod:`.procfs`)."""
    try:
        fd = procfs.open_segment_file(name)
    except OSError:
        return False
    if fd is None:
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
            fd = procfs.open_segment_file(name, uid=os.geteuid())
        except FileNotFoundError:
            self.pending.add(name)  # created right after the creator told us
            return
        except OSError:  # no fds left: clean falls back to what /proc shows
            return
        if fd is None:  # not a file the creator made: it will not make one there
            self.pending.discard(name)
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


def main(argv: list[str]) -> None:
    """The janitor process: ``SOCK_FD LEASE_FD,LEASE_FD,... CREATOR_PID``."""
    _main(int(argv[0]), [int(fd) for fd in argv[1].split(",")])


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
        try:
            data = sock.recv(65536)
        except ConnectionResetError:  # the creator is gone all the same
            data = b""
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
            if not held or not os.path.lexists(os.path.join(posix_shm.SHM_DIR, name)):
                try:
                    posix_shm.unlink_named(name)
                except OSError:  # a directory put at a name the creator never made
                    pass
                locks.drop(name)
                del names[name]
        if names:
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

