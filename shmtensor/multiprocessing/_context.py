"""Contexts whose Queue, Pipe, Pool and Process carry arrays through shared memory.

Each is a real ``multiprocessing`` context (a subclass of the stdlib's fork, spawn or
forkserver context) with shmtensor's factories, so it goes wherever a context is accepted.
Under spawn and forkserver a Process is pickled whole with shmtensor's reducers (its target,
arguments and a subclass's attributes; by reference as the stdlib does, by value when that
fails), and their fds go to the child with the process itself; the child needs no set-up.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context as _mpctx
import os
import sys
from multiprocessing import reduction
from typing import TYPE_CHECKING, Any, ClassVar, SupportsIndex

from .. import _reductions, _registry, _strategy, _wire
from .._connection import Pipe as _Pipe
from .. import _queues
from .._connection import Connection

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from . import _managers, _pool

    # what the mixins below are mixed into, for the type checker
    _ProcessBase = multiprocessing.process.BaseProcess
    _ContextBase = _mpctx.BaseContext
else:
    _ProcessBase = _ContextBase = object


def _forget_new_fds(popen: object) -> Callable[[], None]:
    """A function that drops the fds registered with ``popen`` from now on (the stdlib's
    spawn and forkserver popens list them in ``_fds`` as ``reduction.DupFd`` is called): a
    spawned child must get each fd once (spawn refuses a repeated one)."""
    fds = getattr(popen, "_fds", None)
    if not isinstance(fds, list):
        return lambda: None
    n = len(fds)

    def forget() -> None:
        del fds[n:]
    return forget


def _apply_settings(strategy: str | None, threshold: int | None, spin: int | None) -> None:
    """In a spawned child, as its Process is unpickled: the parent's settings (None: the
    parent's variable was bad, and the child keeps what it read from its own)."""
    if strategy is not None:
        _strategy.set_sharing_strategy(strategy)
    if threshold is not None:
        _strategy.set_inline_threshold(threshold)
    if spin is not None:
        _strategy.set_receive_spin(spin)


