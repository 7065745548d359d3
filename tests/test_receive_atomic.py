"""A receive is atomic with respect to exceptions (issue 26, item 7 and item 3's maxsize).

An exception raised at any point of the receive path (what a signal handler that raises,
such as SIGINT's, does) leaves the message delivered by that call or by the next one,
never half a frame in the socket, no fd open and the producer's segment released.  The
exception is injected with ``sys.settrace`` at every point where a signal handler can run
(see :class:`Inject`), in turn, in the code a receive runs: the channel's
(``ipc.scm_rights``, ``_connection``, ``_queues``) and the load's (``_reductions``,
``_wire``, ``_segments``, ``ipc.ofd_lease``, ``ipc.posix_shm``).  Raised inside the load,
the message is discarded, and nothing it took (a hold, a mapping, an fd) is left behind.
"""

from __future__ import annotations

import dis
import inspect
import os
import socket
import struct
import sys
import time
from queue import Empty

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp
from shmtensor import _connection, _queues, _reductions, _segments, _wire
from shmtensor.ipc import ofd_lease, posix_shm, scm_rights

from helpers import exit_once_segments_freed, stall_mid_message

JOIN = 60
# the channel's receive and the load: unpickling, holds, mappings and the receive cache
_FILES = {m.__file__ for m in (scm_rights, _connection, _queues, _reductions, _wire,
                               _segments, ofd_lease, posix_shm)}


class Injected(Exception):
    """What the injected 'signal handler' raises."""


class Inject:
    """Raise :class:`Injected` at the ``k``-th point of the receive path's files where a
    signal handler can run.

    CPython runs a pending handler only at its eval-breaker checks: as a function begins
    (``RESUME``), at a backward jump, and as a call of anything but a Python function
    returns (a C function, a class, an object's ``__call__``, and any star-call,
    ``f(*args)``; a Python function called plainly from Python runs in the same loop, and
    its own checks stand for its return).  Each point is a trace event: a function's
    ``call`` (its ``RESUME``, which ``opcode`` events leave out on 3.11; a generator's
    resumption, which does not check, aside), an ``opcode`` event of a backward jump, or of
    the instruction after such a call (seen as the ``c_return`` of a C function, or the
    ``call`` of a special method, in that frame since its call began).  Raising there is
    what a handler that raises (SIGINT's) does at that point: a point between a line's
    statements or inside a ``with`` block's exit is covered exactly, and nothing is raised
    where no handler runs."""

    _CALLS = frozenset(op for op in dis.opmap if op.startswith("CALL"))
    _CHECKS = frozenset(op for op in dis.opmap
                        if op.startswith(("JUMP_BACKWARD", "POP_JUMP_BACKWARD"))
                        and not op.endswith("NO_INTERRUPT"))
    _RESUMED = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR

    def __init__(self) -> None:
        self._prev: dict[int, str] = {}     # frame -> the last instruction it ran
        self._checked: set[int] = set()     # frames whose running call ends with a check

    def arm(self, k: int) -> None:
        self.left, self.fired, self.where, self.in_load = k, False, None, False
        self._prev.clear()
        self._checked.clear()
        sys.setprofile(self._profile)
        sys.settrace(self._global)

    def disarm(self) -> bool:
        sys.settrace(None)
        sys.setprofile(None)
        return self.fired

    def receive(self, k: int, get):
        """``get()`` raised at its ``k``-th point: (what it returned, or None when it was
        interrupted; whether the point was reached)."""
        self.arm(k)
        try:
            got = get()
        except Injected:
            got = None
        finally:
            fired = self.disarm()
        return got, fired

    def _profile(self, frame, event, arg):
        if event in ("c_return", "c_exception"):
            self._checked.add(id(frame))
        elif event == "call" and frame.f_back is not None:
            name = frame.f_code.co_name
            if name.startswith("__") and name.endswith("__"):  # called through a slot
                self._checked.add(id(frame.f_back))

    def _global(self, frame, event, arg):
        if frame.f_code.co_filename not in _FILES:
            return None
        frame.f_trace_opcodes = True
        self._prev[id(frame)] = "RESUME"
        if not frame.f_code.co_flags & self._RESUMED:
            self._point(frame, "entry")
        return self._local

    def _local(self, frame, event, arg):
        if event != "opcode" or self.fired:
            return self._local
        key = id(frame)
        op = dis.opname[frame.f_code.co_code[frame.f_lasti]]
        prev = self._prev.get(key)
        # a star-call never runs its callee in the same loop: it checks as it returns
        # (a call that raised goes to its handler with no check: not a point)
        point = (prev in self._CALLS and op != "PUSH_EXC_INFO"
                 and (key in self._checked or prev == "CALL_FUNCTION_EX")
                 or op in self._CHECKS)
        self._prev[key] = op
        if op in self._CALLS:
            self._checked.discard(key)
        if point:
            self._point(frame, f"before {op}")
        return self._local

    def _point(self, frame, what: str) -> None:
        # not inside an ``except`` block: CPython >= 3.11 leaves the handled exception set
        # for good when a trace function raises there (the spin's ``except
        # BlockingIOError: pass``), keeping its frames and their queues alive; such a
        # block raises on with its own exception in any case
        if self.fired or sys.exc_info()[0] is not None:
            return
        self.left -= 1
        if self.left == 0:
            self.fired = True
            self.where = (f"{os.path.basename(frame.f_code.co_filename)}:"
                          f"{frame.f_lineno} {what}")
            self.in_load = _inside_load(frame)
            raise Injected(f"{frame.f_code.co_name}:{frame.f_lineno} {what}")


