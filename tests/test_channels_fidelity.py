"""shmtensor's channels behave as the stdlib's for everything that is not an array (issue 13),
and a send that cannot complete says why instead of losing the message (issue 12)."""

import array
import multiprocessing
import os
import pickle
import re
import resource
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing import queues as mpq
from queue import Empty

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp
from shmtensor.ipc import ofd_lease
from shmtensor import _queues

from channel_helpers import unsent
from conftest import JOIN, START_METHODS, join_all

SPAWNING = [m for m in ("spawn", "forkserver") if m in START_METHODS]


def _outcome(fn, *args):
    """What a call did: ("ok", value) or (exception type name, message)."""
    try:
        return ("ok", fn(*args))
    except Exception as e:
        return (type(e).__name__, str(e))


def _wait_for(predicate, what: str, timeout: float = JOIN) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class _Unpicklable:
    def __reduce__(self):
        raise AttributeError("not today")


# -- Connection ------------------------------------------------------------------------------

PIPES = {"stdlib": multiprocessing.Pipe, "shmtensor": smp.Pipe}


def _connection_story(Pipe) -> list:
    """Every observable of a Connection that is not an array, as a list of outcomes."""
    out = []
    a, b = Pipe()
    msg = bytes(range(16))
    a.send_bytes(msg)
    buf = bytearray(32)
    out.append(_outcome(b.recv_bytes_into, buf))  # ("ok", 16)
    out.append(bytes(buf))
    ints = array.array("i", [0] * 10)
    a.send_bytes(array.array("i", [1, 2, 3, 4]))
    out.append(_outcome(b.recv_bytes_into, ints, 3 * ints.itemsize))
    out.append(list(ints))
    a.send_bytes(msg * 4)
    try:
        b.recv_bytes_into(bytearray(40))
    except multiprocessing.BufferTooShort as e:
        out.append(("BufferTooShort", e.args))
    out.append(_outcome(b.recv_bytes_into, bytearray(4), 5))  # offset too large
    a.send_bytes(b"")
    out.append(_outcome(b.recv_bytes))
    a.send_bytes(msg, 4, 8)
    out.append(_outcome(b.recv_bytes))
    out.append(_outcome(a.send_bytes, msg, -1))
    out.append(_outcome(a.send_bytes, msg, 10, 10))
    a.send({"k": [1, 2.5, None, "s"]})
    out.append(_outcome(b.recv))
    out.append(_outcome(b.poll))
    out.append(_outcome(b.poll, -1))
    out.append(_outcome(b.poll, 0.05))
    a.send(None)
    out.append(_outcome(b.poll, JOIN))
    out.append(_outcome(b.recv))
    big = b"x" * (3 << 20)
    sender = threading.Thread(target=a.send_bytes, args=(big,))
    sender.start()
    out.append(_outcome(lambda: b.recv_bytes() == big))
    sender.join(JOIN)
    a.send_bytes(msg)
    out.append(_outcome(b.recv_bytes, 8))  # too long: "bad message length", not readable
    out.append(_outcome(b.recv_bytes))
    out.append((b.readable, b.writable))
    c, d = Pipe(duplex=False)
    out.append(_outcome(c.send, 1))
    out.append(_outcome(d.recv))
    d.send_bytes(msg)
    out.append(_outcome(c.recv_bytes, 8))  # a read-only end is closed instead
    out.append(c.closed)
    d.close()
    for fn in (d.send, d.send_bytes):
        out.append(_outcome(fn, b"x"))
    out.append(_outcome(d.poll))
    out.append(_outcome(d.fileno))
    a.close(), b.close()
    a, b = Pipe()
    a.send("last")
    a.close()
    out.append(_outcome(b.poll))
    out.append(_outcome(b.recv))
    out.append(_outcome(b.poll))
    out.append(_outcome(b.recv))
    out.append(_outcome(b.recv_bytes))
    out.append(_outcome(b.recv_bytes_into, bytearray(4)))
    b.close()
    e, f = Pipe()
    os.write(e.fileno(), (100).to_bytes(4, "big") + b"half")  # a sender that died mid-message
    e.close()
    out.append(_outcome(f.recv_bytes))
    f.close()
    return out


def test_connection_behaves_as_the_stdlibs():
    assert _connection_story(PIPES["shmtensor"]) == _connection_story(PIPES["stdlib"])


