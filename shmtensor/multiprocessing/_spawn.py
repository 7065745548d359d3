"""``spawn(fn, args, nprocs)``: run ``fn(rank, *args)`` in several processes, fail fast.

Each child writes its traceback to an error file of its own if ``fn`` raises (a file, not a
queue, so a dying child cannot leave a half-written message behind), and dies with its
parent (``PR_SET_PDEATHSIG`` on Linux, and a thread watching the parent's sentinel).
``join`` watches every child's sentinel: on the first failure it sends SIGTERM to the
siblings, then SIGKILL after a grace period, and raises an exception carrying the rank, the
exit code or signal, and the child's traceback.  ``spawn(..., timeout=T)`` stops every rank
still running after T seconds the same way and raises :class:`ProcessTimeoutError`.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn, cast

__all__ = ["spawn", "start_processes", "ProcessContext", "ProcessException",
           "ProcessRaisedException", "ProcessExitedException", "ProcessTimeoutError"]

_PR_SET_PDEATHSIG = 1


class ProcessException(Exception):
    """A child started by :func:`spawn` failed (the base of the exceptions it raises).

    :ivar error_index: the failed child's rank.
    :ivar pid: its process id."""

    def __init__(self, msg: str, error_index: int, pid: int) -> None:
        super().__init__(msg)
        self.msg, self.error_index, self.pid = msg, error_index, pid

    def __reduce__(self) -> tuple[type[ProcessException], tuple[object, ...]]:
        return type(self), (self.msg, self.error_index, self.pid)


class ProcessRaisedException(ProcessException):
    """``fn`` raised in a child; ``str()`` holds the child's formatted traceback."""


class ProcessExitedException(ProcessException):
    """A child exited without raising: a non-zero exit code or a signal.

    :ivar exit_code: its exit code (``-N`` for signal N).
    :ivar signal_name: the signal's name (``"SIGKILL"``), or None for an exit code."""

    def __init__(self, msg: str, error_index: int, error_pid: int, exit_code: int,
                 signal_name: str | None = None) -> None:
        super().__init__(msg, error_index, error_pid)
        self.exit_code, self.signal_name = exit_code, signal_name

    def __reduce__(self) -> tuple[type[ProcessException], tuple[object, ...]]:
        return type(self), (self.msg, self.error_index, self.pid, self.exit_code,
                            self.signal_name)


class ProcessTimeoutError(ProcessException, TimeoutError):
    """Ranks still ran when :func:`spawn`'s ``timeout`` expired; they were stopped
    (SIGTERM, then SIGKILL after the grace period).  ``ranks`` and ``pids`` name them;
    ``error_index`` and ``pid`` are the first of them."""

    def __init__(self, msg: str, ranks: list[int], pids: list[int]) -> None:
        super().__init__(msg, ranks[0], pids[0])
        self.ranks, self.pids = list(ranks), list(pids)

    def __reduce__(self) -> tuple[type[ProcessException], tuple[object, ...]]:
        return type(self), (self.msg, self.ranks, self.pids)


def _die_with_parent(use_pdeathsig: bool) -> None:
    """Exit when the parent does.  PR_SET_PDEATHSIG (Linux) acts even while this process
    runs C code, but follows the parent *thread* that started us, so it is used only when
    that was the main thread; a watcher on the parent's sentinel covers every case."""
    if use_pdeathsig and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    if multiprocessing.connection.wait([parent.sentinel], 0):
        os._exit(1)  # the parent died before we could follow it

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="shmtensor-parent-watch").start()


def _wrap(fn: Callable[..., object], rank: int, args: tuple[Any, ...], error_file: str,
          use_pdeathsig: bool) -> None:
    _die_with_parent(use_pdeathsig)
    try:
        fn(rank, *args)
    except KeyboardInterrupt:
        sys.exit(130)  # interrupted: a failure, but no traceback to report
    except Exception:
        with open(error_file, "wb") as f:
            pickle.dump(traceback.format_exc(), f)
        sys.exit(1)


