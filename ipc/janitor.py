"""The janitor: unlinks a crashed process's named segments once nobody can need them.

Named segments (the ``file_system`` strategy) outlive their creator.  The first time a
process creates one it starts a janitor: a small process in a session of its own (so a
``killpg`` or Ctrl-C of the job does not take it along), connected by a socket and given
the creator's lease table.  The creator tells it each name it creates and each it unlinks.
When the socket reaches EOF, the creator is gone, however it died; the janitor then unlinks
every remaining name as soon as nobody holds its lease (holders and messages in flight may
still attach by name until then), polling every 50-500 ms, and exits when none is left.

If the janitor itself is killed, ``shmtensor clean`` removes what it left: segments whose
creator is dead and which no live process maps.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

from . import posix_shm
from .ofd_lease import probe_held

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
                [sys.executable, "-m", __name__, str(child.fileno()),
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
        if len(cmd) >= 6 and cmd[1:3] == ["-m", __name__] and cmd[5].isdigit():
            out[int(cmd[5])] = p.info["pid"]
    return out


def _main(sock_fd: int, lease_fds: list[int]) -> None:
    names: dict[str, int] = {}
    sock = socket.socket(fileno=sock_fd)
    buf = b""
    while True:
        data = sock.recv(65536)
        if not data:
            break
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            op, rest = line[:1], line[1:].decode()
            slot, name = rest.split(" ", 1)
            if op == b"+":
                names[name] = int(slot)
            else:
                names.pop(name, None)
    delay = 0.05
    while names:
        for name, slot in list(names.items()):
            # the creator's own descriptions of its table files take no locks: they see
            # every holder's
            held = probe_held(lease_fds[slot % len(lease_fds)], slot)
            if not held or not os.path.exists(os.path.join(posix_shm.SHM_DIR, name)):
                posix_shm.unlink_named(name)
                del names[name]
        if names:
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


if __name__ == "__main__":
    _main(int(sys.argv[1]), [int(fd) for fd in sys.argv[2].split(",")])