@pytest.mark.parametrize("kind", sorted(PIPES))
def test_recv_bytes_into(kind):
    a, b = PIPES[kind]()
    try:
        a.send_bytes(b"0123456789abcdef")
        buf = bytearray(32)
        assert b.recv_bytes_into(buf) == 16
        assert buf[:16] == b"0123456789abcdef" and not any(buf[16:])
        a.send_bytes(b"0123456789abcdef" * 4)
        with pytest.raises(multiprocessing.BufferTooShort) as info:
            b.recv_bytes_into(bytearray(40))
        assert info.value.args == (b"0123456789abcdef" * 4,)
        a.send_bytes(b"after")  # the channel goes on
        assert b.recv_bytes() == b"after"
    finally:
        a.close(), b.close()


def test_send_to_a_closed_peer_says_so():
    a, b = smp.Pipe()
    b.close()
    with pytest.raises(BrokenPipeError, match="receiving end is closed"):
        a.send("hello")
    with pytest.raises(BrokenPipeError, match="receiving end is closed"):
        a.send(shmtensor.zeros(4))
    with pytest.raises(BrokenPipeError, match="receiving end is closed"):
        a.send_bytes(b"raw")
    a.close()


# -- Queues ----------------------------------------------------------------------------------

def _queue_story(ctx) -> list:
    """A Queue, a JoinableQueue and a SimpleQueue of plain objects, in one process."""
    out = []
    items = [1, "s", 2.5, None, b"\0bytes", [1, (2, 3)], {"a": {1, 2}}, "x" * 100_000]
    q = ctx.Queue(maxsize=3)
    out.append((q.empty(), q.full(), q.qsize()))
    got = []
    for x in items:
        q.put(x)
        got.append(q.get(timeout=JOIN))
    out.append(got == items)
    out.append(_outcome(q.get, True, 0.05))
    out.append(_outcome(q.get_nowait))
    for x in items[:3]:
        q.put(x)
    _wait_for(lambda: not q.empty(), "the queue's feeder")
    out.append((q.full(), q.qsize()))
    out.append(_outcome(q.put, 4, True, 0.05))
    out.append(_outcome(q.put_nowait, 4))
    out.append([q.get(timeout=JOIN) for _ in range(3)])
    q.close()
    q.join_thread()
    out.append(_outcome(q.put, 1)[0])  # ValueError naming the queue (its repr)
    out.append(_outcome(q.get)[0])
    jq = ctx.JoinableQueue()
    for x in items[:4]:
        jq.put(x)
    for _ in range(4):
        jq.get(timeout=JOIN)
        jq.task_done()
    jq.join()
    out.append(_outcome(jq.task_done))
    jq.close()
    jq.join_thread()
    sq = ctx.SimpleQueue()
    out.append(sq.empty())
    sq.put(items[:-1])  # written in put: a pipe takes 64 KB before a reader must read
    out.append(sq.get() == items[:-1])
    out.append(_outcome(sq.put, threading.Lock())[0])  # pickled in put: raises there
    sq.close()
    return out


def test_queues_behave_as_the_stdlibs():
    assert _queue_story(smp.get_context("fork")) == _queue_story(
        multiprocessing.get_context("fork"))


@pytest.mark.parametrize("cls", [_queues.Queue, _queues.JoinableQueue, mpq.Queue],
                         ids=["Queue", "JoinableQueue", "stdlib"])
def test_unpicklable_put_is_reported_through_the_feeder_hook(cls):
    """CPython's test_queue_feeder_on_queue_feeder_error and ..._donot_stop_onexc."""
    seen = []

    class Q(cls):
        @staticmethod
        def _on_queue_feeder_error(e, obj):
            seen.append((type(e), obj, threading.current_thread().name))

    ctx = smp.get_context("fork")
    obj = _Unpicklable()
    q = Q(ctx=ctx)
    q.put(obj)  # returns
    q.put(True)
    assert q.get(timeout=JOIN) is True
    assert seen == [(AttributeError, obj, "QueueFeederThread")]
    q.close()
    q.join_thread()

    q = Q(maxsize=1, ctx=ctx)  # the failed put gives its slot back
    q.put(_Unpicklable())
    q.put(True, timeout=JOIN)
    assert q.qsize() == 1
    assert q.get(timeout=JOIN) is True
    assert q.empty()
    q.close()
    q.join_thread()


