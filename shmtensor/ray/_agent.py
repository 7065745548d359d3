"""The per-node agents: each reads shared arrays on its node for receivers on other hosts.

A receiver on another host cannot map the sender's memory; it asks the agent of the
sender's node (an actor named ``shmtensor-agent-<job id>-<node id>`` in namespace
``shmtensor``, no CPU reserved) for the data.  The agent attaches the memory as any
receiver on that host does (the sender's export, held while the handle's pin lives, and
the receiver holds the pin while it asks, keeps the memory meanwhile), copies it into
the receiver over TCP (:mod:`._direct`; one kernel copy each side), or, where the
receiver cannot connect to it, puts them into Ray's object store on its node and hands
back the ObjectRef (Ray's own transfer).

Agents belong to the job: :func:`start` (``shmtensor.ray.init``) starts one per node as
actors of the driver, so they end with the job; a node that joins later, or a job that
did not call ``init``, gets its agent on first need, owned by the process that asked (it
ends with that process, and the next need starts another).

A fetch whose origin node died raises :class:`ArrayLostError`, an ``ObjectLostError``
naming the node; :func:`unwrap_lost` makes Ray's ``ray.get`` raise it as it is, rather
than wrapped in a ``RaySystemError`` as Ray wraps every error of a deserializer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, SupportsIndex, cast

import numpy as np

from . import _direct, _host

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle
    from typing_extensions import Buffer

    from ._cupy import CudaHandle
    from ._numpy import Handle

NAMESPACE = "shmtensor"
# How long a fetch that failed waits for Ray to say whether the origin node is dead (Ray's
# health checks decide; by default a node is declared dead within ~15 s)
NODE_VERDICT_S = 60.0
_lock = threading.Lock()


class Raw:
    """An array's bytes, by value whatever its memory (a shared array would otherwise be
    sent as a handle): one out-of-band buffer, copied into the object store, read there."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        import pickle
        a = np.ascontiguousarray(self.array)
        # an ndarray has the buffer protocol: numpy's stubs say so from Python 3.12 on only
        return _raw_rebuild, (
            pickle.PickleBuffer(a.reshape(-1).view(np.uint8)),  # type: ignore[arg-type, unused-ignore]
            a.dtype, a.shape)


def _raw_rebuild(buf: Buffer, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
    # numpy's stubs accept any buffer from Python 3.12 on only (see Raw)
    return np.frombuffer(buf, dtype).reshape(shape)  # type: ignore[call-overload, no-any-return, unused-ignore]


class Agent:
    def __init__(self) -> None:
        self._server: _direct.Server | None = None
        self._lock = threading.Lock()

    def endpoint(self) -> _direct.Endpoint:
        """Where to fetch arrays from this node directly (listening from the first ask)."""
        with self._lock:
            if self._server is None:
                self._server = _direct.Server(_direct.node_ip(), _contiguous)
            return self._server.endpoint

    def read(self, handle: Handle | CudaHandle) -> list[ObjectRef[np.ndarray]]:
        """The handle's data put into this node's object store (in a list: Ray hands an
        ObjectRef in a list back as it is, not resolved): the path when the direct one
        cannot connect."""
        import ray
        return [ray.put(Raw(_contiguous(handle)))]  # type: ignore[arg-type]  # Raw: an array

    def ping(self) -> bool:
        return True


def _contiguous(handle: Handle | CudaHandle) -> np.ndarray:
    """The handle's data on this host, C-contiguous (a view of the sender's memory when it
    is: nothing copied)."""
    from . import _cupy, _numpy
    if isinstance(handle, _cupy.CudaHandle):
        return np.ascontiguousarray(_cupy.read_for_agent(handle))
    return np.ascontiguousarray(_numpy.attach(handle))


def _name(job_id: str, node_id: str) -> str:
    return f"shmtensor-agent-{job_id}-{node_id}"


# The handles of the agents this process started.  A non-detached actor ends when its
# creator's handles are gone, so they are kept; never dropped, as an actor handle released
# while connected to a later Ray session would be counted against that session (at exit,
# after Ray's shutdown, releasing one does nothing).
_held: list[Any] = []


def _spawn(ray: Any, job_id: str, node_id: str) -> ActorHandle[Agent]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    # an actor handle (Ray's stubs also allow type[Agent])
    handle = cast("ActorHandle[Agent]", ray.remote(Agent).options(
        name=_name(job_id, node_id), namespace=NAMESPACE, get_if_exists=True,
        num_cpus=0, max_concurrency=8,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        # CuPy arrays: the agent needs the node's GPUs visible, though it reserves none
        runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
    ).remote())
    _held.append(handle)
    return handle


def _nodes() -> list[dict[str, Any]]:
    """Ray's table of nodes, dead ones included (one GCS call)."""
    import ray
    nodes: Callable[[], list[dict[str, Any]]] = ray.nodes  # untyped in Ray
    return nodes()


def start() -> int:
    """Start an agent on every alive node, as actors of this process (the driver: they end
    with the job), unless the cluster has one node (one host: no agent is needed, and a
    node that joins later gets one on first need).  Returns how many; their start is not
    waited for."""
    import ray
    job = ray.get_runtime_context().get_job_id()
    nodes = [n["NodeID"] for n in _nodes() if n.get("Alive")]
    if len(nodes) < 2:
        return 0
    with _lock:
        for node in nodes:
            _spawn(ray, job, node)
    return len(nodes)


def agent_for(node_id: str) -> ActorHandle[Agent]:
    """The agent actor of node ``node_id`` in this job (started there if it has none).

    Not cached here: a handle kept past ``ray.shutdown`` (or into another cluster) is
    stale, and one released at interpreter exit, after Ray's shutdown, ends the process
    with an error from Ray's core worker.  Looking it up is one GCS call."""
    import ray
    job = ray.get_runtime_context().get_job_id()
    try:
        return cast("ActorHandle[Agent]", ray.get_actor(_name(job, node_id), NAMESPACE))
    except ValueError:
        pass
    with _lock:  # one creation at a time in this process (get_if_exists does the rest)
        return _spawn(ray, job, node_id)


def live_agents() -> list[str]:
    """The names of the agents alive in the cluster (tests)."""
    import ray
    from ray._private import state
    table = state.state.actor_table(None)
    return sorted(a.get("Name", "") for a in table.values()
                  if a.get("Name", "").startswith("shmtensor-agent-")
                  and a.get("State") == "ALIVE")


def _node_dead(node_id: str, wait: float) -> dict[str, Any] | None:
    """Ray's record of ``node_id`` once Ray declares it dead within ``wait`` seconds, else
    None (alive)."""
    deadline = time.monotonic() + wait
    while True:
        info = next((n for n in _nodes() if n["NodeID"] == node_id), None)
        if info is None or not info.get("Alive"):
            return info or {"NodeID": node_id}
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)


