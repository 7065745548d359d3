"""A fork while the sweeper thread is being started (from another thread of the process)
neither raises in the fork hook nor loses the sweeper."""

import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import os, sys, threading
    errors = []
    sys.unraisablehook = lambda u: errors.append(repr(u.exc_value))
    start = threading.Thread.start
    def start_with_a_fork(self):
        if self.name == "shmtensor-sweeper":  # another thread forks right now
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
        start(self)
    threading.Thread.start = start_with_a_fork
    import shmtensor
    a = shmtensor.zeros(1 << 20)
    del a
    threading.Thread.start = start
    from shmtensor import _segments
    print(errors, _segments._sweeper is not None)
""")


def test_a_fork_while_the_sweeper_starts_raises_nothing():
    r = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[] True", r.stdout + r.stderr