def _inside_load(frame) -> bool:
    """Whether ``frame`` runs inside a loader the frame was handed to (its unpickling):
    an exception there discards the message, with its fds closed."""
    frame = frame.f_back  # at hand_to's own line the loader has not begun
    while frame is not None:
        if frame.f_code is scm_rights.Frame.hand_to.__code__:
            return True
        frame = frame.f_back
    return False


def _message(i: int):
    """Kinds in turn: an inline array (no fds), an array copied into a segment (fds),
    a payload too large for one read (no fds, several reads)."""
    kind = i % 3
    if kind == 0:
        return i, np.full(16, i, np.int64)
    if kind == 1:
        return i, np.full(40_000, i, np.int64)
    return i, bytes([i % 251]) * 300_000


def _check(got, i: int, where: str | None = None) -> None:
    seq, payload = got
    assert seq == i, f"message {i} expected, {seq} arrived (interrupted at {where})"
    want = _message(i)[1]
    if isinstance(want, bytes):
        assert payload == want
    else:
        assert (payload == want).all()


def _produce(q, n, done):
    for i in range(n):
        q.put(_message(i))
    q.close()
    q.join_thread()
    exit_once_segments_freed(done, JOIN)


def _fds() -> dict[int, str]:
    """This process's fds, once idle received segments (kept for reuse) are let go."""
    shmtensor.empty_cache()
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own fd
            pass
    return out


@pytest.fixture(params=["file_descriptor", "file_system"])
def strategy(request):
    """Each sharing strategy in turn: memfds passed with the message, or named segments
    opened by name."""
    prev = smp.get_sharing_strategy()
    smp.set_sharing_strategy(request.param)
    yield request.param
    smp.set_sharing_strategy(prev)


