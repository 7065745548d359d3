"""A local user who has seen one of a process's /dev/shm names cannot make its next ones
first: names of named segments carry 32 random bits, so planting files at the names that
come next in sequence does not make the process's allocations fail."""

import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import os, sys
    import shmtensor, shmtensor.multiprocessing as mp
    mp.set_sharing_strategy("file_system")
    first = shmtensor.zeros(4 << 20)                     # a segment of its own
    mine = [n for n in os.listdir("/dev/shm") if n.startswith(f"shmtensor_{os.getpid()}_")]
    print(mine[0], flush=True)
    sys.stdin.readline()                                 # the 'attacker' plants files now
    kept = [shmtensor.zeros(4 << 20) for _ in range(4)]  # new segments, not reused ones
    kept += [shmtensor.zeros(100) for _ in range(3)]     # and a slab
    print("ok", len(kept), flush=True)
""")


def test_planted_next_names_do_not_fail_allocations(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    planted = []
    try:
        seen = proc.stdout.readline().strip()
        assert seen.startswith("shmtensor_"), proc.stderr.read()
        prefix, serial = seen.rsplit("_", 1)
        slot = int(serial.split("-")[0])
        for nxt in range(slot + 1, slot + 65):  # what the next names were before
            path = f"/dev/shm/{prefix}_{nxt}"
            with open(path, "w") as f:
                f.write("planted")
            planted.append(path)
        out, err = proc.communicate("go\n", timeout=60)
        assert proc.returncode == 0, err
        assert out.strip() == "ok 7", out + err
        for path in planted:  # never opened for writing, never removed
            with open(path) as f:
                assert f.read() == "planted"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for path in planted:
            os.unlink(path)
