"""Sharing strategies, the inline threshold and the receive spin: process-wide settings with
set/get verbs.

All start from the environment, read when shmtensor is imported.  One rule for a bad value:
only the calls that use that setting fail, with an error naming the variable and what it
accepts, until the program sets that setting itself.  Importing shmtensor, its CLI and its
pytest plugin still work, and so does every call that does not use the setting: a bad
receive spin fails the making of a channel's reader (and ``get_receive_spin()``), never
``shmtensor.zeros()``; a bad strategy fails making a shared array, not a small inline
send.  A spawned child takes its parent's good settings; a bad one it reads from the
environment it inherits, with the same rule:

* ``SHMTENSOR_SHARING_STRATEGY``: ``file_descriptor`` or ``file_system``.
* ``SHMTENSOR_INLINE_THRESHOLD``: bytes, as digits with an optional binary suffix,
  case-insensitive: ``81920``, ``80k`` / ``80KiB`` (x 1024), ``1M`` / ``1MiB``,
  ``1G`` / ``1GiB``.  Decimal units (``80KB``, ``80kB``) are refused: whether they mean
  1000 or 1024 is a guess this setting does not make.
* ``SHMTENSOR_RECEIVE_SPIN_US``: microseconds (digits, 0 to 10000) a reader polls its
  channel before it sleeps; 0 never polls.

An empty variable counts as unset.
"""

from __future__ import annotations

import operator
import os
import re
from collections.abc import Callable
from typing import SupportsIndex, TypeVar, cast

from shmtensor.ipc.posix_shm import HAVE_MEMFD
from shmtensor.ipc.scm_rights import SpinWait

_T = TypeVar("_T")

FILE_DESCRIPTOR = "file_descriptor"
FILE_SYSTEM = "file_system"
_ALL = (FILE_DESCRIPTOR, FILE_SYSTEM) if HAVE_MEMFD else (FILE_SYSTEM,)

# Arrays smaller than this are pickled into the message; larger ones cross through a
# segment.  Measured crossover on the 2-vCPU machines (2026-11-24, `scripts/bench`'s
# threshold sweep, twice): between 16 KB (inline 17-31 us, segment 31-46 us) and 64 KB
# (inline 51-52 us, segment 27-28 us), ~31-34 KB interpolated; see docs/benchmarks.md.
# (It was ~82-100 KB when the segment path took ~90 us at 64 KB.)
DEFAULT_INLINE_THRESHOLD = 32 * 1024

# The largest threshold accepted: 256 TiB, the 48-bit virtual address space of x86-64 and
# aarch64 (4-level page tables).  No array can be larger, so this value already means
# "inline everything"; anything above it can only be a unit mistake.
MAX_INLINE_THRESHOLD = 1 << 48

_SUFFIXES = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
             "g": 1 << 30, "gib": 1 << 30}
_SIZE = re.compile(r"\s*(\d+)\s*([a-z]*)\s*", re.IGNORECASE)
_SIZE_FORMS = "bytes as digits, optionally with a binary suffix: 81920, 80k, 80KiB, 1M, 1GiB"


# How long a reader (Queue.get, SimpleQueue.get, Connection.recv) polls its channel before
# it sleeps, while its previous wait was no longer (``ipc.ring.Ring.spin``,
# ``ipc.scm_rights.SpinWait``).  A writer whose reader sleeps pays the wake-up in its send,
# and a reader woken from sleep runs its receive on a cold CPU: on the 2-vCPU VMs a round
# trip of 1 KiB arrays took 2.5-3x as long with polling off.  Polling gives the CPU to any
# other runnable thread between looks (``sched_yield``), so a reader that polls takes no
# CPU from a writer that shares its CPU; it is off with one CPU, where nothing could
# write while it looks.
MAX_RECEIVE_SPIN_US = 10_000


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


DEFAULT_RECEIVE_SPIN_US = 100 if _cpus() >= 2 else 0


def _check_spin(us: int, where: str) -> int:
    if us < 0 or us > MAX_RECEIVE_SPIN_US:
        raise ValueError(f"{where}{us} is out of range: the receive spin is a whole number of "
                         f"microseconds from 0 (never poll: sleep until a message comes) to "
                         f"{MAX_RECEIVE_SPIN_US} (10 ms)")
    return us


def _strategy_error(strategy: object, where: str) -> ValueError:
    return ValueError(f"{where}{strategy!r} is not a sharing strategy: use one of "
                      f"{', '.join(_ALL)}")