@pytest.mark.parametrize("how", ["get", "get_timeout", "simple", "recv"])
def test_an_exception_at_every_line_of_a_receive_loses_and_leaks_nothing(lc, how, strategy):
    ctx = smp.get_context("fork")
    n = 900
    if how == "recv":
        reader, writer = smp.Pipe(duplex=False)
        q = ctx.Queue()  # carries nothing: the producer sends on the pipe

        class Sender:  # the pipe's writer as a queue, for _produce
            def put(self, obj):
                writer.send(obj)

            def close(self):
                writer.close()

            def join_thread(self):
                pass

        target_q = Sender()
        receive = reader.recv
    else:
        q = ctx.SimpleQueue() if how == "simple" else ctx.Queue()
        target_q = q
        receive = {"get": lambda: q.get(), "get_timeout": lambda: q.get(timeout=JOIN),
                   "simple": q.get}[how]
    done = ctx.Event()
    if how == "simple":  # SimpleQueue has no close/join_thread: the producer flushes as it puts
        target = _produce_simple
    else:
        target = _produce
    p = ctx.Process(target=target, args=(target_q, n, done))
    p.start()
    lc.check_pid(p.pid)
    inject = Inject()
    i = 0
    try:
        for _ in range(6):  # warm up: lease tables and caches opened once, before counting fds
            _check(receive(), i)
            i += 1
        base = _fds()
        k, quiet, discarded, tries = 1, 0, 0, 0
        while quiet < 3:  # every kind of message has run out of lines to interrupt
            assert i < n - 1, "not enough messages for every line"
            got, fired = inject.receive(k, receive)
            if got is None:  # interrupted: the next receive delivers the message ...
                if inject.in_load:  # ... unless it was being unpickled: then it was discarded
                    discarded += 1
                    i += 1
                got = receive()
            _check(got, i, inject.where)
            del got
            now = _fds()
            assert now == base, (f"fds {set(now.items()) ^ set(base.items())} leaked after an "
                                 f"interrupt at {inject.where} (message {i})")
            quiet = 0 if fired else quiet + 1
            i += 1
            tries += 1
            if tries % 3 == 0:  # each point against three messages in turn (of each kind,
                k += 1          # unless some were discarded)
        assert k > 15, f"only {k} points were interrupted"
        assert discarded < tries  # only where an exception landed inside the unpickling
        while i < n:
            _check(receive(), i)
            i += 1
        assert _fds() == base
    finally:
        done.set()
        p.join(JOIN)
        if p.is_alive():
            p.kill()
            p.join(5)
    assert p.exitcode == 0, "the producer's segments are still held (exit code 3)"
    if how == "recv":
        reader.close()
    q.close() if hasattr(q, "close") else None


def _produce_simple(q, n, done):
    for i in range(n):
        q.put(_message(i))
    exit_once_segments_freed(done, JOIN)


def _open_fds(n: int) -> list[int]:
    return [os.open("/dev/null", os.O_RDONLY) for _ in range(n)]


def _closed(fds) -> bool:
    return not [fd for fd in fds if os.path.exists(f"/proc/self/fd/{fd}")]


def _received_fds(before: dict) -> list[int]:
    """The fds this process has now that it had not in ``before``."""
    return [fd for fd in _fds() if fd not in before]


def test_recv_bytes_refuses_a_frame_longer_than_maxlength_on_its_header():
    import threading
    import tracemalloc
    reader, writer = smp.Pipe(duplex=False)
    fds = _open_fds(2)
    before = _fds()
    failed = []

    def send():  # the reader stops reading after the header: this send ends with EPIPE
        try:
            scm_rights.send_frame(writer._sock, bytes(20 << 20), fds)
        except OSError as e:
            failed.append(e)

    th = threading.Thread(target=send)
    th.start()
    tracemalloc.start()
    try:
        with pytest.raises(OSError, match="bad message length"):
            reader.recv_bytes(maxlength=100)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        reader.close()  # as the stdlib does to a read-only end: refused, then closed
        th.join(JOIN)
        writer.close()
        scm_rights.close_fds(fds)
    assert reader.closed
    assert not th.is_alive() and failed
    assert peak < 1 << 20, f"{peak} bytes allocated for a refused frame"
    assert _received_fds(before) == []


def test_a_frame_with_fewer_fds_than_its_header_says_is_refused_and_the_channel_stays_in_step():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fds = _open_fds(1)
    before = _fds()
    try:
        header = struct.pack("!i", -3 - (3 << 8 | 2))  # "three bytes, two fds"
        a.sendmsg([header + b"abc"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                        struct.pack("i", fds[0]))])
        scm_rights.send_frame(a, b"next")
        reader = scm_rights.FrameReader()
        with pytest.raises(OSError, match="says 2 fds and 1 came"):
            reader.read(b)
        assert _received_fds(before) == []
        assert reader.read(b) and reader.take(lambda d, f: bytes(d)) == b"next"
    finally:
        scm_rights.close_fds(fds)
        a.close()
        b.close()