_endpoints: dict[tuple[str, str], _direct.Endpoint] = {}  # (job, node) -> its agent's


def fetch_into(node_id: str, handle: Handle | CudaHandle, out: np.ndarray) -> None:
    """Copy the data of ``handle`` (sent from node ``node_id``) into ``out`` (C-contiguous,
    its shape): from that node's agent, directly (:mod:`._direct`), else through Ray's
    object store.

    Raises :class:`ArrayLostError` when that node is dead (as Ray raises ObjectLostError
    for an object stored only there) and :class:`SenderGone` when the sender exited before
    the agent attached; an agent that died alone on a live node is replaced once."""
    import ray
    from ray.exceptions import RayError, RayTaskError
    key = (ray.get_runtime_context().get_job_id(), node_id)
    for attempt in range(2):
        try:
            agent = None
            ep = _endpoints.get(key)
            if ep is None:  # asked once per process and agent (a GCS call and a Ray call)
                agent = agent_for(node_id)
                ep = _endpoints[key] = ray.get(agent.endpoint.remote())
            try:
                _direct.receive(ep, handle, out)
                return
            except _direct.Unreachable as e:
                _endpoints.pop(key, None)
                dead = _node_dead(node_id, 0.0)
                if dead is not None:
                    raise lost(node_id, dead, e) from None
            # the node lives but its agent's port is not reachable from here: Ray's way
            agent = agent or agent_for(node_id)
            refs = ray.get(agent.read.remote(handle))
            np.copyto(out, ray.get(refs[0]))
            return
        except _direct.Refused as e:  # the agent answered: the sender's error
            raise e.error from None
        except RayTaskError as e:  # the read itself failed on the agent
            cause = getattr(e, "cause", None)
            if isinstance(cause, (_host.SenderGone, _host.NotReachable)):
                raise type(cause)(*cause.args) from None
            raise
        except RayError as e:
            _endpoints.pop(key, None)
            dead = _node_dead(node_id, NODE_VERDICT_S if attempt else 0.0)
            if dead is not None:
                raise lost(node_id, dead, e) from None
            if attempt:
                raise


def lost(node_id: str, info: dict[str, Any], cause: BaseException) -> Exception:
    """The ArrayLostError for the object being deserialized, its array's node dead."""
    from ray._private import worker

    from ._lost import ArrayLostError
    context: Callable[[], Any] = worker.global_worker.get_serialization_context  # untyped
    ref = context().get_outer_object_ref()
    where = info.get("NodeManagerAddress") or "?"
    return ArrayLostError(ref.hex() if ref is not None else "?", node_id,
                          f"{where}; {type(cause).__name__}")
