"""What swaps shmtensor's drop-in into other people's test suites, and nothing else.

The suites are CPython's own: they build their test classes from mixins
(``ProcessesMixin``, ``ManagerMixin``, ``ExecutorMixin``) whose attributes are the objects
under test, and some test bodies call ``multiprocessing.X`` directly.  Both are pointed at
shmtensor: the mixins' factories, and the suite module's global ``multiprocessing`` (a
module object that is the stdlib's, with every name ``shmtensor.multiprocessing`` defines
on top).  What shmtensor does not replace (locks, events, shared ctypes, submodules) stays
the stdlib's, as in a user's program that writes ``import shmtensor.multiprocessing as mp``.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.managers
import types

import shmtensor.multiprocessing as smp

# the channel factories and contexts: the names where shmtensor's object is not the stdlib's
DROP_IN = sorted(n for n in smp.__all__
                 if getattr(smp, n) is not getattr(multiprocessing, n, None))


def overlay(base: types.ModuleType, name: str, names: dict) -> types.ModuleType:
    """A module ``name`` with ``names`` that falls back to ``base`` for everything else."""
    mod = types.ModuleType(name)
    mod.__dict__.update(names)
    mod.__getattr__ = lambda attr: getattr(base, attr)  # PEP 562
    return mod


def _shm_listener_client():
    """The Listener and Client of shmtensor's Manager.  Imported when first used, as
    ``Manager()`` imports them: importing them here would register the "shmtensor"
    serializer in every child that imports a suite, and hide that a child which did not
    import it cannot unpickle a manager proxy."""
    from shmtensor.multiprocessing import _managers
    return multiprocessing.managers.listener_client[_managers.SERIALIZER]


def Listener(*args, **kwargs):
    return _shm_listener_client()[0](*args, **kwargs)


def Client(*args, **kwargs):
    return _shm_listener_client()[1](*args, **kwargs)


def drop_in_multiprocessing() -> types.ModuleType:
    """``multiprocessing`` as ``import shmtensor.multiprocessing as multiprocessing`` sees it,
    with the stdlib's submodules (``multiprocessing.process`` ...) still reachable."""
    connection = overlay(multiprocessing.connection, "multiprocessing.connection",
                         {"Pipe": smp.Pipe, "Listener": Listener, "Client": Client})
    names = {n: getattr(smp, n) for n in DROP_IN}
    names["connection"] = connection
    return overlay(multiprocessing, "multiprocessing", names)


def processes_mixin(base: type, mp: types.ModuleType) -> type:
    """``_test_multiprocessing.ProcessesMixin`` with shmtensor's Process, channels, Pool and
    connection module (Listener/Client: the ones shmtensor's Manager talks through)."""
    return type("ProcessesMixin", (base,), {
        "Process": smp.Process,
        "connection": mp.connection,
        "Pool": staticmethod(smp.Pool),
        "Pipe": staticmethod(smp.Pipe),
        "Queue": staticmethod(smp.Queue),
        "JoinableQueue": staticmethod(smp.JoinableQueue),
        "__module__": base.__module__,
    })


def swap_into_test_multiprocessing(module: types.ModuleType) -> None:
    """Point ``test._test_multiprocessing`` at shmtensor before it builds its classes."""
    mp = drop_in_multiprocessing()
    module.ProcessesMixin = processes_mixin(module.ProcessesMixin, mp)
    module.ManagerMixin.Process = smp.Process  # its setUpClass calls mp.Manager(): shmtensor's
    module.multiprocessing = mp


def swap_into_executor_mixin(mixin: type) -> None:
    """``test_concurrent_futures``' ``ExecutorMixin``: ``mp_context`` is shmtensor's."""
    mixin.get_context = lambda self: smp.get_context(self.ctx)