class ProcessContext:
    """The children of one :func:`spawn` call with ``join=False``.

    Call :meth:`join` until it returns True; :attr:`processes` are the children's
    ``Process`` objects, in rank order."""

    def __init__(self, processes: list[BaseProcess], error_files: list[str]) -> None:
        self.processes = processes
        self.error_files = error_files
        self.sentinels = {p.sentinel: rank for rank, p in enumerate(processes)}

    def pids(self) -> list[int]:
        """The children's process ids, in rank order."""
        return [int(p.pid) for p in self.processes]  # type: ignore[arg-type]  # started: a pid

    def join(self, timeout: float | None = None, grace_period: float | None = 5.0) -> bool:
        """Wait for the children.

        :param timeout: seconds to wait; None waits until every child has exited or one
            failed.
        :param grace_period: seconds the siblings of a failed child get between SIGTERM
            and SIGKILL.
        :returns: True once every child exited cleanly, False if some still run after
            ``timeout``.
        :raises ProcessRaisedException: a child's ``fn`` raised (siblings are stopped).
        :raises ProcessExitedException: a child exited non-zero or was killed by a signal
            (siblings are stopped)."""
        if not self.sentinels:
            return True
        ready = cast("list[int]",  # the sentinels it was given
                     multiprocessing.connection.wait(list(self.sentinels), timeout=timeout))
        failed = None
        for sentinel in ready:
            rank = self.sentinels.pop(sentinel)
            proc = self.processes[rank]
            proc.join()
            if proc.exitcode != 0 and failed is None:
                failed = rank
        if failed is None:
            return not self.sentinels
        self._stop_siblings(grace_period)
        self._raise(failed)

    def _stop_hung(self, timeout: float, grace_period: float | None) -> None:
        """``timeout`` expired: stop the ranks still running and raise, naming them."""
        hung = [rank for rank in sorted(self.sentinels.values())
                if self.processes[rank].is_alive()]
        self._stop_siblings(grace_period)
        if not hung:  # every one ended meanwhile: a failure among them is still reported
            for rank, p in enumerate(self.processes):
                if p.exitcode != 0:
                    self._raise(rank)
            return
        pids = [int(self.processes[rank].pid) for rank in hung]  # type: ignore[arg-type]  # started
        named = ", ".join(f"{rank} (pid {pid})" for rank, pid in zip(hung, pids))
        raise ProcessTimeoutError(
            f"spawn timed out after {timeout}s with {len(hung)} of {len(self.processes)} "
            f"process(es) still running: rank(s) {named}; they were terminated (SIGTERM, then "
            "SIGKILL after the grace period).  A rank that hangs is often waiting for a peer "
            "that failed or for a message never sent; raise timeout if they are just slow",
            hung, pids)

    def _stop_siblings(self, grace_period: float | None) -> None:
        alive = [p for p in self.processes if p.is_alive()]
        for p in alive:
            p.terminate()
        deadline = time.monotonic() + (grace_period or 0)
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in alive:
            if p.is_alive():
                p.kill()
                p.join()
        self.sentinels.clear()

    def _raise(self, rank: int) -> NoReturn:
        proc = self.processes[rank]
        path = self.error_files[rank]
        if os.path.exists(path) and os.path.getsize(path):
            with open(path, "rb") as f:
                tb = pickle.load(f)
            raise ProcessRaisedException(
                f"\n\n-- Process {rank} (pid {proc.pid}) terminated with the following error:\n{tb}",
                rank, proc.pid)  # type: ignore[arg-type]  # a started child: it has a pid
        code = cast(int, proc.exitcode)  # joined: it has exited
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:  # a real-time signal
                name = f"signal {-code}"
            raise ProcessExitedException(
                f"process {rank} (pid {proc.pid}) terminated with signal {name}",
                rank, proc.pid, code, name)  # type: ignore[arg-type]  # started: a pid
        raise ProcessExitedException(
            f"process {rank} (pid {proc.pid}) terminated with exit code {code}",
            rank, proc.pid, code)  # type: ignore[arg-type]  # started: it has a pid

    def __del__(self) -> None:
        for path in getattr(self, "error_files", ()):
            try:
                os.unlink(path)
            except OSError:
                pass


