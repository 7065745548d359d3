"""The ``shmtensor`` logger, and its once-only reports of fallbacks.

A fallback is a path that works but not the way a user may expect: an array pickled by
value where a handle was possible, a plain array copied into a segment, a function sent by
value with cloudpickle.  Each kind is reported once per process, the first time it
happens (a forked child reports again); later ones cost a set lookup.  The record names
what happened, why, and what to change; ``logging.getLogger("shmtensor")`` shows them
(``logging.basicConfig(level=logging.DEBUG)`` shows all).
"""

from __future__ import annotations

NAME = "shmtensor"
DEBUG, INFO = 10, 20  # logging's levels: logging is imported by the first report, not here

_reported: set[str] = set()  # fallback kinds logged by this process


def once(kind: str, level: int, msg: str, *args: object) -> None:
    """Log ``msg % args`` at ``level`` the first time fallback ``kind`` happens here."""
    if kind in _reported:
        return
    _reported.add(kind)
    import logging
    logging.getLogger(NAME).log(level, msg, *args)


def warning(msg: str, *args: object) -> None:
    """Log ``msg % args`` as a warning (shown on stderr even where logging is not set up)."""
    import logging
    logging.getLogger(NAME).warning(msg, *args)


def reported() -> list[str]:
    """The fallback kinds reported by this process so far (a copy, sorted)."""
    return sorted(_reported)


def after_fork_in_child() -> None:
    _reported.clear()
