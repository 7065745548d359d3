"""The package's optional C extension; everything else about the build is in pyproject.toml.

``shmtensor.ipc._cring`` (ipc/_cring.c, reached through the link shmtensor/ipc) is the
ring's hot path.  It is optional: where there is no C compiler, or its build fails, the
package installs without it and runs its pure-Python path (ipc/_native.py)."""

import sys

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("shmtensor.ipc._cring", ["shmtensor/ipc/_cring.c"], optional=True,
              libraries=["pthread"],  # glibc < 2.34 keeps the mutex calls there
              extra_compile_args=["-std=gnu11", "-Wall"]),
] if sys.platform.startswith("linux") else [])
