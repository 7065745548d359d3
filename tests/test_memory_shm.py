"""A small /dev/shm (Docker's default 64 MiB --shm-size), file_system strategy: idle segments
are given back before a reservation fails, and the error says what applies (issue 26,
item 5).  Each test runs its program in a private mount namespace with a 64 MiB tmpfs on
/dev/shm."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

TIMEOUT = 120  # seconds: only reached when something hangs


def _why_no_private_shm() -> str | None:
    if os.geteuid() != 0:
        return "needs root to mount a private /dev/shm"
    if shutil.which("unshare") is None:
        return "needs unshare(1)"
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "true"],
                       capture_output=True, timeout=30)
    return None if r.returncode == 0 else "unshare -m is not permitted here"


_WHY = _why_no_private_shm()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=str(_WHY))


def _in_small_shm(code: str) -> subprocess.CompletedProcess:
    """``code`` (after :data:`PRELUDE`) run by a fresh interpreter that sees a 64 MiB tmpfs
    at /dev/shm (gone with its mount namespace when it exits)."""
    script = "mount -t tmpfs -o size=64m tmpfs /dev/shm && exec \"$@\""
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh",
         sys.executable, "-c", textwrap.dedent(PRELUDE) + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=TIMEOUT)


PRELUDE = """
    import numpy as np, shmtensor
    import shmtensor.multiprocessing as smp
    smp.set_sharing_strategy("file_system")
    MiB = 1 << 20
"""


def test_dropped_arrays_give_their_segments_back_before_a_new_size_fails():
    r = _in_small_shm("""
        for size in (30, 20, 40, 50, 60, 10, 60):  # each fits alone, never two of them
            a = shmtensor.zeros(size * MiB, np.uint8)
            a[-1] = 1
            del a
        small = [shmtensor.zeros(100_000, np.uint8) for _ in range(500)]  # 50 MB of slabs
        del small
        b = shmtensor.zeros(60 * MiB, np.uint8)
        del b
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.split() == ["ok"], (r.stdout, r.stderr)


def test_the_error_names_the_arrays_size_what_is_free_and_a_fix_that_applies():
    r = _in_small_shm("""
        def error(make):
            try:
                make()
            except shmtensor.ShmSpaceError as e:
                return str(e)
            raise AssertionError("no ShmSpaceError")

        print(error(lambda: shmtensor.zeros(100 * MiB, np.uint8)))
        big = shmtensor.zeros(63 * MiB, np.uint8)  # nearly all of it: no 2 MiB slab fits
        print(error(lambda: shmtensor.zeros(1000, np.uint8)))
    """)
    assert r.returncode == 0, r.stderr
    large, small = r.stdout.splitlines()
    for msg in (large, small):
        assert not msg.startswith("("), msg  # the message, not an (errno, text) tuple
        assert "/dev/shm" in msg and "--shm-size" in msg and "file_descriptor" in msg, msg
        assert "shmtensor clean" not in msg, msg  # idle segments were given back already
    assert "needs 100 MiB" in large and "64 MiB free" in large, large
    assert "needs 1,000 B" in small or "needs 1.0 KiB" in small, small