def test_the_default_hook_prints_as_the_stdlibs(capfd):
    q = smp.get_context("fork").Queue()
    q.put(threading.Lock())
    q.put("next")
    assert q.get(timeout=JOIN) == "next"
    q.close()
    q.join_thread()
    err = capfd.readouterr().err
    assert "Traceback" in err and "cannot pickle '_thread.lock' object" in err


def test_put_sends_the_backlog_while_the_feeder_waits(monkeypatch):
    """A frame the socket had no room for waits in the buffer; once the reader makes room,
    the next put sends it (in order) rather than leaving it to the feeder thread, which
    gets the GIL only when the putting thread lets go.  The feeder is held in its wait for
    room here, so what arrives after the reader drained the socket was sent by the put."""
    stalled, resume = threading.Event(), threading.Event()

    def held(writer):
        stalled.set()
        resume.wait(JOIN)

    monkeypatch.setattr(_queues, "_wait_for_room", held)
    q = smp.get_context("fork").Queue()
    item = b"x" * 1000
    sent = 0
    try:
        while not stalled.is_set():  # until a frame finds the socket full
            q.put((sent, item))
            sent += 1
            assert sent < 100_000, "the socket never filled"
        assert stalled.wait(JOIN)
        got = [q.get(timeout=JOIN)[0] for _ in range(sent - unsent(q))]  # room again
        waiting = unsent(q)
        q.put((sent, item))  # sends what waits first, as far as the socket takes it
        sent += 1
        by_put = waiting + 1 - unsent(q)
        assert by_put > 0, "the put left every waiting frame to the held feeder"
        got += [q.get(timeout=JOIN)[0] for _ in range(by_put)]
        resume.set()
        got += [q.get(timeout=JOIN)[0] for _ in range(sent - len(got))]
        assert got == list(range(sent))
    finally:
        resume.set()
        q.close()
        q.join_thread()


def test_put_to_a_queue_nobody_reads_says_so():
    q = smp.get_context("fork").Queue(maxsize=4)
    q._reader.close()  # the only reader
    with pytest.raises(BrokenPipeError, match="receiving end is closed") as info:
        q.put("small")
    assert "message was not sent" in str(info.value)
    assert q.qsize() == 0  # the slot was given back
    q.put(b"x" * 100_000)  # too large to send at once: the feeder meets EPIPE
    _wait_for(lambda: not unsent(q), "the feeder")
    with pytest.raises(BrokenPipeError, match="the feeder thread could not send") as info:
        q.put(1)
    assert "this put() did not queue its object" in str(info.value)
    q.close()  # nothing left to raise
    q.join_thread()


def test_simple_queue_put_to_nobody_says_so():
    q = smp.get_context("fork").SimpleQueue()
    q._reader.close()
    with pytest.raises(BrokenPipeError, match="receiving end is closed"):
        q.put("x")
    q.close()


def test_feeder_failure_is_raised_by_close():
    q = smp.get_context("fork").Queue()
    q._reader.close()
    q.put(b"x" * 100_000)  # to the feeder, which meets EPIPE
    _wait_for(lambda: q._failures, "the feeder to record the failure")
    with pytest.raises(BrokenPipeError, match="the queue is closed"):
        q.close()
    q.join_thread()


# -- fd limits (issue 12: "no resource error is ever swallowed") -----------------------------

def _fill_fds() -> list[int]:
    """Use every fd this process may still open (the caller lowered its limit)."""
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        return held


