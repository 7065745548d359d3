"""Memory cgroups (Docker/Kubernetes --memory): idle shared memory is charged to the cgroup,
so it is given back as the cgroup nears its limit, and a reservation the cgroup cannot hold
is a ShmSpaceError, not an OOM kill (issue 26, item 4)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from shmtensor.ipc import shm_space

TIMEOUT = 120  # seconds: only reached when something hangs
V1 = "/sys/fs/cgroup/memory"
MiB = 1 << 20


def _can_make_v1_cgroup() -> str | None:
    """Why a memory cgroup cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root to create a memory cgroup"
    if not os.path.exists(os.path.join(V1, "memory.limit_in_bytes")):
        return f"needs the cgroup v1 memory controller at {V1}"
    return None


needs_cgroup = pytest.mark.skipif(_can_make_v1_cgroup() is not None,
                                  reason=str(_can_make_v1_cgroup()))


def _empty(cg: str, grace: float = 10.0) -> None:
    """Let the processes left in ``cg`` finish (a resource tracker unlinks its semaphores
    as it leaves), then kill what remains: only ours, the cgroup is this test's."""
    deadline = time.monotonic() + grace
    while True:
        with open(os.path.join(cg, "cgroup.procs")) as f:
            pids = [int(p) for p in f.read().split()]
        if not pids:
            return
        if time.monotonic() > deadline:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.05)


def _in_cgroup(limit: int, code: str) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``code`` in a fresh interpreter inside a new v1 memory cgroup of ``limit`` bytes;
    returns the result and the cgroup's OOM-kill count.  Every process left in the cgroup
    is killed and the cgroup removed."""
    cg = os.path.join(V1, f"shmtensor_test_{os.getpid()}")
    os.mkdir(cg)
    try:
        with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
        boot = f"import os; open({cg + '/cgroup.procs'!r}, 'w').write(str(os.getpid()))\n"
        try:
            r = subprocess.run([sys.executable, "-c", boot + textwrap.dedent(code)],
                               capture_output=True, text=True, timeout=TIMEOUT)
        finally:
            _empty(cg)
        with open(os.path.join(cg, "memory.oom_control")) as f:
            kills = dict(line.split() for line in f).get("oom_kill", "0")
        return r, int(kills)
    finally:
        for _ in range(50):
            try:
                os.rmdir(cg)
                break
            except OSError:  # the killed processes are still leaving
                time.sleep(0.1)


@needs_cgroup
def test_the_room_is_the_cgroups():
    r, _ = _in_cgroup(512 * MiB, """
        from shmtensor.ipc import shm_space
        room = shm_space.memory_room()
        print(room.limit, room.free, room.where)
    """)
    assert r.returncode == 0, r.stderr
    limit, free, where = r.stdout.split(None, 2)
    assert int(limit) == 512 * MiB and 0 < int(free) <= 512 * MiB
    assert "memory cgroup" in where and "shmtensor_test_" in where


@needs_cgroup
def test_an_array_the_cgroup_cannot_hold_is_a_ShmSpaceError_not_an_oom_kill():
    r, kills = _in_cgroup(512 * MiB, """
        import numpy as np, shmtensor
        try:
            shmtensor.empty(700 << 20, np.uint8)
        except shmtensor.ShmSpaceError as e:
            print(e)
    """)
    assert r.returncode == 0 and kills == 0, (r.returncode, kills, r.stderr)
    msg = r.stdout
    assert "memory cgroup" in msg and "700 MiB" in msg and "--memory" in msg, msg
    assert not msg.startswith("("), msg  # the message, not an (errno, text) tuple


STREAM = """
    import random, sys
    import numpy as np
    import shmtensor.multiprocessing as smp

    def consumer(q, done):
        n = 0
        while (a := q.get(timeout=30)) is not None:  # the producer OOM-killed: give up
            n += 1
            del a
        done.put(n)

    if __name__ == "__main__":
        ctx = smp.get_context("spawn")
        q, done = ctx.Queue(maxsize=1), ctx.Queue()
        p = ctx.Process(target=consumer, args=(q, done))
        p.start()
        rng = random.Random(1)
        for i in range(40):
            q.put(np.full(rng.randint(10, 100) << 20, i % 250, np.uint8))
        q.put(None)
        print("received", done.get(timeout=100))
        p.join(30)
        sys.exit(p.exitcode)
