"""Connections over Unix stream sockets that carry fds with each message.

A :class:`Connection` is a real ``multiprocessing.connection.Connection`` whose bytes go in
:mod:`ipc.scm_rights` frames, so the fds a message needs travel in-band with it: no
connection back to the sender per fd, and the sender may exit as soon as it has sent.
``send``/``recv`` pickle with shmtensor's reducers; ``send_bytes``/``recv_bytes`` are
unchanged for callers.
"""

from __future__ import annotations

import io
import os
import socket
import threading
from multiprocessing import connection as _mpc
from multiprocessing import reduction

from shmtensor.ipc import scm_rights

from . import _reductions

__all__ = ["Connection", "Pipe"]

_stash = threading.local()


class Connection(_mpc.Connection):
    """A multiprocessing Connection on a Unix socket whose messages carry fds."""

    def __init__(self, handle: int, readable: bool = True, writable: bool = True) -> None:
        super().__init__(handle, readable, writable)
        self._sock = socket.socket(fileno=handle)

    def __reduce__(self):
        return _rebuild_connection, (reduction.DupFd(self.fileno()), self.readable, self.writable)

    def _close(self, _close=os.close):
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.detach()
        handle, self._handle = self._handle, None  # closed even when reached through __del__
        _close(handle)

    # bytes, as the stdlib's Connection sends them, in fd-carrying frames
    def _send_bytes(self, buf) -> None:
        scm_rights.send_frame(self._sock, buf)

    def _recv_bytes(self, maxsize=None):
        buf, fds = scm_rights.recv_frame(self._sock)
        scm_rights.close_fds(fds)
        if maxsize is not None and len(buf) > maxsize:
            raise OSError("bad message length")
        return io.BytesIO(buf)

    def send_frame(self, data, fds) -> None:
        self._check_closed()
        self._check_writable()
        scm_rights.send_frame(self._sock, data, fds)

    def try_send_frame(self, data, fds) -> bool:
        """Send now if the socket has room; False (nothing sent) if it has not."""
        self._check_closed()
        self._check_writable()
        return scm_rights.try_send_frame(self._sock, data, fds)

    def recv_frame(self):
        self._check_closed()
        self._check_readable()
        return scm_rights.recv_frame(self._sock)

    def send(self, obj) -> None:
        """Send a picklable object; arrays in it cross through shared memory."""
        data, ctx = _reductions.dumps(obj)
        try:
            self.send_frame(data, ctx.wire_fds())
        finally:
            ctx.release()

    def recv(self):
        """Receive an object sent with :meth:`send`."""
        data, fds = self.recv_frame()
        return _reductions.loads(data, fds)

    def _send_stashed(self, _pickled) -> None:
        """Send the frame a queue's feeder thread just 'pickled' (see ``_queues.Frame``)."""
        frame = _stash.__dict__.pop("frame")
        try:
            self.send_frame(frame.data, frame.ctx.wire_fds())
        finally:
            frame.ctx.release()


def _rebuild_connection(df, readable: bool, writable: bool) -> Connection:
    return Connection(df.detach(), readable, writable)


def Pipe(duplex: bool = True) -> tuple[Connection, Connection]:
    """Like ``multiprocessing.Pipe``, always over a Unix socket pair (pipes cannot carry fds)."""
    s1, s2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if duplex:
        return Connection(s1.detach()), Connection(s2.detach())
    return Connection(s1.detach(), writable=False), Connection(s2.detach(), readable=False)