def _check_threshold(nbytes: int, where: str) -> int:
    if nbytes < 0 or nbytes > MAX_INLINE_THRESHOLD:
        raise ValueError(
            f"{where}{nbytes} is out of range: the inline threshold is a non-negative number "
            f"of bytes, from 0 (every array through shared memory) to 2**48 = "
            f"{MAX_INLINE_THRESHOLD} (256 TiB, more than any array can be: every array inline)")
    return nbytes


def parse_size(text: str, where: str = "") -> int:
    """Bytes from ``81920``, ``80k``, ``80KiB``, ``1M``, ``1MiB``, ``1G``, ``1GiB``."""
    m = _SIZE.fullmatch(text)
    factor = _SUFFIXES.get(m.group(2).lower()) if m else None
    if m is None or factor is None:
        raise ValueError(f"{where}{text!r} is not a size: write {_SIZE_FORMS} "
                         f"(1k = 1024 bytes; the default is {DEFAULT_INLINE_THRESHOLD // 1024}k)")
    return _check_threshold(int(m.group(1)) * factor, where)


def _spin_from_env() -> int:
    raw = os.environ.get("SHMTENSOR_RECEIVE_SPIN_US")
    if not raw or not raw.strip():
        return DEFAULT_RECEIVE_SPIN_US
    if not raw.strip().isdecimal():  # what int() reads (isdigit() also passes '²')
        raise ValueError(f"SHMTENSOR_RECEIVE_SPIN_US={raw!r} is not a number of microseconds: "
                         f"write digits alone, from 0 (never poll) to {MAX_RECEIVE_SPIN_US}")
    return _check_spin(int(raw), "SHMTENSOR_RECEIVE_SPIN_US=")


def _strategy_from_env() -> str:
    strategy = os.environ.get("SHMTENSOR_SHARING_STRATEGY") or _ALL[0]
    if strategy not in _ALL:
        raise _strategy_error(strategy, "SHMTENSOR_SHARING_STRATEGY=")
    return strategy


def _threshold_from_env() -> int:
    raw = os.environ.get("SHMTENSOR_INLINE_THRESHOLD")
    return (parse_size(raw, "SHMTENSOR_INLINE_THRESHOLD=") if raw and raw.strip()
            else DEFAULT_INLINE_THRESHOLD)


def _from_env(name: str, read: Callable[[], _T], default: _T) -> _T:
    """The setting ``name`` from the environment, or ``default`` with its error kept in
    ``_env_errors`` for the calls that need a setting to raise."""
    try:
        return read()
    except ValueError as e:
        _env_errors[name] = e
        return default


_env_errors: dict[str, ValueError] = {}  # setting -> what is wrong with its variable
_strategy = _from_env("strategy", _strategy_from_env, _ALL[0])
_inline_threshold = _from_env("threshold", _threshold_from_env, DEFAULT_INLINE_THRESHOLD)
_receive_spin_us = _from_env("spin", _spin_from_env, DEFAULT_RECEIVE_SPIN_US)


def _raise_env_error(name: str) -> None:
    """Raise what is wrong with the variable of setting ``name`` (a fresh copy of the kept
    error, so tracebacks do not pile up on one object)."""
    raise ValueError(*_env_errors[name].args)


def describe() -> dict[str, object]:
    """The settings for :func:`shmtensor.debug_info`: each value, or its variable's error."""
    out: dict[str, object] = {}
    for key, name, value in (("strategy", "sharing_strategy", _strategy),
                             ("threshold", "inline_threshold", _inline_threshold),
                             ("spin", "receive_spin_us", _receive_spin_us)):
        error = _env_errors.get(key)
        out[name] = value if error is None else f"invalid: {error}"
    return out


def parent_settings() -> tuple[str | None, int | None, int | None]:
    """The strategy, threshold and spin a spawned child takes from this process; None
    for a setting whose variable is bad and not overridden (the child, which inherits the
    environment, reads it and fails where it uses it, as this process does)."""
    return (None if "strategy" in _env_errors else _strategy,
            None if "threshold" in _env_errors else _inline_threshold,
            None if "spin" in _env_errors else _receive_spin_us)


def get_all_sharing_strategies() -> set[str]:
    """The sharing strategies this platform supports.

    :returns: ``{"file_descriptor", "file_system"}`` where memfds exist (Linux), else
        ``{"file_system"}``.  Never raises."""
    return set(_ALL)


def get_sharing_strategy() -> str:
    """The sharing strategy new shared memory is made with (see
    :func:`set_sharing_strategy`).

    :returns: ``"file_descriptor"`` or ``"file_system"``: what the program set, else
        ``SHMTENSOR_SHARING_STRATEGY``, else ``"file_descriptor"`` where it exists.

    :raises ValueError: ``SHMTENSOR_SHARING_STRATEGY`` holds a bad value and the program has
        not set the strategy itself."""
    if "strategy" in _env_errors:
        _raise_env_error("strategy")
    return _strategy


