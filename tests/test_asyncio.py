"""Awaitable receive and send (issue 28, asyncio): ``Queue.get_async``/``put_async``,
``SimpleQueue.get_async``/``put_async``, ``Connection.recv_async``/``send_async``.

They wait on the event loop's readiness of the channel's socket, never on a thread; a
cancelled awaiter loses no message and leaves no reader registered; many awaiters of one
loop get one message each, the same messages a synchronous reader gets.
"""

from __future__ import annotations

import asyncio
import os
import threading
from queue import Empty, Full

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp
from shmtensor import _aio

from conftest import join_all
from helpers import stall_mid_message

JOIN = 60  # seconds: only reached when something deadlocks
N = 50


def run(coro, timeout=JOIN):
    """Run ``coro`` in a new loop, bounded by ``timeout`` (a deadlock fails the test)."""
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


def _fds() -> set[str]:
    """This process's open fds, but the lease descriptions shmtensor keeps for reuse."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").endswith("_lease (deleted)"):
                out.add(fd)
        except OSError:  # the one listdir used
            pass
    return out


async def _until(check, what: str) -> None:
    """Let the loop run until ``check()`` holds (a deadline, not a timed assertion)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + JOIN
    while not check():
        assert loop.time() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.001)


def _watched(fd: int) -> bool:
    """Whether the running loop has a reader or writer on ``fd`` (removed here if so)."""
    loop = asyncio.get_running_loop()
    return loop.remove_reader(fd) | loop.remove_writer(fd)


def _waiting(conn) -> int:
    """How many awaiters of the running loop wait behind the one watching ``conn``."""
    line = (conn._lines or {}).get(asyncio.get_running_loop())
    return -1 if line is None else len(line.waiting)


def _line(q):
    """The running loop's line of ``get_async`` awaiters on ``q`` (a FIFO asyncio.Lock
    whose holder tries the channel), or None before the loop's first awaiter."""
    return q._awaiting.get(asyncio.get_running_loop())


def _in_line(q) -> int:
    """How many awaiters of the running loop wait behind the one trying ``q``."""
    line = _line(q)
    return -1 if line is None or not line.locked() else len(line._waiters or ())


def _messages(n: int) -> list:
    """Distinct messages, half of them arrays that cross through shared memory."""
    return [shmtensor.full((10_000,), i, dtype=np.int64) if i % 2 else ("msg", i)
            for i in range(n)]


def _key(m) -> tuple:
    return ("array", int(m[0])) if isinstance(m, np.ndarray) else m


def _sync_reference(n: int) -> list:
    """What a synchronous reader gets for the same puts."""
    q = smp.Queue()
    try:
        for m in _messages(n):
            q.put(m)
        return [_key(q.get(timeout=JOIN)) for _ in range(n)]
    finally:
        q.close()
        q.join_thread()


def test_many_awaiters_and_a_cancelled_one_get_what_a_synchronous_reader_gets():
    expected = _sync_reference(N)
    q = smp.Queue()

    async def main():
        threads = threading.active_count()
        getters = [asyncio.create_task(q.get_async()) for _ in range(N)]
        await _until(lambda: _in_line(q) == N - 1, "every awaiter waiting")
        assert threading.active_count() == threads, "a thread per pending call"
        cancelled = getters.pop(7)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        for m in _messages(N):
            q.put(m)
        got = [_key(m) for m in await asyncio.gather(*getters)]
        last = _key(q.get(timeout=JOIN))  # the message the cancelled one did not take
        assert _in_line(q) == -1, "an awaiter left in line"
        return got + [last]

    try:
        got = run(main())
        assert got == expected  # the same messages, in the same order: none lost or twice
    finally:
        q.close()
        q.join_thread()


def test_a_cancelled_awaiter_then_a_synchronous_get_gets_the_next_message():
    q = smp.Queue()

    async def main():
        first = asyncio.create_task(q.get_async())
        await _until(lambda: _in_line(q) == 0, "the awaiter trying")
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert _in_line(q) == -1, "the line is held after its last awaiter left"

    try:
        run(main())
        q.put("next")
        assert q.get(timeout=JOIN) == "next"
    finally:
        q.close()
        q.join_thread()