def _producer_at_the_limit(q, out):
    """Puts that cannot get an fd raise (in put, or from the feeder at the next put); once
    fds are free again the queue works.  Reports what it saw."""
    try:
        # no description of its own for x's hold: each message with x then needs an fd for
        # its in-flight description (with one, it travels instead and needs none)
        ofd_lease._budget[:] = [0]
        x = shmtensor.zeros(1000)
        q.put(("warm", x))  # lease table and segment made while fds are plentiful
        q.put(("warm", b"y" * 50_000, x))
        _wait_for(lambda: not unsent(q), "the feeder")  # sent while fds are plentiful
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        held = _fill_fds()
        sent, errors = 2, []
        try:
            q.put(("shared", x))  # needs an in-flight description: an fd
            sent += 1
        except OSError as e:
            errors.append(("put", e.errno, str(e)))
        q.put(("via feeder", b"z" * 50_000, x))  # too large for put to send: the feeder
        sent += 1
        deadline = time.monotonic() + JOIN
        while time.monotonic() < deadline:
            try:
                q.put(("plain", len(errors)))  # no fd needed
                sent += 1
            except OSError as e:
                errors.append(("later put", e.errno, str(e)))
                break
            time.sleep(0.01)
        for fd in held:
            os.close(fd)
        q.put(("after", x))
        sent += 1
        out.put((sent, errors))
    except BaseException as e:
        out.put(("crashed", repr(e)))
        raise


def test_fd_exhaustion_is_reported_and_nothing_is_lost(lc):
    ctx = smp.get_context("fork")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_producer_at_the_limit, args=(q, out))
    p.start()
    lc.check_pid(p.pid)
    sent, errors = out.get(timeout=JOIN)
    assert sent != "crashed", errors
    got = []
    while len(got) < sent - 1:  # one message was dropped by the feeder and reported
        got.append(q.get(timeout=JOIN))
    assert got[-1][0] == "after" and np.shares_memory(got[0][1], got[-1][1])
    with pytest.raises(Empty):
        q.get(timeout=0.2)
    join_all(p)
    assert p.exitcode == 0
    kinds = [kind for kind, _, _ in errors]
    assert kinds == ["put", "later put"], errors
    for _, code, text in errors:
        assert code == 24 and "ulimit -n" in text and "open" in text
    assert "] put() failed: " in errors[0][2]
    assert "message was not sent" in errors[0][2]
    assert "feeder thread could not send" in errors[1][2]
    assert "this put() did not queue its object" in errors[1][2]
    assert [m[0] for m in got].count("via feeder") == 0
    del got


def _dropped(error: str) -> int:
    """How many queued messages a put's error says the feeder thread dropped."""
    if "feeder thread could not send" not in error:
        return 0
    many = re.search(r"(\d+) messages were dropped", error)
    return int(many.group(1)) if many else 1


def _produce_until_refused(q, n, limit):
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    returned, dropped, errors = 0, 0, []
    for i in range(n):
        try:
            q.put(np.full(12_800, i, dtype=np.float64))  # 100 KB, copied to shared memory
            returned += 1
        except OSError as e:
            errors.append(str(e))
            dropped += _dropped(str(e))
            break
    _wait_for(lambda: not unsent(q), "the feeder")  # what it meets is raised by a put
    while True:
        try:
            q.put(("done", returned, dropped, errors))
            break
        except OSError as e:
            errors.append(str(e))
            dropped += _dropped(str(e))
    q.close()
    q.join_thread()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_producer_under_a_low_fd_limit_loses_nothing(method, lc):
    """Issue 12's case: a consumer keeps every 100 KB array; the producer's fds run out.
    Every put() that returned arrived, but for those a later call reported dropped; a put
    that could not send raised, naming the limit and the fix."""
    ctx = smp.get_context(method)
    q = ctx.Queue()
    p = ctx.Process(target=_produce_until_refused, args=(q, 600, 256))
    p.start()
    lc.check_pid(p.pid)
    kept = []
    while True:
        m = q.get(timeout=JOIN)
        if isinstance(m, tuple):
            break
        kept.append(m)
    _, returned, dropped, errors = m
    join_all(p)
    assert p.exitcode == 0
    assert len(kept) == returned - dropped
    values = [int(a[0]) for a in kept]
    assert values == sorted(set(values)) and all((a == a[0]).all() for a in kept)
    for error in errors:  # fewer fds per array (slabs) may let all 600 through
        assert "ulimit -n" in error and "256" in error, error
    del kept


