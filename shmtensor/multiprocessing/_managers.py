"""A SyncManager whose connections carry arrays through shared memory.

The stdlib looks serializers up by name in ``multiprocessing.managers.listener_client``;
shmtensor adds one named ``"shmtensor"`` (a new key: nothing that does not ask for it
changes) when this module is imported, which ``import shmtensor.multiprocessing`` does.
Over AF_UNIX its connections are shmtensor Connections; over TCP they stay ordinary ones
(fds cannot cross a network socket) and arrays are pickled by value.

A proxy keeps its serializer's name and looks it up wherever it is rebuilt, so a child that
never imported shmtensor (a stdlib Process under spawn or forkserver) would not find it.
The name is therefore a ``str`` that pickles as a call to :func:`_serializer` here: the
unpickler imports this module, which registers the name, before it rebuilds the proxy.
"""

from __future__ import annotations

from collections.abc import Callable
from multiprocessing import connection as _mpc
from multiprocessing.context import BaseContext
from typing import Any
from multiprocessing import managers as _mpm

from .._connection import Connection

__all__ = ["SERIALIZER", "SyncManager"]


class _SerializerName(str):
    """``"shmtensor"``, pickled so that loading it registers the serializer first."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Callable[[], str], tuple[()]]:
        return _serializer, ()


def _serializer() -> str:
    """The registered serializer name (importing this module registered it)."""
    return SERIALIZER


SERIALIZER = _SerializerName("shmtensor")


# The ignores below: private names of the stdlib's connection and managers modules, which
# typeshed leaves out.
def _wrap(conn: _mpc.Connection[Any, Any]) -> Connection:
    """The same socket as a shmtensor Connection (the stdlib one gives up its handle)."""
    handle, conn._handle = conn._handle, None  # type: ignore[attr-defined]
    return Connection(handle, conn.readable, conn.writable)


class _Listener(_mpc.Listener):
    def accept(self) -> _mpc.Connection[Any, Any]:
        conn = super().accept()
        if self._listener._family != "AF_UNIX":  # type: ignore[attr-defined]
            return conn
        conn = _wrap(conn)
        # The server keeps values: a plain array a client stores is the server's own copy,
        # and each read hands out a new one (shared arrays stay shared)
        conn._private = True
        return conn


def _Client(address: str | tuple[str, int], family: str | None = None,
            authkey: bytes | None = None) -> _mpc.Connection[Any, Any]:
    conn = _mpc.Client(address, family, authkey)
    return (_wrap(conn) if _mpc.address_type(address) == "AF_UNIX"  # type: ignore[attr-defined]
            else conn)


_mpm.listener_client.setdefault(SERIALIZER, (_Listener, _Client))  # type: ignore[attr-defined]


class SyncManager(_mpm.SyncManager):
    """``multiprocessing.managers.SyncManager`` with shmtensor's connections."""

    def __init__(self, address: Any = None, authkey: bytes | None = None,
                 serializer: str = SERIALIZER, ctx: BaseContext | None = None,
                 **kwargs: Any) -> None:
        if serializer == SERIALIZER:
            serializer = SERIALIZER  # the name that pickles with its registration
        super().__init__(address, authkey, serializer, ctx, **kwargs)
