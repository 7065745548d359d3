"""shmtensor arrays between Ray tasks and actors: by reference on one host, by value across.

A shared numpy array (``shmtensor.zeros``, ``share_memory``, one received from a shmtensor
queue) or a CuPy array passed to a task or actor method, returned from one, or put with
``ray.put`` arrives, on the sender's host, as a view of the same memory (writes visible
both ways, as through shmtensor's queues); on another host, as a copy in that host's
shared memory, sent by the agent of the sender's node.  Any other array goes through Ray
as it always does.  The user does not choose.

Failures are Ray's: an array whose node died is recovered as Ray recovers any object (a
task with retries is re-run), else ``ray.get`` raises Ray's ``ObjectLostError``
(:class:`ArrayLostError` when the handle arrived but the memory went with its node).

Every process that sends arrays must have the serializers registered:

* ``shmtensor.ray.init(...)`` is ``ray.init(...)`` plus a ``worker_process_setup_hook``
  that registers them in every worker of the job, and in this process;
* ``shmtensor.ray.register()`` registers them in the calling process (for a job whose
  ``ray.init`` you do not control, call it in the task, or in your own setup hook);
* :class:`Pool` does both for its workers.

``init`` also starts the agents (one per node, ending with the job).

See docs/architecture.md ("Ray") for the design and its failure modes.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _registry
from . import _exports, _numpy
from ._host import SenderGone, host_id

if TYPE_CHECKING:
    from ray._private.worker import BaseContext

    from ._lost import ArrayLostError
    from ray.util.multiprocessing import Pool as RayPool

__all__ = ["init", "register", "runtime_env", "Pool", "host_id", "SenderGone",
           "ArrayLostError", "exports_held", "SETUP_HOOK"]

SETUP_HOOK = "shmtensor.ray._setup_worker"


def _ray() -> ModuleType:
    """Ray, imported on first use: importing shmtensor.ray needs no Ray (as shmtensor.cuda
    needs no CuPy), using it does."""
    try:
        import ray
        import ray.util
        import ray.util.multiprocessing  # noqa: F401
    except ImportError as e:
        raise ImportError("shmtensor.ray needs Ray: pip install 'shmtensor[ray]'") from e
    return ray
_lock = threading.Lock()
_registered: set[str] = set()
_watching_cupy: list[bool] = []  # after_import("cupy") asked once


def register() -> None:
    """Register shmtensor's serializers for numpy (and CuPy, once imported) arrays with
    Ray in this process.  Idempotent; needs this process connected to Ray."""
    ray = _ray()
    from . import _lost
    with _lock:
        _lost.unwrap_lost()
        if "numpy" not in _registered:
            ray.util.register_serializer(np.ndarray, serializer=_numpy.serialize,
                                         deserializer=_numpy.deserialize)
            _registered.add("numpy")
        if "cupy" not in _registered:
            if "cupy" in sys.modules:
                _register_cupy()
            elif not _watching_cupy:
                _watching_cupy.append(True)
                _registry.after_import("cupy", _cupy_imported)


def _register_cupy() -> None:
    import cupy
    ray = _ray()
    from . import _cupy
    ray.util.register_serializer(cupy.ndarray, serializer=_cupy.serialize,
                                 deserializer=_cupy.deserialize)
    _registered.add("cupy")


def _cupy_imported(_module: ModuleType) -> None:
    """Registers the CuPy serializer right after ``import cupy`` (importing CuPy up front
    would cost every worker a second)."""
    with _lock:
        if "cupy" not in _registered and _ray().is_initialized():
            _register_cupy()


def _setup_worker() -> None:
    """The ``worker_process_setup_hook`` of :func:`init`."""
    register()


# Ray kills a worker's child processes when the worker exits.  shmtensor's janitor (which
# unlinks the named segments of a creator that died, once nobody holds them) is such a
# child: killed with its worker, it leaves those names in /dev/shm.  See runtime_env.
KEEP_CHILDREN = "RAY_kill_child_processes_on_worker_exit"


def runtime_env(env: dict[str, Any] | None = None) -> dict[str, Any]:
    """``env`` (a Ray runtime_env) with shmtensor's setup hook added, and Ray's killing of
    a dead worker's child processes turned off unless ``env_vars`` sets
    ``RAY_kill_child_processes_on_worker_exit`` itself: a worker's janitor must outlive it
    to unlink its named segments (with that killing on, they stay in /dev/shm until
    ``shmtensor clean``; the default memfd strategy needs no janitor)."""
    env = dict(env or {})
    hook = env.get("worker_process_setup_hook")
    if hook is not None and hook != SETUP_HOOK:
        raise ValueError(
            f"runtime_env already has worker_process_setup_hook={hook!r}; Ray runs one hook "
            "per job: call shmtensor.ray.register() at the start of that hook instead")
    env["worker_process_setup_hook"] = SETUP_HOOK
    env_vars = dict(env.get("env_vars") or {})
    env_vars.setdefault(KEEP_CHILDREN, "false")
    env["env_vars"] = env_vars
    return env


def init(*args: Any, **kwargs: Any) -> BaseContext:
    """``ray.init`` with shmtensor's serializers registered in this process and, through
    the job's runtime_env, in every worker, and an agent started on every node (what
    reads shared arrays there for other hosts; they end with the job).  Returns what
    ``ray.init`` returns."""
    kwargs["runtime_env"] = runtime_env(kwargs.get("runtime_env"))
    info: BaseContext = _ray().init(*args, **kwargs)
    register()
    from . import _agent
    _agent.start()
    return info


def exports_held() -> int:
    """How many exports (arrays handed to Ray and still referenced) this process holds."""
    return _exports.count()


class _Init:
    """A Pool worker's initializer: registers, then runs the user's (picklable by value)."""

    def __init__(self, initializer: Callable[..., object] | None,
                 initargs: Iterable[Any] | None) -> None:
        self.initializer, self.initargs = initializer, tuple(initargs or ())

    def __call__(self) -> None:
        register()
        if self.initializer is not None:
            self.initializer(*self.initargs)


_pool_class: list[type[RayPool]] = []


def _make_pool_class() -> type[RayPool]:
    ray = _ray()

    # Ray's Pool, reached through the module _ray() returns: to mypy an unknown name, Any
    class Pool(ray.util.multiprocessing.Pool):  # type: ignore[name-defined,misc]
        """``multiprocessing.Pool``'s API on a Ray cluster (Ray's own pool of actors), with
        shmtensor arrays crossing by reference between workers on one host.

        Code written against ``shmtensor.multiprocessing.Pool`` moves to a cluster by
        changing the constructor.  ``context`` is accepted and ignored, as Ray's pool does;
        ``ray_address`` and ``ray_remote_args`` are Ray's.  When Ray is not initialized it
        is, as Ray's pool does it, through :func:`init`."""

        def __init__(self, processes: int | None = None,
                     initializer: Callable[..., object] | None = None,
                     initargs: Iterable[Any] | None = (), maxtasksperchild: int | None = None,
                     context: Any = None, ray_address: str | None = None,
                     ray_remote_args: dict[str, Any] | None = None) -> None:
            if processes is not None and processes <= 0:
                raise ValueError("Number of processes must be at least 1")
            if not ray.is_initialized():
                import os
                if ray_address is None and "RAY_ADDRESS" not in os.environ:
                    init(num_cpus=processes)
                else:
                    init(address=ray_address)
            register()
            super().__init__(processes, _Init(initializer, initargs), None, maxtasksperchild,
                             None, None, ray_remote_args)

    Pool.__module__, Pool.__qualname__ = __name__, "Pool"
    return Pool


def __getattr__(name: str) -> type[RayPool] | type[ArrayLostError]:
    if name == "Pool":  # a subclass of Ray's pool: made when first asked for
        if not _pool_class:
            _pool_class.append(_make_pool_class())
        return _pool_class[0]
    if name == "ArrayLostError":  # a Ray exception: needs Ray imported
        _ray()
        from ._lost import ArrayLostError
        return ArrayLostError
    raise AttributeError(f"module 'shmtensor.ray' has no attribute {name!r}")


if "ray" in sys.modules and sys.modules["ray"].is_initialized():
    register()  # imported in a worker (to rebuild an array): send the same way
