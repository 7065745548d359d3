"""Frames of bytes with file descriptors attached, over a Unix stream socket.

Facts this module is built on (Linux):

* ``sendmsg`` with an ``SCM_RIGHTS`` control message hands the receiver new fds for the
  same open files.  While the message sits in the socket, the kernel holds the files: the
  sender may close its fds, or exit, and the receiver still gets them.
* The fds ride on the first byte of the ``sendmsg`` they came with, and a ``recvmsg`` never
  reads past a byte that carries fds, so a header sent in one call with the fds always
  arrives with them.
* One message carries at most 253 fds (``SCM_MAX_FD``); more go in one-byte follow-up frames.

Frames extend the stdlib Connection's framing, so a frame without fds is exactly what
``multiprocessing.connection`` sends (``!i`` length, or ``-1`` then ``!Q`` length) and the
stdlib's handshakes work on these sockets.  A frame with fds starts with a negative ``!i``:
below ``-2`` it packs the payload length (under 8 MiB) and the fd count in those four bytes,
so a receiver reads the header and then the payload (two reads); otherwise it is ``-2``,
then ``!QI`` (payload length, fd count).  The fds ride on the header.  Writers that share a
socket must hold a lock around :func:`send_frame`, as the stdlib's queues already do.
"""

from __future__ import annotations

import array
import os
import socket
import struct
import time

__all__ = ["HAVE_SCM_RIGHTS", "MAX_FDS", "ATOMIC_MAX", "send_frame", "try_send_frame",
           "recv_frame", "SpinWait", "close_fds"]

HAVE_SCM_RIGHTS = hasattr(socket, "SCM_RIGHTS") and hasattr(socket.socket, "sendmsg")
MAX_FDS = 253
_SMALL = struct.Struct("!i")
_LARGE = struct.Struct("!iQ")
_WITH_FDS = struct.Struct("!iQI")
_Q = struct.Struct("!Q")
_QI = struct.Struct("!QI")
_ANC_SIZE = socket.CMSG_SPACE(MAX_FDS * 4) if HAVE_SCM_RIGHTS else 0
_INLINE = 1 << 16
_UNPACK_FDS: dict = {}  # fd count -> struct unpack of that many C ints
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_DONTWAIT = int(socket.MSG_DONTWAIT)
_SOL_SOCKET, _SCM_RIGHTS = int(socket.SOL_SOCKET), int(getattr(socket, "SCM_RIGHTS", 1))
# Received fds are close-on-exec, as Python makes its own: a kept one (a lease) must not
# live on in a program this process starts.
_RECV_FLAGS = int(getattr(socket, "MSG_CMSG_CLOEXEC", 0))
# A Unix stream socket queues a write in pieces of at most ~36 KB (one page of head plus
# 32 KB of fragments); a frame no larger is taken whole or not at all by a non-blocking send.
ATOMIC_MAX = 32 << 10  # a plain int: enum '&' costs microseconds


def _anc(fds):
    return [(_SOL_SOCKET, _SCM_RIGHTS, array.array("i", fds))] if fds else []


_COMPACT_MAX = (1 << 23) - 1  # payload bytes a compact fd header can say


def _header(n: int, fds) -> bytes:
    if fds:
        if n <= _COMPACT_MAX and len(fds) <= MAX_FDS:
            return _SMALL.pack(-3 - (n << 8 | len(fds)))
        return _WITH_FDS.pack(-2, n, len(fds))
    if n < 0x7FFFFFFF:
        return _SMALL.pack(n)
    return _LARGE.pack(-1, n)


def _finish(sock, header, data, sent: int) -> None:
    if sent < len(header) + len(data):
        sock.sendall(memoryview(header + bytes(data))[sent:])