"""


@needs_cgroup
def test_a_stream_of_large_arrays_fits_a_cgroup_the_stdlib_fits(tmp_path):
    """40 arrays of 10-100 MiB, one at a time, dropped at once, in 512 MiB: the stdlib
    finishes; shmtensor was OOM-killed by the idle segments it kept for reuse."""
    script = tmp_path / "stream.py"  # spawn children import the main module from a file
    script.write_text(textwrap.dedent(STREAM))
    r, kills = _in_cgroup(512 * MiB, f"""
        import runpy, sys
        sys.argv = [{str(script)!r}]
        runpy.run_path(sys.argv[0], run_name="__main__")
    """)
    assert kills == 0, f"OOM-killed: {r.returncode} {r.stderr[-2000:]}"
    assert r.returncode == 0 and r.stdout.split() == ["received", "40"], (r.stdout, r.stderr)


# The reading itself, on made-up cgroup trees (no root needed) -------------------------------

def _fake_tree(tmp_path, monkeypatch, version: str, levels: dict[str, tuple]) -> None:
    """A cgroup mount under tmp_path with ``levels`` {relative dir: (limit, usage,
    inactive_file)}, and /proc/self/cgroup naming the innermost."""
    point = tmp_path / "cg"
    inner = max(levels, key=len)
    for rel, (limit, usage, inactive) in levels.items():
        d = point / rel if rel else point
        d.mkdir(parents=True, exist_ok=True)
        if version == "v1":
            (d / "memory.limit_in_bytes").write_text(str(limit or 9223372036854771712))
            (d / "memory.usage_in_bytes").write_text(str(usage))
            (d / "memory.stat").write_text(f"cache 0\ntotal_inactive_file {inactive}\n")
        else:
            (d / "memory.max").write_text(str(limit) if limit else "max\n")
            (d / "memory.current").write_text(str(usage))
            (d / "memory.stat").write_text(f"anon 0\ninactive_file {inactive}\n")
    fstype = "cgroup - cgroup cgroup rw,memory" if version == "v1" else "cgroup2 - cgroup2 cgroup2 rw"
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"35 31 0:32 / {point} rw,relatime {fstype.split(' ', 1)[1]}\n")
    proc = tmp_path / "cgroup"
    line = f"4:memory:/{inner}" if version == "v1" else f"0::/{inner}"
    proc.write_text(f"2:cpuacct:/\n{line}\n")
    monkeypatch.setattr(shm_space, "_MOUNTINFO", str(mountinfo))
    monkeypatch.setattr(shm_space, "_PROC_CGROUP", str(proc))
    monkeypatch.setattr(shm_space, "_mounts", None)
    monkeypatch.setattr(shm_space, "_host_available", lambda: 1 << 40)
    shm_space.forget()


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_tightest_ancestor_limit_applies(tmp_path, monkeypatch, version):
    _fake_tree(tmp_path, monkeypatch, version, {
        "": (0, 0, 0),                                  # the root: no limit
        "pod": (1024 * MiB, 900 * MiB, 100 * MiB),      # 224 MiB of room
        "pod/job": (2048 * MiB, 500 * MiB, 0),          # 1.5 GiB of room, but inside pod
    })
    room = shm_space.memory_room(-1)
    assert room.limit == 1024 * MiB and room.free == 224 * MiB
    assert room.where.endswith("pod (limit 1,024 MiB)")
    assert shm_space.shortfall(100 * MiB, False, "/dev/shm") is None
    assert shm_space.shortfall(200 * MiB, False, "/dev/shm")[0] == 224 * MiB - 64 * MiB
    shm_space.forget()


def test_no_cgroup_limit_reads_the_machine(tmp_path, monkeypatch):
    _fake_tree(tmp_path, monkeypatch, "v2", {"": (0, 0, 0), "user": (0, 10 * MiB, 0)})
    room = shm_space.memory_room(-1)
    assert room.limit is None and room.free == 1 << 40
    shm_space.forget()