def set_sharing_strategy(strategy: str) -> None:
    """Choose how shared memory made from now on is named and passed, for this process
    and the children it starts afterwards.

    :param strategy: ``"file_descriptor"`` (memfds passed with each message: nothing in
        /dev/shm, ever) or ``"file_system"`` (named /dev/shm segments, attached by
        name; a janitor unlinks them when their creator dies).

    :raises ValueError: ``strategy`` is not one of :func:`get_all_sharing_strategies`.

    Example::

        >>> import shmtensor
        >>> shmtensor.set_sharing_strategy("file_system")
        >>> shmtensor.get_sharing_strategy()
        'file_system'
        >>> shmtensor.set_sharing_strategy("file_descriptor")
    """
    global _strategy
    if not isinstance(strategy, str) or strategy not in _ALL:
        raise _strategy_error(strategy, "")
    _strategy = strategy
    _env_errors.pop("strategy", None)


def _whole(value: object, what: str, unit: str, fix: str) -> int:
    """``value`` as an int (numpy's integers too); a bool or a non-integer is refused."""
    if isinstance(value, bool):
        raise TypeError(f"{what} is a number of {unit}, not a bool ({value!r}): {fix}")
    try:
        return operator.index(cast(SupportsIndex, value))  # or TypeError, below
    except TypeError:
        raise TypeError(f"{what} is an int number of {unit}, got "
                        f"{type(value).__name__} {value!r}") from None


def get_inline_threshold() -> int:
    """The size in bytes from which an array that is not shared already crosses through
    shared memory (see :func:`set_inline_threshold`).

    :returns: The number of bytes: what the program set, else ``SHMTENSOR_INLINE_THRESHOLD``,
        else 32 KiB.

    :raises ValueError: ``SHMTENSOR_INLINE_THRESHOLD`` holds a bad value and the program has
        not set the threshold itself."""
    if "threshold" in _env_errors:
        _raise_env_error("threshold")
    return _inline_threshold


def set_inline_threshold(nbytes: int) -> None:
    """Send arrays under ``nbytes`` inside the message, and larger ones through shared
    memory (copied once into a segment unless they live there already).  Applies to this
    process and the children it starts afterwards.

    :param nbytes: an int (numpy's integers too) from 0 (every array through shared memory)
        to 2**48 (every array inline).

    :raises TypeError: ``nbytes`` is a bool or not an integer.
    :raises ValueError: ``nbytes`` is out of range.

    Example::

        >>> import shmtensor
        >>> shmtensor.set_inline_threshold(64 * 1024)
        >>> shmtensor.get_inline_threshold()
        65536
        >>> shmtensor.set_inline_threshold(32 * 1024)
    """
    global _inline_threshold
    nbytes = _whole(nbytes, "the inline threshold", "bytes", "pass an int such as 81920")
    _inline_threshold = _check_threshold(nbytes, "inline threshold ")
    _env_errors.pop("threshold", None)


def get_receive_spin() -> int:
    """How long a reader polls its channel before it sleeps (see
    :func:`set_receive_spin`).

    :returns: Microseconds (0: never polls): what the program set, else
        ``SHMTENSOR_RECEIVE_SPIN_US``, else 100 with 2 or more CPUs and 0 with one.

    :raises ValueError: ``SHMTENSOR_RECEIVE_SPIN_US`` holds a bad value and the program has
        not set the spin itself."""
    if "spin" in _env_errors:
        _raise_env_error("spin")
    return _receive_spin_us


def set_receive_spin(microseconds: int) -> None:
    """Set how long a reader (``Queue.get``, ``SimpleQueue.get``, ``Connection.recv``)
    polls its channel before it sleeps, while its previous wait was no longer: a writer
    then need not wake it, at the cost of the reader's CPU while it polls.

    Applies to channels opened (or received) after the call, and to the children started
    after it (each keeps what its parent had when it started).

    :param microseconds: an int from 0 (never poll) to 10000.

    :raises TypeError: ``microseconds`` is a bool or not an integer.
    :raises ValueError: ``microseconds`` is out of range."""
    global _receive_spin_us
    microseconds = _whole(microseconds, "the receive spin", "microseconds",
                          "pass an int such as 100, or 0 to turn it off")
    _receive_spin_us = _check_spin(microseconds, "receive spin ")
    _env_errors.pop("spin", None)


def receive_wait() -> SpinWait | None:
    """A new reader's way of waiting under the current setting (None: it sleeps at once)."""
    if "spin" in _env_errors:
        _raise_env_error("spin")
    return SpinWait(_receive_spin_us * 1e-6) if _receive_spin_us else None
