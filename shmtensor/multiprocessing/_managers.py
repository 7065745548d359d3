"""A SyncManager whose connections carry arrays through shared memory.

The stdlib looks serializers up by name in ``multiprocessing.managers.listener_client``;
shmtensor adds one named ``"shmtensor"`` (a new key: nothing that does not ask for it
changes).  Over AF_UNIX its connections are shmtensor Connections; over TCP they stay
ordinary ones (fds cannot cross a network socket) and arrays are pickled by value.
"""

from __future__ import annotations

from multiprocessing import connection as _mpc
from multiprocessing import managers as _mpm

from .._connection import Connection

SERIALIZER = "shmtensor"


def _wrap(conn):
    """The same socket as a shmtensor Connection (the stdlib one gives up its handle)."""
    handle, conn._handle = conn._handle, None
    return Connection(handle, conn.readable, conn.writable)


class _Listener(_mpc.Listener):
    def accept(self):
        conn = super().accept()
        return _wrap(conn) if self._listener._family == "AF_UNIX" else conn


def _Client(address, family=None, authkey=None):
    conn = _mpc.Client(address, family, authkey)
    return _wrap(conn) if _mpc.address_type(address) == "AF_UNIX" else conn


_mpm.listener_client.setdefault(SERIALIZER, (_Listener, _Client))


class SyncManager(_mpm.SyncManager):
    """``multiprocessing.managers.SyncManager`` with shmtensor's connections."""

    def __init__(self, address=None, authkey=None, serializer=SERIALIZER, ctx=None, **kwargs):
        super().__init__(address, authkey, serializer, ctx, **kwargs)
