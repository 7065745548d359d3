"""``shmtensor ls`` filters (--mine, --pid PID, with and without --json), its OWNER column,
and its pid columns cut short in the table (whole in --json)."""

import json
import os
import subprocess
import sys

import pytest

from shmtensor.ipc import posix_shm

CLI = [sys.executable, "-m", "shmtensor"]
TIMEOUT = 60  # seconds: only reached when a command hangs

# Each argument is HOW:NAME, PID in NAME standing for this process's pid: "make" creates
# /dev/shm/NAME and maps it, "map" maps an existing one, "hold" keeps an fd of it open,
# "memfd" makes a memfd of that name and keeps its fd.  Then it waits for a line on stdin.
USER = """
import mmap, os, sys
keep = []
for arg in sys.argv[1:]:
    how, name = arg.split(":")
    name = name.replace("PID", str(os.getpid()))
    if how == "memfd":
        fd = os.memfd_create(name)
        os.ftruncate(fd, 4096)
        keep.append(fd)
        continue
    fd = os.open("/dev/shm/" + name, os.O_RDWR | (os.O_CREAT | os.O_EXCL if how == "make" else 0),
                 0o600)
    if how == "make":
        os.ftruncate(fd, 4096)
    if how == "hold":
        keep.append(fd)
        continue
    keep.append(mmap.mmap(fd, 4096))
    os.close(fd)
print("ready", flush=True)
sys.stdin.readline()
"""


def ls(*args):
    r = subprocess.run(CLI + ["ls", *args], capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return json.loads(r.stdout) if "--json" in args else r.stdout


class Users:
    """Processes running USER, stopped (and waited for) by close()."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, *actions: str) -> int:
        proc = subprocess.Popen([sys.executable, "-c", USER, *actions], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        self.procs.append(proc)
        assert proc.stdout.readline() == "ready\n"
        return proc.pid

    def close(self) -> None:
        for proc in self.procs:
            proc.stdin.close()  # end of input: it exits
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(TIMEOUT))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
            proc.stdout.close()
        assert codes == [0] * len(codes), codes


@pytest.fixture
def scene():
    """Files of dead creators (_2, _3, _4: made here), one process that makes _1, maps _2,
    holds _3 open and makes memfd _6, and four more that map _2.  Yields (tag, the first
    process's pid, the pids mapping _2)."""
    tag = os.urandom(3).hex()
    dead = [f"shmtensor_999999_{tag}_{i}" for i in (2, 3, 4)]
    users = Users()
    try:
        for name in dead:
            fd = os.open(os.path.join(posix_shm.SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR,
                         0o600)
            os.ftruncate(fd, 4096)
            os.close(fd)
        first = users.start(f"make:shmtensor_PID_{tag}_1", f"map:{dead[0]}", f"hold:{dead[1]}",
                            f"memfd:shmtensor_PID_{tag}_6")
        mappers = [first] + [users.start(f"map:{dead[0]}") for _ in range(4)]
        yield tag, first, sorted(mappers)
    finally:
        try:
            users.close()
        finally:
            for name in os.listdir(posix_shm.SHM_DIR):
                if f"_{tag}_" in name:
                    os.unlink(os.path.join(posix_shm.SHM_DIR, name))


def mine(listing, tag):
    return {r["name"].rsplit("_", 1)[1]: r for r in listing["segments"] if f"_{tag}_" in r["name"]}


def test_ls_pid_keeps_what_the_process_made_maps_or_holds(scene):
    tag, first, mappers = scene
    assert set(mine(ls("--json"), tag)) == {"1", "2", "3", "4", "6"}
    assert set(mine(ls("--json", "--pid", str(first)), tag)) == {"1", "2", "3", "6"}
    assert set(mine(ls("--json", "--pid", str(mappers[-1])), tag)) == {"2"}
    assert mine(ls("--json", "--pid", str(os.getpid())), tag) == {}
    text = ls("--pid", str(first))
    assert f"shmtensor_{first}_{tag}_1 " in text and f"_{tag}_4 " not in text


def test_ls_table_cuts_the_pid_columns_short_and_json_keeps_them_all(scene):
    tag, first, mappers = scene
    assert mine(ls("--json"), tag)["2"]["mapped_by"] == mappers
    row = next(line for line in ls().splitlines() if f"_{tag}_2 " in line)
    assert ",".join(map(str, mappers[:3])) + " +2 more" in row, row
    assert str(mappers[3]) not in row and str(mappers[4]) not in row


def test_ls_owner_and_mine(scene):
    tag, first, _ = scene
    rows = mine(ls("--json"), tag)
    me = os.geteuid()
    for n in ("1", "2", "6"):  # a named file, a dead creator's file, a memfd (through its fd)
        assert rows[n]["owner_uid"] == me, rows[n]
    assert rows["1"]["creator_uid"] == me and rows["2"]["creator_uid"] is None
    assert rows["6"]["kind"] == "memfd"
    assert set(mine(ls("--json", "--mine"), tag)) == {"1", "2", "3", "4", "6"}
    assert set(mine(ls("--json", "--mine", "--pid", str(first)), tag)) == {"1", "2", "3", "6"}


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_file_another_user_made_under_a_live_pids_name_shows_as_theirs():
    """A regular file named after a live process of this user (this test's), owned by
    someone else: OWNER names that user, a line says so, and --mine leaves it out."""
    other = 65534  # nobody
    name = f"shmtensor_{os.getpid()}_{os.urandom(3).hex()}_1"
    path = os.path.join(posix_shm.SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    try:
        os.chown(path, other, other)
        row = next(r for r in ls("--json")["segments"] if r["name"] == name)
        assert (row["owner_uid"], row["creator_uid"], row["creator_alive"]) == (other, 0, True)
        text = ls("--pid", str(os.getpid()))
        line = next(line for line in text.splitlines() if line.startswith(name))
        assert f" {row['owner']} " in line and row["owner"] != "root", line
        assert f"owner differs: {name} belongs to {row['owner']} (uid {other})" in text, text
        assert name not in {r["name"] for r in ls("--json", "--mine")["segments"]}
    finally:
        os.unlink(path)


def test_ls_filters_apply_to_what_is_not_a_segment():
    name = f"shmtensor_999999_{os.urandom(3).hex()}_1"
    path = os.path.join(posix_shm.SHM_DIR, name)
    os.mkfifo(path)
    try:
        assert name in {r["name"] for r in ls("--json", "--pid", "999999")["not_segments"]}
        assert name in {r["name"] for r in ls("--json", "--mine")["not_segments"]}
        assert name not in {r["name"] for r in ls("--json", "--pid", "1")["not_segments"]}
        assert f"not a segment: {path} is a fifo" in ls("--pid", "999999")
    finally:
        os.unlink(path)


def test_ls_with_nothing_matching_says_which_filter():
    pid = str(2**22 + 1)  # above the largest pid_max: no process, and no name, has it
    assert ls("--pid", pid).startswith(f"no shmtensor segments matching --pid {pid} on this")


@pytest.mark.parametrize("pid", ["0", "-3", "abc"])
def test_ls_pid_must_be_a_pid(pid):
    r = subprocess.run(CLI + ["ls", f"--pid={pid}"], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 2 and "a pid is a positive whole number" in r.stderr, r.stderr