def try_send_frame(sock: socket.socket, data, fds=()) -> bool:
    """Send a frame of at most ``ATOMIC_MAX`` bytes now if the socket has room (False,
    nothing sent, if it has not): lets a queue skip its feeder thread while the reader
    keeps up."""
    if type(data) is not bytes:
        data = memoryview(data).cast("B")
    n = len(data)
    if len(fds) > MAX_FDS or n + _WITH_FDS.size > ATOMIC_MAX:
        return False
    header = _header(n, fds)
    try:
        sent = sock.sendmsg([header, data], _anc(fds), _DONTWAIT)
    except BlockingIOError:
        return False
    if sent != n + 4:
        _finish(sock, header, data, sent)  # not expected: a frame this small goes whole
    return True


def send_frame(sock: socket.socket, data, fds=()) -> None:
    """Send ``data`` (bytes-like) and ``fds`` as one frame."""
    data = memoryview(data).cast("B")
    n = len(data)
    header = _header(n, fds)
    if len(fds) <= MAX_FDS and n <= _INLINE:
        _finish(sock, header, data, sock.sendmsg([header, data], _anc(fds)))
        return
    _sendall_msg(sock, header, fds[:MAX_FDS])
    for i in range(MAX_FDS, len(fds), MAX_FDS):
        _sendall_msg(sock, b"\0", fds[i:i + MAX_FDS])
    if n:
        sock.sendall(data)


def _sendall_msg(sock, buf, fds):
    sent = sock.sendmsg([buf], _anc(fds))
    if sent < len(buf):
        sock.sendall(buf[sent:])


def _unpack_fds(payload: bytes) -> tuple[int, ...]:
    """The fds of one SCM_RIGHTS control message (whole C ints only)."""
    n = len(payload) // 4
    unpack = _UNPACK_FDS.get(n)
    if unpack is None:
        unpack = _UNPACK_FDS[n] = struct.Struct(f"{n}i").unpack
    return unpack(payload[:4 * n])


def _collect(ancdata, flags, fds: list) -> bool:
    """Add the fds of ``ancdata`` to ``fds``; False when some were dropped (MSG_CTRUNC)."""
    for level, kind, payload in ancdata:
        if level == _SOL_SOCKET and kind == _SCM_RIGHTS:
            fds.extend(_unpack_fds(payload))
    return not flags & _MSG_CTRUNC


def _recv_exact_msg(sock, size: int, fds: list, dropped: list) -> bytes:
    chunks = []
    while size:
        data, ancdata, flags, _ = sock.recvmsg(size, _ANC_SIZE, _RECV_FLAGS)
        if not _collect(ancdata, flags, fds):
            dropped.append(True)
        if not data:
            close_fds(fds)
            raise _truncated()
        chunks.append(data)
        size -= len(data)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class SpinWait:
    """How one reader waits for a frame: it polls the socket for up to ``budget`` seconds
    before it sleeps in ``recvmsg``, while its last wait was no longer than that (``hot``).

    A reader that waited longer sleeps at once next time (and learns again from how long
    that took), so a reader kept idle burns no CPU, and one that keeps up with a busy
    writer spares the writer the wake-up.  Polls are non-blocking ``recvmsg`` calls: the
    GIL is let go between them.  Adaptive state only, not a lock: a reader's waits are
    serialised by the caller (a queue's read lock), and a race costs at most one poll."""

    __slots__ = ("budget", "hot")

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.hot = True

    def read_head(self, sock: socket.socket):
        """The first read of a frame, as ``recvmsg(4, ...)`` gives it."""
        clock = time.perf_counter
        if self.hot:
            try:
                return sock.recvmsg(4, _ANC_SIZE, _RECV_FLAGS | _DONTWAIT)
            except BlockingIOError:
                pass
            deadline = clock() + self.budget
            while clock() < deadline:
                try:
                    return sock.recvmsg(4, _ANC_SIZE, _RECV_FLAGS | _DONTWAIT)
                except BlockingIOError:
                    pass
            self.hot = False  # waited past the budget: sleep at once next time
            return sock.recvmsg(4, _ANC_SIZE, _RECV_FLAGS)
        start = clock()
        got = sock.recvmsg(4, _ANC_SIZE, _RECV_FLAGS)
        self.hot = clock() - start <= self.budget
        return got