@pytest.mark.parametrize("header", [
    struct.pack("!i", -3 - (5 << 8)),                 # compact, "five bytes, no fds"
    struct.pack("!iQI", -2, 10, 1 << 31),              # more fds than any process may open
], ids=["no-fds-compact", "absurd-fd-count"])
def test_a_malformed_header_is_an_error_then_the_channel_says_it_is_out_of_step(header):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        a.sendall(header + b"0123456789")
        reader = scm_rights.FrameReader()
        with pytest.raises(OSError, match="does not speak this protocol|more than a process"):
            reader.read(b, time.monotonic() + JOIN)
        with pytest.raises(OSError, match="out of step"):
            reader.read(b, time.monotonic() + JOIN)
    finally:
        a.close()
        b.close()


def test_a_peer_that_dies_mid_frame_gives_end_of_file_and_its_fds_are_closed():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fds = _open_fds(2)
    before = _fds()
    try:
        header = struct.pack("!i", -3 - (100 << 8 | 2))
        a.sendmsg([header + b"only part"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                              struct.pack("2i", *fds))])
        a.close()
        with pytest.raises(OSError, match="end of file during message"):
            scm_rights.recv_frame(b)
        assert _received_fds(before) == []
    finally:
        scm_rights.close_fds(fds)
        b.close()


def test_get_with_a_timeout_bounds_the_wait_for_a_message_being_written():
    q = smp.Queue()
    finish = stall_mid_message(q)
    try:
        with pytest.raises(Empty):
            q.get(timeout=0.2)
        finish()
        assert q.get(timeout=JOIN)[0] == "late"
        q.put("after")
        assert q.get(timeout=JOIN) == "after"
    finally:
        finish()
        q.close()
        q.join_thread()


def _get_once(q, w):
    """A second consumer: one get with a short timeout, its outcome sent on ``w``."""
    try:
        w.send(("got", q.get(timeout=0.5)))
    except Empty:
        w.send(("empty", None))
    except Exception as e:  # noqa: BLE001 - the outcome is the test's to judge
        w.send(("error", f"{type(e).__name__}: {e}"))
    w.close()


def _second_consumer(ctx, lc, q):
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_get_once, args=(q, w))
    p.start()
    lc.check_pid(p.pid)
    w.close()
    try:
        assert r.poll(JOIN), "the second consumer said nothing"
        return r.recv()
    finally:
        p.join(JOIN)
        assert p.exitcode == 0
        r.close()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_message_being_written_is_seen_by_no_consumer_until_it_is_whole(lc, method):
    ctx = smp.get_context(method)
    q = ctx.Queue()
    finish = stall_mid_message(q)
    try:
        with pytest.raises(Empty):
            q.get(timeout=0.2)
        assert _second_consumer(ctx, lc, q) == ("empty", None)
        finish()
        assert q.get(timeout=JOIN)[0] == "late"
        q.put("after")
        assert _second_consumer(ctx, lc, q) == ("got", "after")
    finally:
        finish()
        q.close()
        q.join_thread()


@pytest.mark.parametrize("simple", [False, True], ids=["Queue", "SimpleQueue"])
def test_a_thread_waiting_to_get_takes_the_message_another_thread_gave_up_on(simple):
    import threading
    q = smp.SimpleQueue() if simple else smp.Queue()
    got: list = []
    finish = None
    try:
        finish = stall_mid_message(q)
        with pytest.raises(Empty):
            q.get(timeout=0.2)
        t = threading.Thread(target=lambda: got.append(q.get()))
        t.start()  # waits for its turn (or the message), then takes the message
        finish()
        t.join(JOIN)
        assert not t.is_alive() and got and got[0][0] == "late"
        q.put("after")
        assert q.get() == "after"
    finally:
        if finish is not None:
            finish()
        q.close()
        if not simple:
            q.join_thread()