def _put_past_the_file_size_limit(strategy, out):
    smp.set_sharing_strategy(strategy)
    q = smp.get_context("fork").Queue()
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    try:
        q.put(np.ones(1 << 20))  # 8 MB: its segment cannot grow past 1 MB
        seen = None
    except OSError as e:
        seen = (e.errno, str(e))
    q.put(np.ones(1000))  # the queue goes on
    out.put((seen, float(q.get(timeout=JOIN).sum())))
    q.close()
    q.join_thread()


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_the_file_size_limit_is_named(strategy, lc):
    ctx = smp.get_context("fork")
    out = ctx.Queue()
    p = ctx.Process(target=_put_past_the_file_size_limit, args=(strategy, out))
    p.start()
    lc.check_pid(p.pid)
    seen, total = out.get(timeout=JOIN)
    join_all(p)
    assert p.exitcode == 0
    assert seen is not None and seen[0] == 27, seen  # EFBIG
    assert "ulimit -f" in seen[1] and "1048576 bytes" in seen[1]
    assert total == 1000.0


# -- Manager proxies in children that did not make them ---------------------------------------

def _use_proxies(d, q):
    d["child"] = os.getpid()
    q.put(("hello", sorted(d.keys())))


@pytest.mark.parametrize("method", SPAWNING)
@pytest.mark.parametrize("kind", ["stdlib", "shmtensor"])
def test_manager_proxies_in_spawned_children(method, kind, lc):
    ctx = multiprocessing.get_context(method) if kind == "stdlib" else smp.get_context(method)
    with smp.get_context(method).Manager() as m:
        d, q = m.dict(parent=1), m.Queue()
        p = ctx.Process(target=_use_proxies, args=(d, q))
        p.start()
        join_all(p)
        assert p.exitcode == 0
        assert d["child"] == p.pid
        assert q.get(timeout=JOIN) == ("hello", ["child", "parent"])
        del d, q


def test_a_proxy_works_in_a_child_that_never_imported_shmtensor(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing, sys

        def child(d):
            d["child"] = "ok"

        if __name__ == "__main__":
            import shmtensor.multiprocessing as smp
            method = sys.argv[1]
            with smp.get_context(method).Manager() as m:
                d = m.dict()
                p = multiprocessing.get_context(method).Process(target=child, args=(d,))
                p.start()
                p.join(60)
                print(p.exitcode, dict(d))
    """))
    for method in SPAWNING:
        run = subprocess.run([sys.executable, str(script), method], capture_output=True,
                             text=True, timeout=JOIN * 2)
        assert run.returncode == 0, run.stderr
        assert run.stdout.split("\n")[0] == "0 {'child': 'ok'}", run.stderr


def test_the_serializer_name_pickles_as_its_registration():
    from shmtensor.multiprocessing import _managers
    name = pickle.loads(pickle.dumps(_managers.SERIALIZER))
    assert name == "shmtensor" and name is _managers.SERIALIZER
    assert multiprocessing.managers.listener_client["shmtensor"][1] is _managers._Client


# -- The same program through both ------------------------------------------------------------

def _child_program(q, d, conn):
    d["from child"] = q.get(timeout=JOIN)
    conn.send_bytes(bytes(range(16)))
    conn.send(("reply", [1, 2]))
    q.put({"answer": 42})


def _program(ctx) -> list:
    """A small program of plain objects; returns what it observed."""
    out = []
    seen = []
    q = ctx.Queue()

    class Hooked(type(q)):
        @staticmethod
        def _on_queue_feeder_error(e, obj):
            seen.append((type(e).__name__, type(obj).__name__))

    hq = Hooked(maxsize=2, ctx=ctx)
    hq.put(_Unpicklable())
    hq.put("after")
    out.append(hq.get(timeout=JOIN))
    out.append(list(seen))
    hq.close()
    hq.join_thread()
    a, b = ctx.Pipe()
    with ctx.Manager() as m:
        d = m.dict()
        p = ctx.Process(target=_child_program, args=(q, d, b))
        p.start()
        q.put(("question", 6 * 7))
        buf = bytearray(20)
        out.append(a.recv_bytes_into(buf))
        out.append(bytes(buf))
        out.append(a.recv())
        out.append(q.get(timeout=JOIN))
        join_all(p)
        out.append(p.exitcode)
        out.append(dict(d))
        del d
    a.close(), b.close()
    q.close()
    q.join_thread()
    return out


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_the_same_program_gives_the_same_results(method, lc):
    ours = _program(smp.get_context(method))
    theirs = _program(multiprocessing.get_context(method))
    assert ours == theirs
    assert ours[0] == "after" and ours[1] == [("AttributeError", "_Unpicklable")]
    assert ours[2] == 16 and ours[-1] == {"from child": ("question", 42)}
