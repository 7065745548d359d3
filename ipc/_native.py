"""The optional C extensions of the ipc layer, and the switch that turns them off.

Each extension is built from the sdist when a C compiler is at hand (setup.py; a failed
build still installs the package) and does what a pure-Python module here does, faster;
that module uses it when present.  ``SHMTENSOR_PURE_PYTHON=1`` in the environment (read
at import) makes every module ignore them: the fallback, for tests and users."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["PURE_PYTHON", "native"]

PURE_PYTHON = os.environ.get("SHMTENSOR_PURE_PYTHON", "") not in ("", "0")


def native(name: str) -> ModuleType | None:
    """The extension ``name`` of this package, or None where it was not built or
    ``SHMTENSOR_PURE_PYTHON`` is set.  (An extension that is there but fails to load
    raises: a broken build is not a missing one.)"""
    if PURE_PYTHON:
        return None
    full = f"{__package__}.{name}"
    try:
        return importlib.import_module(full)
    except ModuleNotFoundError as e:
        if e.name != full:
            raise
        return None