def test_an_awaiter_cancelled_while_a_message_is_written_loses_nothing():
    q = smp.Queue()
    finish = stall_mid_message(q)

    async def main():
        task = asyncio.create_task(q.get_async())
        await asyncio.sleep(0.05)  # it tries the channel, finds nothing whole, waits
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert _in_line(q) == -1, "the line is held after its last awaiter left"

    try:
        run(main())
        finish()
        assert q.get(timeout=JOIN)[0] == "late"  # the message is whole, and not lost
        q.put("after")
        assert run(q.get_async()) == "after"
    finally:
        finish()
        q.close()
        q.join_thread()


def test_get_async_with_a_timeout_bounds_the_wait_for_a_message_being_written():
    q = smp.Queue()
    finish = stall_mid_message(q)
    try:
        with pytest.raises(Empty):
            run(q.get_async(timeout=0.2))
        finish()
        assert run(q.get_async())[0] == "late"
    finally:
        finish()
        q.close()
        q.join_thread()


def test_timeouts_raise_what_the_synchronous_calls_raise():
    q = smp.Queue(maxsize=1)
    a, b = smp.Pipe()

    async def main():
        with pytest.raises(Empty):
            await q.get_async(timeout=0.05)
        with pytest.raises(Empty):
            await q.get_async(block=False)
        await q.put_async("only")
        with pytest.raises(Full):
            await q.put_async("more", timeout=0.05)
        with pytest.raises(Full):
            await q.put_async("more", block=False)
        assert await q.get_async(timeout=JOIN) == "only"
        await q.put_async("room again", timeout=JOIN)
        assert await q.get_async(timeout=JOIN) == "room again"
        # no timeout= on the Connection, as on recv(): asyncio's own, and the end still works
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(b.recv_async(), 0.05)
        assert not _watched(b.fileno())
        await a.send_async("after the timeout")
        assert await b.recv_async() == "after the timeout"

    try:
        run(main())
    finally:
        a.close()
        b.close()
        q.close()
        q.join_thread()


def test_put_async_waits_for_room_without_blocking_the_loop():
    q = smp.Queue(maxsize=2)

    async def main():
        await q.put_async(0)
        await q.put_async(1)
        waiting = asyncio.create_task(q.put_async(2))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        assert await q.get_async() == 0  # the loop runs while the put waits
        await asyncio.wait_for(waiting, JOIN)
        return [await q.get_async(), await q.get_async()]

    try:
        assert run(main()) == [1, 2]
    finally:
        q.close()
        q.join_thread()


def _produce(q, n):
    for m in _messages(n):
        q.put(m)


@pytest.mark.parametrize("kind", ["Queue", "SimpleQueue"])
def test_awaiters_with_a_producer_process(kind, lc):
    ctx = smp.get_context("spawn")
    q = getattr(ctx, kind)()
    p = ctx.Process(target=_produce, args=(q, N))
    p.start()

    async def main():
        return await asyncio.gather(*(q.get_async() for _ in range(N)))

    try:
        got = run(main())
        assert sorted(map(_key, got)) == sorted(map(_key, _messages(N)))
        join_all(p)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()
            p.join(5)
        q.close()
        if kind == "Queue":
            q.join_thread()


def test_connection_recv_async_and_send_async_in_one_loop_with_large_frames():
    a, b = smp.Pipe()
    arrays = [shmtensor.full((8192,), i, dtype=np.int64) for i in range(300)]
    large = bytes(range(256)) * 20_000  # 5 MB by value: many times the socket's buffer
    before = _fds()

    async def main():
        # a frame larger than the socket holds, with its reader in the same loop: the
        # send must not block the loop; 300 fds take a follow-up fd byte after the header
        sends = asyncio.gather(a.send_async(large), a.send_async((arrays, large)),
                               a.send_async("small"))
        got = [await b.recv_async() for _ in range(3)]
        await sends
        await b.send_async("back")
        got.append(await a.recv_async())
        assert not _watched(a.fileno()) and not _watched(b.fileno())
        return got

    try:
        first, (got_arrays, second), small, back = run(main())
        assert first == large and second == large and small == "small" and back == "back"
        assert [int(x[0]) for x in got_arrays] == list(range(300))
        del got_arrays
    finally:
        a.close()
        b.close()
    shmtensor.empty_cache()  # received segments idle in the receive cache keep an fd
    assert _fds() <= before, "fds left open"