def start_processes(fn: Callable[..., object], args: Iterable[Any] = (), nprocs: int = 1,
                    join: bool = True, daemon: bool = False, start_method: str = "spawn", *,
                    timeout: float | None = None) -> ProcessContext | None:
    """:func:`spawn` under any start method (``"spawn"`` by default, ``"fork"``,
    ``"forkserver"``); the same arguments, returns and errors.

    :raises ValueError: ``nprocs < 1``, ``timeout`` not > 0, ``timeout`` with
        ``join=False``, or an unknown ``start_method``."""
    from ._context import get_context
    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, got {nprocs}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout is a number of seconds > 0, or None to wait forever; "
                         f"got {timeout!r}")
    if timeout is not None and not join:
        raise ValueError("timeout bounds the wait of join=True; with join=False, call the "
                         "returned ProcessContext's join(timeout) yourself")
    ctx = get_context(start_method)
    processes, error_files = [], []
    main_thread = threading.current_thread() is threading.main_thread()
    for rank in range(nprocs):
        fd, path = tempfile.mkstemp(prefix="shmtensor-spawn-", suffix=".err")
        os.close(fd)
        error_files.append(path)
        p = ctx.Process(target=_wrap, args=(fn, rank, tuple(args), path, main_thread),
                        daemon=daemon)
        p.start()
        processes.append(p)
    context = ProcessContext(processes, error_files)
    if not join:
        return context
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    while not context.join(None if deadline is None
                           else max(0.0, deadline - time.monotonic())):
        if timeout is not None and time.monotonic() >= start + timeout:
            context._stop_hung(timeout, grace_period=5.0)
            break
    return None


def spawn(fn: Callable[..., object], args: Iterable[Any] = (), nprocs: int = 1,
          join: bool = True, daemon: bool = False, start_method: str = "spawn", *,
          timeout: float | None = None) -> ProcessContext | None:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes (``rank`` = 0..nprocs-1),
    as ``torch.multiprocessing.spawn`` does, and fail fast.

    A child whose ``fn`` raises writes its traceback for the parent; the first failure
    stops the other ranks (SIGTERM, then SIGKILL after 5 s) and is raised here.  Children
    die with their parent.  ``fn`` may be a lambda or a closure (it then goes by value,
    with cloudpickle); shared arrays in ``args`` arrive as the same memory.

    :param fn: called as ``fn(rank, *args)`` in each child.
    :param args: the remaining arguments of ``fn``.
    :param nprocs: how many processes, >= 1.
    :param join: wait for them (True, the default), or return at once.
    :param daemon: start them as daemon processes.
    :param start_method: ``"spawn"`` (the default), ``"fork"`` or ``"forkserver"``.
    :param timeout: seconds the wait of ``join=True`` may last (None: forever); the ranks
        still running then are stopped.
    :returns: None with ``join=True``; a :class:`ProcessContext` with ``join=False``, to
        ``join(timeout)`` yourself.
    :raises ProcessRaisedException: a rank's ``fn`` raised; the message holds its
        traceback.
    :raises ProcessExitedException: a rank exited non-zero or was killed by a signal.
    :raises ProcessTimeoutError: ``timeout`` passed; it names the ranks still running.
    :raises ValueError: a bad ``nprocs``, ``timeout`` or ``start_method``.

    Example::

        >>> import shmtensor, shmtensor.multiprocessing as smp
        >>> out = shmtensor.zeros(4)
        >>> smp.spawn(lambda rank, a: a.__setitem__(rank, rank * 10), (out,), nprocs=4)
        >>> out.tolist()
        [0.0, 10.0, 20.0, 30.0]
    """
    return start_processes(fn, args, nprocs, join, daemon, start_method, timeout=timeout)