class _ParentSettings:
    """The sharing strategy, inline threshold and receive spin of the process that spawns a
    child: unpickled there, it applies them (a child takes its parent's settings, not its
    own environment's, and keeps them when the parent changes its own later)."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Callable[..., None], tuple[object, ...]]:
        return _apply_settings, _strategy.parent_settings()


def _rebuild_process(settings: None, data: bytes, dupfds: list[Any],
                     index: list[int]) -> _ShmProcess:
    """In a spawned child: the Process, loaded from shmtensor's pickle of it.  ``settings``
    (the parent's, see :class:`_ParentSettings`) were applied as they were unpickled.
    ``dupfds`` are the message's distinct fds and ``index`` places them: each repeat gets
    an fd of its own, as a channel's SCM_RIGHTS would give it."""
    got = [d.detach() for d in dupfds]
    fds, seen = [], set()
    for i in index:
        fds.append(os.dup(got[i]) if i in seen else got[i])
        seen.add(i)
    process: _ShmProcess = _reductions.loads(data, fds)
    return process


class _ShmProcess(_ProcessBase):
    """Sent to a spawn or forkserver child whole through shmtensor's pickler: its target,
    arguments and every attribute of a subclass, so a shared array kept on the process is
    the same memory in the child (fork needs nothing: the child has the parent's)."""

    _target: Any  # set by the stdlib's BaseProcess (annotations for the checker)
    _args: tuple[Any, ...]

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        popen = _mpctx.get_spawning_popen()
        if popen is None or getattr(_wire.current, "send", None) is not None:
            # not being spawned, or already inside shmtensor's pickler: the plain reduction
            # (class and __dict__), whose contents that pickler reduces
            return super().__reduce_ex__(protocol)
        # The stdlib's popen pickles the process: hand it to shmtensor's pickler.  By
        # reference as the stdlib pickles it, by value if that fails: a failed first try
        # may have registered fds with the popen, which a second would register again.
        data, ctx = _reductions.dumps(self, undo=_forget_new_fds(popen))
        self._shm_send = ctx  # the fds must stay open until the child has them (start())
        fds = ctx.wire_fds()
        distinct = list(dict.fromkeys(fds))  # spawn refuses an fd given twice
        # the parent's settings first: unpickled before the process, they apply in the
        # child before any channel in its state is made (a reader takes its receive spin
        # when it is made)
        return _rebuild_process, (_ParentSettings(), data,
                                  [reduction.DupFd(fd) for fd in distinct],
                                  [distinct.index(fd) for fd in fds])

    def _bootstrap(self, *args: Any, **kwargs: Any) -> int:
        # In the child, before the target runs: adapters of libraries imported by now (torch,
        # while unpickling a DataLoader worker) are installed before the first batch is made
        _registry.install_pending()
        return super()._bootstrap(*args, **kwargs)  # type: ignore[misc,no-any-return]

    def start(self) -> None:
        # A concurrent.futures worker: its executor's call queue, not yet used, becomes
        # shmtensor's (see shmtensor.futures), so task arguments cross as results do.  In
        # start, not __init__: code that calls multiprocessing.Process.__init__ on its own
        # subclass of the stdlib's Process still works.
        cfp = sys.modules.get("concurrent.futures.process")
        if cfp is not None and self._target is cfp._process_worker and self._args:
            from ..futures import adopt_call_queue
            adopt_call_queue(self._args[0])
        try:
            super().start()
        finally:
            ctx = self.__dict__.pop("_shm_send", None)
            if ctx is not None:
                ctx.release()


class ForkProcess(_ShmProcess, _mpctx.ForkProcess):
    pass


class SpawnProcess(_ShmProcess, _mpctx.SpawnProcess):
    pass


class ForkServerProcess(_ShmProcess, _mpctx.ForkServerProcess):
    pass


class _ShmContext(_ContextBase):
    """Factories of shmtensor's channels on top of a stdlib context."""

    # set by the stdlib context, and by each context below (annotations for the checker)
    _name: str
    Process: ClassVar[type[Any]]

    def Queue(self, maxsize: int = 0) -> _queues.Queue:
        """A queue of this context (see :func:`shmtensor.multiprocessing.Queue`)."""
        return _queues.Queue(maxsize, ctx=self)

    def JoinableQueue(self, maxsize: int = 0) -> _queues.JoinableQueue:
        """A joinable queue of this context (see
        :func:`shmtensor.multiprocessing.JoinableQueue`)."""
        return _queues.JoinableQueue(maxsize, ctx=self)

    def SimpleQueue(self) -> _queues.SimpleQueue:
        """A simple queue of this context (see
        :func:`shmtensor.multiprocessing.SimpleQueue`)."""
        return _queues.SimpleQueue(ctx=self)

    def Pipe(self, duplex: bool = True) -> tuple[Connection, Connection]:
        """A pair of connections (see :func:`shmtensor.multiprocessing.Pipe`)."""
        return _Pipe(duplex)

    def Pool(self, processes: int | None = None,
             initializer: Callable[..., object] | None = None, initargs: Iterable[Any] = (),
             maxtasksperchild: int | None = None) -> _pool.Pool:
        """A process pool of this context whose tasks and results cross through shared
        memory (see :func:`shmtensor.multiprocessing.Pool`)."""
        from ._pool import Pool
        return Pool(processes, initializer, initargs, maxtasksperchild, context=self)

    def Manager(self) -> _managers.SyncManager:
        """A started SyncManager of this context whose connections carry arrays through
        shared memory (see :func:`shmtensor.multiprocessing.Manager`)."""
        from ._managers import SyncManager
        m = SyncManager(ctx=self)
        m.start()
        return m

    def get_context(  # type: ignore[override]  # a shmtensor context, not the stdlib's
            self, method: str | None = None) -> _ShmContext:
        """This context (``method`` None), else :func:`get_context` of ``method``."""
        return self if method is None else get_context(method)

    def __repr__(self) -> str:
        return f"<shmtensor {self._name} context>"


class ForkContext(_ShmContext, _mpctx.ForkContext):
    """The ``"fork"`` start method's context (``multiprocessing.context.ForkContext``)
    with shmtensor's Queue, JoinableQueue, SimpleQueue, Pipe, Pool and Manager.  Get it
    with ``get_context("fork")``."""

    Process = ForkProcess


class SpawnContext(_ShmContext, _mpctx.SpawnContext):
    """The ``"spawn"`` start method's context with shmtensor's channels; its Process is
    pickled whole through shmtensor, so shared arrays in its arguments or attributes
    arrive as the same memory.  Get it with ``get_context("spawn")``."""

    Process = SpawnProcess


class ForkServerContext(_ShmContext, _mpctx.ForkServerContext):
    """The ``"forkserver"`` start method's context with shmtensor's channels, its Process
    pickled as :class:`SpawnContext`'s.  Get it with ``get_context("forkserver")``."""

    Process = ForkServerProcess


_contexts = {"fork": ForkContext(), "spawn": SpawnContext(), "forkserver": ForkServerContext()}


def get_context(method: str | None = None) -> _ShmContext:
    """A shmtensor context: a real ``multiprocessing`` context of the start method whose
    factories make shmtensor's channels.  Changes nothing global.

    :param method: ``"fork"``, ``"spawn"`` or ``"forkserver"``; None (the default) takes
        multiprocessing's current start method.
    :returns: a :class:`ForkContext`, :class:`SpawnContext` or :class:`ForkServerContext`
        (the same object on every call).
    :raises ValueError: ``method`` is unknown or not available on this platform.

    Example::

        >>> import shmtensor.multiprocessing as smp
        >>> ctx = smp.get_context("spawn")
        >>> ctx.get_start_method()
        'spawn'
    """
    if method is None:
        method = multiprocessing.get_start_method()
    try:
        ctx = _contexts[method]
    except KeyError:
        raise ValueError(f"cannot find context for {method!r}: choose one of "
                         f"{', '.join(sorted(multiprocessing.get_all_start_methods()))}") from None
    if method not in multiprocessing.get_all_start_methods():
        raise ValueError(f"start method {method!r} is not available on this platform")
    return ctx


class Process(_ShmProcess, multiprocessing.process.BaseProcess):
    """``multiprocessing.Process`` of the current start method: under spawn and
    forkserver it is pickled whole through shmtensor (a shared array among its arguments
    or attributes is the same memory in the child; a lambda target goes by value).  Same
    arguments as the stdlib's ``Process(group, target, name, args, kwargs, *, daemon)``.

    Example::

        >>> import shmtensor, shmtensor.multiprocessing as smp
        >>> a = shmtensor.zeros(3)
        >>> p = smp.Process(target=a.fill, args=(7.0,))
        >>> p.start(); p.join(60); p.exitcode
        0
        >>> a.tolist()        # the child wrote the parent's memory
        [7.0, 7.0, 7.0]
    """

    _start_method = None

    @staticmethod
    def _Popen(process_obj: multiprocessing.process.BaseProcess) -> Any:
        return get_context().Process._Popen(process_obj)

    @staticmethod
    def _after_fork() -> None:
        get_context().Process._after_fork()
