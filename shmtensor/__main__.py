import sys

from shmtensor.cli import main

sys.exit(main())
