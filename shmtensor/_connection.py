"""Connections over Unix stream sockets that carry fds with each message.

A :class:`Connection` is a real ``multiprocessing.connection.Connection`` whose bytes go in
:mod:`ipc.scm_rights` frames, so the fds a message needs travel in-band with it: no
connection back to the sender per fd, and the sender may exit as soon as it has sent.
``send``/``recv`` pickle with shmtensor's reducers; everything else (``send_bytes``,
``recv_bytes``, ``recv_bytes_into``, ``poll``, EOF, closed handles) is the stdlib's own code
on top of :meth:`Connection._send_bytes` and :meth:`Connection._recv_bytes`, which keep its
contract (CPython 3.10-3.13 ``multiprocessing/connection.py``).

A send that fails for want of a resource (no fd left, no shared memory, the reader gone)
raises :func:`send_error`'s description of it: the limit, its value and the fix.

``recv_async``/``send_async`` are the same calls awaited in an event loop (:mod:`._aio`).
"""

from __future__ import annotations

import errno
import io
import os
import resource
import socket
import traceback
from collections.abc import Callable, Sequence
from multiprocessing import connection as _mpc
from multiprocessing import reduction
from typing import TYPE_CHECKING, Any, TypeVar

from shmtensor.ipc import scm_rights

from . import _reductions, _strategy

if TYPE_CHECKING:
    import asyncio

    from _typeshed import ReadableBuffer

    from . import _aio  # imported where used: asyncio loads with the first awaitable call
    from ._wire import SendContext

    class _StdConnection(_mpc.Connection):
        """The stdlib Connection's private members this module uses (not in its stubs)."""

        _handle: int | None

        def _check_closed(self) -> None: ...

        def _check_readable(self) -> None: ...

        def _check_writable(self) -> None: ...

        def _poll(self, timeout: float | None) -> bool: ...
else:
    _StdConnection = _mpc.Connection

__all__ = ["Connection", "Pipe", "send_error"]

_T = TypeVar("_T")


def _open_fds(limit: int) -> str:
    try:
        return str(len(os.listdir("/proc/self/fd")) - 1)  # less the one listdir used
    except OSError:  # none left to look with
        return f"all {limit}"


def dumps_to_send(obj: object, what: str) -> tuple[bytes, SendContext]:
    """``_reductions.dumps(obj)`` for a send (``what``: "put() failed" ...): an OSError (no
    fd or shared memory for a segment) raised as :func:`send_error` describes it."""
    try:
        return _reductions.dumps(obj)
    except OSError as e:
        raise send_error(e, what)


def send_error(e: BaseException, what: str,
               dropped: str = "the message was not sent") -> BaseException:
    """``e``, met while sending (``what``: "put() failed" ...), described for a person:
    which limit was hit, its value, and how to lift it.  Same errno (so the same OSError
    subclass); a MemoryError (``ShmSpaceError`` included) already says so and is kept.

    The finished frames of ``e``'s traceback are cleared, and callers drop their own
    reference to the message before raising: a kept exception would otherwise keep the
    message's bytes (and, through its context, its anchors) alive."""
    traceback.clear_frames(e.__traceback__)
    if not isinstance(e, OSError) or e.errno is None:
        return e
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    code = e.errno
    if e.strerror and e.strerror != os.strerror(code):
        why = e.strerror  # described where it happened (ipc.posix_shm.fd_limit_error, ...)
    elif code == errno.EMFILE:
        why = (f"too many open files (EMFILE): ulimit -n (RLIMIT_NOFILE) is {soft} (hard "
               f"limit {hard}) and this process has {_open_fds(soft)} fds open. Raise it "
               f"(ulimit -n, or resource.setrlimit(resource.RLIMIT_NOFILE, ...)), keep fewer "
               f"shared arrays alive in this process (each segment it made or holds can keep "
               f"an fd), or use shmtensor.set_sharing_strategy('file_system')")
    elif code == errno.ETOOMANYREFS:
        why = (f"the kernel refused to queue more fds in sockets (ETOOMANYREFS): Linux counts "
               f"the fds in unread messages of this user against RLIMIT_NOFILE ({soft}). "
               f"Let the receiver catch up (fewer messages in flight) or raise ulimit -n")
    elif code == errno.ENFILE:
        why = ("the system's open-file table is full (ENFILE, /proc/sys/fs/file-max): close "
               "files or shared arrays elsewhere, or raise fs.file-max")
    elif code == errno.EPIPE:
        why = ("the receiving end is closed in every process (EPIPE): the reader exited or "
               "closed it, so nothing can receive this; keep a reader alive until the "
               "sender is done")
    elif code in (errno.ENOSPC, errno.EDQUOT):
        why = (f"no space left for shared memory ({errno.errorcode[code]}): free memory or "
               f"/dev/shm space (fewer live arrays, 'shmtensor clean'), or give the "
               f"container more (--shm-size)")
    elif code == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        shown = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit} bytes"
        why = (f"the file size limit (ulimit -f, RLIMIT_FSIZE) is {shown} (EFBIG): raise it "
               f"to send arrays this large")
    elif code == errno.ENOMEM:
        why = ("out of memory or mappings (ENOMEM): free memory, hold fewer arrays, or "
               "raise vm.max_map_count")
    else:
        why = e.strerror or str(e)
    err = OSError(code, f"{what}: {why}; {dropped}")
    err.__cause__ = e
    return err


