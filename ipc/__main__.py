"""``python -m shmtensor.ipc SOCK_FD LEASE_FDS CREATOR_PID``: the janitor process (see
:mod:`.janitor`), started by the first process that creates a named segment."""

import sys

from .janitor import _main

if len(sys.argv) < 3 or not sys.argv[1].isdecimal():
    sys.exit("python -m shmtensor.ipc is the janitor that shmtensor starts itself when a "
             "process first makes a named segment; it is not run by hand (see "
             "'shmtensor clean' to remove segments left behind)")
_main(int(sys.argv[1]), [int(fd) for fd in sys.argv[2].split(",")])
