"""The direct path between hosts: an agent sends an array's bytes to a receiver over TCP.

Each agent listens on its node's IP (an ephemeral port) once asked for its endpoint: the
address, the port and a random token, handed out through a Ray actor call (so only
those who may call the job's actors learn it).  A receiver connects, sends the token and
the handle; the agent attaches the memory (a view: nothing copied on its side) and
answers a status and the byte count, then the bytes, which the receiver reads straight
into its destination (a shared segment of its own host).  One kernel copy each side:
Ray's object transfer copies into the sender's object store, sends in chunks and writes
the receiver's store.

Request: the 16-byte token, then ``!I`` length and the pickled handle (at most
``MAX_REQUEST`` bytes; nothing is read past a wrong token, nothing unpickled before the
token matched).  Answer: ``!BQ`` (status, length), then ``length`` bytes: the data (status
0) or a pickled ``(error name, message)`` (status 1: the sender is gone, its fds are not
reachable, or reading failed otherwise).  An agent serves ``MAX_CONNECTIONS`` connections
at a time (the rest wait in the listen backlog), and drops one that has not sent its
request within ``REQUEST_S``.
"""

from __future__ import annotations

import hmac
import pickle
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from . import _host

ANSWER = struct.Struct("!BQ")
REQUEST = struct.Struct("!I")
TOKEN_BYTES = 16
MAX_REQUEST = 64 << 10  # a handle is a few hundred bytes
MAX_CONNECTIONS = 32
CONNECT_S = 10.0   # to connect to an agent
REQUEST_S = 5.0    # for a peer to send its whole request
IDLE_S = 60.0      # without a byte from the other side, once connected
SOCKET_BUFFER = 4 << 20


class Endpoint(NamedTuple):
    ip: str
    port: int
    token: bytes


class Unreachable(OSError):
    """The agent could not be reached, or the connection broke: its node may be dead."""


class Refused(Exception):
    """The agent answered, with the sender's error (``error``: re-raised as it is)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


_ERRORS: dict[str, type[Exception]] = {"SenderGone": _host.SenderGone,
                                       "NotReachable": _host.NotReachable}


def _bytes_of(a: np.ndarray) -> memoryview:
    """The bytes of C-contiguous ``a``, as one flat memoryview (no copy)."""
    # an ndarray has the buffer protocol: numpy's stubs say so from Python 3.12 on only
    return memoryview(a.reshape(-1).view(np.uint8))  # type: ignore[arg-type, unused-ignore]


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(conn, memoryview(buf))
    return bytes(buf)


def _recv_into(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = conn.recv_into(view[got:])
        if not k:
            raise Unreachable(f"the agent closed the connection after {got} of "
                              f"{len(view)} bytes")
        got += k


class Server:
    """An agent's listener: ``read(handle)`` gives the C-contiguous array to send."""

    def __init__(self, ip: str, read: Callable[[Any], np.ndarray]) -> None:
        self.read = read
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET)
        self.sock.bind((ip, 0))
        self.sock.listen(64)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.endpoint = Endpoint(ip, self.sock.getsockname()[1], self.token)
        self._listener = threading.Thread(target=self._accept, daemon=True,
                                          name="shmtensor-agent-listener")
        self._listener.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop listening and wait (up to ``timeout`` seconds) for the listener thread to
        end; transfers under way finish on their own threads.  Closing the socket alone
        would leave the listener blocked in ``accept`` for good: a shutdown wakes it."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # closed already, or never connected (not listening)
            pass
        self.sock.close()
        if self._listener is not threading.current_thread():
            self._listener.join(timeout)

    def _accept(self) -> None:
        while True:
            self._slots.acquire()
            try:
                conn, _ = self.sock.accept()
            except OSError:
                self._slots.release()
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="shmtensor-agent-send").start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                handle = self._request(conn)
                if handle is not None:
                    self._answer(conn, handle)
        except OSError:
            pass  # the receiver went away or stalled: it sees its own error
        finally:
            self._slots.release()

    def _request(self, conn: socket.socket) -> Any:
        """The handle a peer asks for; None (nothing answered) for a peer without the token
        or a malformed request."""
        conn.settimeout(REQUEST_S)
        token = _recv_exact(conn, TOKEN_BYTES)
        if not hmac.compare_digest(token, self.token):
            return None  # not one of the job's processes: no answer
        (n,) = REQUEST.unpack(_recv_exact(conn, REQUEST.size))
        if not 0 < n <= MAX_REQUEST:
            return None
        try:
            return pickle.loads(_recv_exact(conn, n))
        except Exception:
            return None

    def _answer(self, conn: socket.socket, handle: Any) -> None:
        conn.settimeout(IDLE_S)
        try:
            data = self.read(handle)
        except Exception as e:  # the sender's error (gone, not reachable) or the read's
            err = pickle.dumps((type(e).__name__, str(e)))
            conn.sendall(ANSWER.pack(1, len(err)) + err)
            return
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        conn.sendall(ANSWER.pack(0, data.nbytes))
        conn.sendall(_bytes_of(data))


def receive(ep: Endpoint, handle: Any, out: np.ndarray) -> None:
    """Read ``handle``'s data from the agent at ``ep`` into ``out`` (C-contiguous, its
    size).  Raises :class:`Unreachable` or :class:`Refused`."""
    try:
        conn = socket.create_connection((ep.ip, ep.port), timeout=CONNECT_S)
    except OSError as e:
        raise Unreachable(e.errno, f"cannot connect to the agent at {ep.ip}:{ep.port}: "
                                   f"{e.strerror or e}") from None
    with conn:
        try:
            conn.settimeout(IDLE_S)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
            request = pickle.dumps(handle)
            conn.sendall(ep.token + REQUEST.pack(len(request)) + request)
            status, n = ANSWER.unpack(_recv_exact(conn, ANSWER.size))
            if status:
                if n > MAX_REQUEST:
                    raise Unreachable(f"the agent at {ep.ip}:{ep.port} answers an error of "
                                      f"{n} bytes: not an agent")
                name, message = pickle.loads(_recv_exact(conn, n))
                known = _ERRORS.get(name)
                raise Refused(known(message) if known else RuntimeError(
                    f"the agent of the sender's node could not read the array: "
                    f"{name}: {message}"))
            if n != out.nbytes:
                raise Unreachable(f"the agent sends {n} bytes for an array of {out.nbytes}")
            _recv_into(conn, _bytes_of(out))
        except Unreachable:
            raise
        except OSError as e:
            raise Unreachable(e.errno, f"the transfer from the agent at {ep.ip}:{ep.port} "
                                       f"broke: {e.strerror or e}") from None


def node_ip() -> str:
    """This node's IP as Ray knows it (what the agent listens on)."""
    from ray._private import worker
    return str(worker.global_worker.node_ip_address)