class Connection(_StdConnection):
    """A multiprocessing Connection on a Unix socket whose messages carry fds."""

    # Plain arrays received here become private copies (see _reductions._rebuild_array):
    # set on a manager server's end, which keeps values as the stdlib's does.
    _private = False
    # The awaiters of recv_async and the frames of send_async, per event loop (_aio).
    _lines: dict[asyncio.AbstractEventLoop, _aio._Line] | None = None
    _senders: dict[asyncio.AbstractEventLoop, _aio._Sender] | None = None
    # _sock and _frames are None once closed (_frames also on an end that does not read):
    # every use is behind the stdlib's _check_closed/_check_readable, or checks for None.
    _sock: socket.socket
    _frames: scm_rights.FrameReader

    def __init__(self, handle: int, readable: bool = True, writable: bool = True) -> None:
        super().__init__(handle, readable, writable)
        self._sock = socket.socket(fileno=handle)
        self._sock.settimeout(None)  # not socket.setdefaulttimeout()'s: the stdlib's ignores it
        # what this process has read of a frame not yet delivered (see set_receive_spin)
        # None on an end that does not read: see the class's note
        self._frames = scm_rights.FrameReader(_strategy.receive_wait()) if readable else None  # type: ignore[assignment]

    @property
    def _wait(self) -> scm_rights.SpinWait | None:
        """How this end's reader waits (see set_receive_spin); None: it sleeps at once."""
        return self._frames.wait if self._frames is not None else None

    def __reduce__(self) -> tuple[Callable[[Any, bool, bool], Connection], tuple[Any, bool, bool]]:
        return _rebuild_connection, (reduction.DupFd(self.fileno()), self.readable, self.writable)

    def _close(self, _close: Callable[[int], None] = os.close) -> None:
        if self._lines or self._senders:
            from . import _aio  # loaded already: it made the awaiters
            _aio.closing(self)  # awaiters watching this socket: woken, they find it closed
        # None once closed: see the class's note (both)
        frames, self._frames = self._frames, None  # type: ignore[assignment]
        if frames is not None:
            frames.discard()  # a frame read and never delivered: its fds
        sock, self._sock = self._sock, None  # type: ignore[assignment]
        if sock is not None:
            sock.detach()
        handle, self._handle = self._handle, None  # closed even when reached through __del__
        _close(handle)  # type: ignore[arg-type]  # the stdlib calls _close only while open

    # The stdlib's send_bytes/recv_bytes/recv_bytes_into call these two.
    def _send_bytes(self, buf: ReadableBuffer) -> None:
        try:
            scm_rights.send_frame(self._sock, buf)
        except OSError as e:
            raise send_error(e, "send_bytes() failed")

    def _recv_bytes(self, maxsize: int | None = None) -> io.BytesIO | None:
        """One message as the stdlib's ``_recv_bytes`` gives it: a BytesIO positioned at its
        end (``recv_bytes_into`` reads the size from ``tell()``), or None when its header
        says more than ``maxsize`` (``recv_bytes`` then says "bad message length" and stops
        reading, as the stdlib's does); its fds are closed."""
        frames = self._frames
        try:
            frames.read(self._sock, None, maxsize)
        except scm_rights.FrameTooLong:
            return None
        frame = frames.load(_payload_only)
        out = io.BytesIO(frame.result[0])
        out.seek(0, io.SEEK_END)
        frames.ready = None; return out  # noqa: E702 (the hand-over: see FrameReader.load)

    def _poll(self, timeout: float | None) -> bool:
        frames = self._frames
        if frames is not None and frames.ready is not None:
            return True  # read by a receive an exception cut short: delivered next
        return super()._poll(timeout)

    def send_frame(self, data: ReadableBuffer, fds: Sequence[int]) -> None:
        self._check_closed()
        self._check_writable()
        scm_rights.send_frame(self._sock, data, fds)

    def try_send_frame(self, data: ReadableBuffer, fds: Sequence[int]) -> bool:
        """Send now if the socket has room; False (nothing sent) if it has not."""
        self._check_closed()
        self._check_writable()
        return scm_rights.try_send_frame(self._sock, data, fds)

    def read_frame(self, deadline: float | None = None) -> scm_rights.Frame | None:
        """Read a whole frame off the socket (see ``scm_rights.FrameReader``): the frame,
        which :meth:`take` hands over, or None when ``deadline`` (``time.monotonic()``)
        passed first."""
        self._check_closed()
        self._check_readable()
        frames = self._frames
        return frames.ready if frames.read(self._sock, deadline) else None

    def take(self, load: Callable[..., _T]) -> _T:
        """``load(data, fds)`` of the frame :meth:`read_frame` read: its result (a caller
        that must not lose it hands it over in its own frame: see
        ``scm_rights.FrameReader.load``)."""
        return self._frames.take(load)

    def recv_frame(self) -> tuple[bytes, list[int]]:
        """The next frame as it came: ``(payload, fds)``; the caller owns (and must close)
        the fds."""
        self.read_frame()
        frame = self._frames.load(_as_received)
        self._frames.ready = None; return frame.result[0]  # type: ignore[no-any-return]  # noqa: E702 (see FrameReader.load)

    def send(self, obj: object) -> None:
        """Send a picklable object; arrays in it cross through shared memory."""
        self._check_closed()
        self._check_writable()
        data, ctx = dumps_to_send(obj, "send() failed")
        try:
            scm_rights.send_frame(self._sock, data, ctx.wire_fds())
        except OSError as e:
            data = None  # type: ignore[assignment]  # see send_error
            raise send_error(e, "send() failed")
        finally:
            ctx.release()

    def recv(self) -> Any:
        """Receive an object sent with :meth:`send`."""
        self.read_frame()
        frame = self._frames.load(_reductions.loads, self._private)
        self._frames.ready = None; return frame.result[0]  # noqa: E702 (see FrameReader.load)

    async def send_async(self, obj: object) -> None:
        """:meth:`send`, awaited: waits for room in the socket in the running event loop
        instead of blocking it (no thread).  Sends from one loop keep their order.  A call
        cancelled before its frame began sends nothing; one cancelled after it began is
        finished in the background (the socket is never left mid-frame), so its message
        is delivered.  Await it before a :meth:`send` on the same end."""
        from . import _aio  # asyncio loads with the first awaitable call
        self._check_closed()
        self._check_writable()
        data, ctx = dumps_to_send(obj, "send() failed")
        await _aio.send(self, data, ctx, "send() failed")

    async def recv_async(self) -> Any:
        """:meth:`recv`, awaited: waits for the socket to be readable in the running event
        loop instead of blocking it (no thread).  Concurrent awaiters of one loop get one
        message each, in the order they came.  Cancelling it loses no message: a frame it
        read in part stays for the next receive of this process (``recv`` or
        ``recv_async``).  Bound it with ``asyncio.wait_for``/``asyncio.timeout``."""
        from . import _aio  # asyncio loads with the first awaitable call
        self._check_closed()
        self._check_readable()
        await _aio.read_frame(self)
        frame = self._frames.load(_reductions.loads, self._private)
        self._frames.ready = None; return frame.result[0]  # noqa: E702 (see FrameReader.load)

    def _writer_socket(self) -> socket.socket:
        """The socket, for a sender about to write (``OSError`` once closed)."""
        self._check_closed()
        return self._sock


def _as_received(data: bytes, fds: list[int]) -> tuple[bytes, list[int]]:
    return data, fds


def _payload_only(data: bytes, fds: list[int]) -> bytes:
    scm_rights.close_fds(fds)
    return data


def _rebuild_connection(df: Any, readable: bool, writable: bool) -> Connection:
    return Connection(df.detach(), readable, writable)


def Pipe(duplex: bool = True) -> tuple[Connection, Connection]:
    """Like ``multiprocessing.Pipe``, always over a Unix socket pair (pipes cannot carry fds)."""
    s1, s2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if duplex:
        return Connection(s1.detach()), Connection(s2.detach())
    return Connection(s1.detach(), writable=False), Connection(s2.detach(), readable=False)
