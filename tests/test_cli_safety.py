"""/dev/shm is writable by every local user: what ``shmtensor ls``, ``clean``, ``leak-check``
and the janitor do with a FIFO, a symlink or a directory put there under a shmtensor-like
name (never wait on it, follow it or remove it)."""

import ctypes
import json
import os
import subprocess
import sys
import time

import pytest

from shmtensor.ipc import posix_shm

CLI = [sys.executable, "-m", "shmtensor"]
TIMEOUT = 60  # seconds: only reached when a command hangs (on a FIFO, say)

_libc = ctypes.CDLL(None, use_errno=True)
_IN_OPEN = 0x20


class OpenWatch:
    """Whether anyone opened ``path`` since the watch began (inotify's IN_OPEN)."""

    def __init__(self, path) -> None:
        self.fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            pytest.skip(f"inotify is not available: {os.strerror(ctypes.get_errno())}")
        if _libc.inotify_add_watch(self.fd, os.fsencode(path), _IN_OPEN) < 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(err, f"cannot watch {path}: {os.strerror(err)}")

    def opened(self) -> bool:
        try:
            return bool(os.read(self.fd, 4096))
        except BlockingIOError:
            return False

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture
def planted(tmp_path):
    """Under shmtensor names of a dead creator, older than clean's minimum age: a FIFO, a
    symlink to a FIFO elsewhere, a symlink to a file elsewhere, a directory.  Yields
    ({name: kind}, [watches of the two targets], the file target)."""
    tag = os.urandom(3).hex()
    fifo, file = tmp_path / "watched-fifo", tmp_path / "watched-file"
    os.mkfifo(fifo)
    file.write_text("not yours")
    kinds = {f"shmtensor_999999_{tag}_1": "fifo", f"shmtensor_999999_{tag}_2": "symlink",
             f"shmtensor_999999_{tag}_3": "symlink", f"shmtensor_999999_{tag}_4": "directory"}
    paths = [os.path.join(posix_shm.SHM_DIR, n) for n in kinds]
    watches = [OpenWatch(fifo), OpenWatch(file)]
    try:
        os.mkfifo(paths[0])
        os.symlink(fifo, paths[1])
        os.symlink(file, paths[2])
        os.mkdir(paths[3])
        old = time.time() - 60
        for p in paths:
            os.utime(p, (old, old), follow_symlinks=False)
        yield kinds, watches, file
    finally:
        for w in watches:
            w.close()
        for p in paths:
            if os.path.isdir(p) and not os.path.islink(p):
                os.rmdir(p)
            elif os.path.lexists(p):
                os.unlink(p)


def run(*args):
    r = subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode in (0, 97), f"{args}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def test_ls_clean_and_leak_check_leave_planted_files_alone(planted):
    kinds, watches, file = planted
    listing = json.loads(run("ls", "--json").stdout)
    assert not set(kinds) & {r["name"] for r in listing["segments"]}
    found = {r["name"]: r["kind"] for r in listing["not_segments"]}
    assert {n: found.get(n) for n in kinds} == kinds
    text = run("ls").stdout
    for args in (["clean", "--dry-run"], ["clean"]):
        out = run(*args).stdout
        assert all(f"not a segment: /dev/shm/{n} is a {k}" in out for n, k in kinds.items()), out
        assert all(n in text for n in kinds)
        assert not any(f"remove /dev/shm/{n}" in out for n in kinds), out
    assert run("leak-check", "--timeout", "0", "--", sys.executable, "-c", "pass").returncode == 0
    for name in kinds:  # nothing removed
        assert os.path.lexists(os.path.join(posix_shm.SHM_DIR, name)), name
    assert [w.opened() for w in watches] == [False, False]  # nothing followed
    assert file.read_text() == "not yours"


def test_leak_check_reports_a_fifo_or_symlink_the_command_left(tmp_path):
    target = tmp_path / "watched"
    os.mkfifo(target)
    watch = OpenWatch(target)
    tag = os.urandom(3).hex()
    name = f"/dev/shm/shmtensor_{{os.getpid()}}_{tag}_"  # the command's pid: its names
    leave = (f"import os; os.mkfifo(f'{name}1'); os.symlink({str(target)!r}, f'{name}2'); "
             "print(os.getpid())")
    try:
        r = run("leak-check", "--json", "--timeout", "0", "--", sys.executable, "-c", leave)
        report = json.loads(r.stdout[r.stdout.index("{"):])
        assert r.returncode == 97 and report["leaked"], r.stdout
        pid = r.stdout.split()[0]
        files = {f["name"]: f["kind"] for f in report["files"]}
        assert files == {f"shmtensor_{pid}_{tag}_1": "fifo",
                         f"shmtensor_{pid}_{tag}_2": "symlink"}, report
        assert report["segments"] == []
        assert not watch.opened()
    finally:
        watch.close()
        for name in os.listdir(posix_shm.SHM_DIR):
            if name.endswith(f"_{tag}_1") or name.endswith(f"_{tag}_2"):
                os.unlink(os.path.join(posix_shm.SHM_DIR, name))


PROBE = """
import sys
from shmtensor.ipc import janitor
locks = janitor._Locks()
for name in sys.argv[1:]:
    locks.add(name)
    assert name not in locks.fds and name not in locks.pending, name
    assert not janitor.in_use(name), name
print("ok")
"""


def test_janitor_and_in_use_probe_never_wait_on_or_follow_a_planted_name(planted):
    """A FIFO or symlink at a name (put there before its creator makes it, or under a dead
    creator's name): the janitor's lock and clean's in-use probe neither wait on it
    (forever) nor follow it."""
    kinds, watches, _ = planted
    r = subprocess.run([sys.executable, "-c", PROBE, *kinds], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr
    assert not any(w.opened() for w in watches)
