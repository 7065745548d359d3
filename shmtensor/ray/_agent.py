"""The per-node agent: reads a shared array on its node and sends it by value through Ray.

A receiver on another host cannot map the sender's memory; it asks the agent of the
sender's node (a detached actor named ``shmtensor-agent-<node id>`` in namespace
``shmtensor``, no CPU reserved, made on first need) for a copy.  The agent attaches the
memory as any receiver on that host does, so the sender's export (held while the handle's
pin lives, and the receiver holds the pin while it asks) keeps the memory meanwhile.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, SupportsIndex, cast

import numpy as np

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from typing_extensions import Buffer

    from ._cupy import CudaHandle
    from ._numpy import Handle

NAMESPACE = "shmtensor"
_lock = threading.Lock()


class Raw:
    """An array's bytes, sent out of band (one copy into the object store, read there)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        import pickle
        a = self.array
        # an ndarray has the buffer protocol: numpy's stubs say so from Python 3.12 on only
        return _raw_rebuild, (
            pickle.PickleBuffer(a.reshape(-1).view(np.uint8)),  # type: ignore[arg-type]
            a.dtype, a.shape)


def _raw_rebuild(buf: Buffer, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
    # numpy's stubs accept any buffer from Python 3.12 on only (see Raw)
    return np.frombuffer(buf, dtype).reshape(shape)  # type: ignore[call-overload,no-any-return]


class Agent:
    def read(self, handle: Handle | CudaHandle) -> Raw:
        from . import _cupy, _numpy
        if isinstance(handle, _cupy.CudaHandle):
            return Raw(_cupy.read_for_agent(handle))
        return Raw(_numpy.read_for_agent(handle))

    def ping(self) -> bool:
        return True


def agent_for(node_id: str) -> ActorHandle[Agent]:
    """The agent actor of node ``node_id`` (started there on first need).

    Not cached here: a handle kept past ``ray.shutdown`` (or into another cluster) is
    stale, and one released at interpreter exit, after Ray's shutdown, ends the process
    with an error from Ray's core worker.  Looking it up is one GCS call."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    with _lock:  # one creation at a time in this process (get_if_exists does the rest)
        # an actor handle (Ray's stubs also allow type[Agent])
        return cast("ActorHandle[Agent]", ray.remote(Agent).options(
            name=f"shmtensor-agent-{node_id}", namespace=NAMESPACE, get_if_exists=True,
            lifetime="detached", num_cpus=0, max_concurrency=8,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            # CuPy arrays: the agent needs the node's GPUs visible, though it reserves none
            runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
        ).remote())


def fetch(node_id: str, handle: Handle | CudaHandle) -> np.ndarray:
    """The data of ``handle`` (sent from node ``node_id``), read-only, by value."""
    import ray
    return cast("np.ndarray", ray.get(agent_for(node_id).read.remote(handle)))  # a Raw, rebuilt