def test_a_send_cancelled_after_its_first_byte_is_finished_and_one_not_begun_is_not_sent():
    a, b = smp.Pipe()
    large = b"x" * 5_000_000

    async def main():
        begun = asyncio.create_task(a.send_async(large))
        queued = asyncio.create_task(a.send_async("never sent"))
        await _until(lambda: a._senders and a._senders[asyncio.get_running_loop()]
                     .jobs and a._senders[asyncio.get_running_loop()].jobs[0].started,
                     "the large frame begun")
        begun.cancel()
        queued.cancel()
        for t in (begun, queued):
            with pytest.raises(asyncio.CancelledError):
                await t
        assert await b.recv_async() == large  # the begun frame, whole
        await a.send_async("next")
        assert await b.recv_async() == "next"  # ... and not the one that never began
        assert not a._senders, "the sender is kept after its last frame"

    try:
        run(main())
    finally:
        a.close()
        b.close()


def test_simple_queue_put_async_and_a_thread_put_each_arrive_whole():
    q = smp.SimpleQueue()
    large = b"y" * 3_000_000

    async def main():
        sending = asyncio.create_task(q.put_async(large))
        t = threading.Thread(target=q.put, args=("from a thread",))
        t.start()  # another writer: each message whole, never interleaved
        got = [await q.get_async(), await q.get_async()]
        await sending
        t.join(JOIN)
        assert not t.is_alive()
        return got

    try:
        got = run(main())
        assert len(got) == 2 and large in got and "from a thread" in got
    finally:
        q.close()


def test_closing_a_connection_wakes_its_awaiter():
    a, b = smp.Pipe()

    async def main():
        task = asyncio.create_task(b.recv_async())
        await _until(lambda: b._lines, "the awaiter watching")
        b.close()
        with pytest.raises(OSError, match="closed"):
            await task

    try:
        run(main())
    finally:
        a.close()


def test_two_loops_in_two_threads_share_a_queue():
    q = smp.Queue()
    got: list = []

    async def ten():
        return await asyncio.gather(*(q.get_async() for _ in range(10)))

    def reader():
        got.extend(run(ten()))

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for i in range(20):
            q.put(i)
        for t in threads:
            t.join(JOIN)
            assert not t.is_alive()
        assert sorted(got) == list(range(20))
    finally:
        q.close()
        q.join_thread()


class _Ctx:
    """What a job needs of a SendContext: the fds it sends."""

    def __init__(self, fds):
        self.fds = fds

    def wire_fds(self):
        return self.fds

    def release(self):
        pass


@pytest.mark.parametrize("n, nfds", [(10, 0), (10, 3), (100_000, 300), (1 << 22, 2)])
def test_the_senders_pieces_are_a_frame_the_reader_takes(n, nfds):
    """A frame the sender writes piece by piece is what ``FrameReader`` reads: the
    payload, and every fd (more than 253 need a follow-up byte)."""
    import socket

    from shmtensor.ipc import scm_rights
    r, w = os.pipe()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    payload = os.urandom(n)
    job = _aio._Job(payload, _Ctx([r] * nfds), None)
    writer = threading.Thread(target=job.write, args=(a, 0))
    writer.start()
    try:
        reader = scm_rights.FrameReader()
        assert reader.read(b, None)
        data, fds = reader.take(lambda d, f: (bytes(d), list(f)))
        writer.join(JOIN)
        assert not writer.is_alive()
        assert data == payload and len(fds) == nfds
        scm_rights.close_fds(fds)
    finally:
        for s in (a, b):
            s.close()
        os.close(r)
        os.close(w)
