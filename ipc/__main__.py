"""``python -m shmtensor.ipc SOCK_FD LEASE_FDS CREATOR_PID``: the janitor process (see
:mod:`.janitor`), started by the first process that creates a named segment."""

import sys

from .janitor import _main

_main(int(sys.argv[1]), [int(fd) for fd in sys.argv[2].split(",")])
