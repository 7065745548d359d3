"""Sharing strategies and the inline threshold: process-wide settings with set/get verbs."""

from __future__ import annotations

import os

from shmtensor.ipc.posix_shm import HAVE_MEMFD

FILE_DESCRIPTOR = "file_descriptor"
FILE_SYSTEM = "file_system"
_ALL = (FILE_DESCRIPTOR, FILE_SYSTEM) if HAVE_MEMFD else (FILE_SYSTEM,)

# Arrays smaller than this are pickled into the message; larger ones cross through a
# segment.  Measured crossover on the 2-vCPU machines, since Queue.put sends frames up to
# 64 KB itself (larger ones wait for the feeder thread): between 64 KB (inline 76 us,
# segment 86 us) and 128 KB (inline 118 us, segment 94 us), ~82 KB interpolated; see
# docs/benchmarks.md.
DEFAULT_INLINE_THRESHOLD = 80 * 1024


def _from_env(name: str, default):
    return os.environ.get(name) or default


_strategy = _from_env("SHMTENSOR_SHARING_STRATEGY", _ALL[0])
_inline_threshold = int(_from_env("SHMTENSOR_INLINE_THRESHOLD", DEFAULT_INLINE_THRESHOLD))


def get_all_sharing_strategies() -> set[str]:
    """The strategies this platform supports."""
    return set(_ALL)


def get_sharing_strategy() -> str:
    return _strategy


def set_sharing_strategy(strategy: str) -> None:
    """``file_descriptor`` (memfds passed with each message: nothing in /dev/shm, ever) or
    ``file_system`` (named /dev/shm segments, attached by name; a janitor unlinks them)."""
    global _strategy
    if strategy not in _ALL:
        raise ValueError(f"unknown sharing strategy {strategy!r}: choose one of "
                         f"{', '.join(sorted(_ALL))}")
    _strategy = strategy


def get_inline_threshold() -> int:
    return _inline_threshold


def set_inline_threshold(nbytes: int) -> None:
    """Arrays under ``nbytes`` travel inside the message; the rest through shared memory."""
    global _inline_threshold
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"inline threshold must be a non-negative int of bytes, got {nbytes!r}")
    _inline_threshold = nbytes