def recv_frame(sock: socket.socket, wait: SpinWait | None = None) -> tuple[bytes, list[int]]:
    """Receive one frame: ``(payload, fds)``; the caller owns (and must close) the fds.
    ``wait``: the reader's :class:`SpinWait`, if it spins before sleeping."""
    if wait is None:
        head, ancdata, flags, _ = sock.recvmsg(4, _ANC_SIZE, _RECV_FLAGS)
    else:
        head, ancdata, flags, _ = wait.read_head(sock)
    if len(head) == 4 and len(ancdata) == 1 and not flags & _MSG_CTRUNC:
        # the common small frame with fds (one SCM_RIGHTS message, compact header)
        code = _SMALL.unpack(head)[0]
        level, kind, payload = ancdata[0]
        if code < -2 and level == _SOL_SOCKET and kind == _SCM_RIGHTS:
            n, nfds = divmod(-3 - code, 256)
            if len(payload) == 4 * nfds:
                fds = list(_unpack_fds(payload))
                try:
                    return _recv_payload(sock, n), fds
                except BaseException:
                    close_fds(fds)
                    raise
            return _finish_frame(sock, head, ancdata, flags)  # says what went wrong
    return _finish_frame(sock, head, ancdata, flags)


def _finish_frame(sock, head: bytes, ancdata, flags) -> tuple[bytes, list[int]]:
    """:func:`recv_frame` past its first read, for every header form."""
    fds: list[int] = []
    dropped: list = []
    if ancdata and not _collect(ancdata, flags, fds):
        dropped.append(True)
    if len(head) < 4:  # a header split across reads, or the peer is gone
        if not head:
            close_fds(fds)
            raise EOFError
        head += _recv_exact_msg(sock, 4 - len(head), fds, dropped)
    (code,) = _SMALL.unpack(head)
    nfds = 0
    if code >= 0:
        n = code
    elif code == -1:
        (n,) = _Q.unpack(_recv_exact_msg(sock, 8, fds, dropped))
    elif code == -2:
        n, nfds = _QI.unpack(_recv_exact_msg(sock, 12, fds, dropped))
    elif (-3 - code) & 0xFF:
        n, nfds = divmod(-3 - code, 256)
    else:
        close_fds(fds)
        raise OSError(f"bad frame header {code}: the peer does not speak this protocol")
    for _ in range(-(-(nfds - MAX_FDS) // MAX_FDS) if nfds > MAX_FDS else 0):
        _recv_exact_msg(sock, 1, fds, dropped)
    try:
        buf = _recv_payload(sock, n)
    except BaseException:
        close_fds(fds)
        raise
    if dropped or len(fds) != nfds:
        close_fds(fds)  # the whole frame was read: the channel stays usable
        raise OSError("file descriptors were dropped in transit (MSG_CTRUNC): this process hit "
                      "its open-file limit; raise it (ulimit -n) or hold fewer arrays from "
                      "different producers; the message was discarded")
    return buf, fds


def _truncated() -> OSError:
    """The peer closed in the middle of a frame (it died mid-send): what the stdlib's
    Connection raises then; EOFError is only for an end between frames."""
    return OSError("got end of file during message")


def _recv_payload(sock: socket.socket, n: int):
    """``n`` bytes: one ``recv`` when they are there (a small frame is), else read into a
    buffer of that size."""
    if n <= _INLINE:
        data = sock.recv(n) if n else b""
        if len(data) == n:
            return data
        if not data:
            raise _truncated()
        buf = bytearray(n)
        buf[:len(data)] = data
        pos = len(data)
    else:
        buf = bytearray(n)
        pos = 0
    view = memoryview(buf)
    while pos < n:
        got = sock.recv_into(view[pos:])
        if not got:
            raise _truncated()
        pos += got
    return buf


def close_fds(fds) -> None:
    """Close every fd of ``fds`` that is not -1 (a slot given away), ignoring ones already
    closed: for received fds nobody keeps, and fds a process lets go of at exit."""
    for fd in fds:
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
