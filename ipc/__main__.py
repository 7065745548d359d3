"""``python -m shmtensor.ipc``: not run by hand; the janitor (see :mod:`.janitor`) is started
by the first process that creates a named segment, isolated from its path."""

import sys

sys.exit("python -m shmtensor.ipc is the janitor that shmtensor starts itself when a "
         "process first makes a named segment; it is not run by hand (see "
         "'shmtensor clean' to remove segments left behind)")
