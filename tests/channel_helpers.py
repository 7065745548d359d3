"""Process targets for tests/test_channel.py and tests/test_channel_kill.py (importable
by spawned children), and what the queue tests ask of a queue's feeder."""

from __future__ import annotations

import queue

import numpy as np

import shmtensor


def mixed_message(wid: int, i: int) -> object:
    """Message ``i`` of producer ``wid``: a small pickle, a shared array, an array that
    crosses through a segment, or bytes longer than a datagram (in a memfd)."""
    kind = i % 4
    if kind == 0:
        return ("small", wid, i)
    if kind == 1:
        return ("shared", wid, i, shmtensor.full((64,), wid * 100_000 + i, dtype=np.int64))
    if kind == 2:
        return ("segment", wid, i, np.full(1 << 14, wid * 100_000 + i, dtype=np.float64))
    return ("long", wid, i, bytes([i & 0xFF]) * (70 << 10))


def check_mixed(msg: object) -> tuple[int, int] | None:
    """(producer, number) of a message of :func:`mixed_message`, or None if it is not
    whole and right."""
    try:
        kind, wid, i = msg[:3]  # type: ignore[index]
        if msg != mixed_message(wid, i) if kind == "small" else False:
            return None
        if kind in ("shared", "segment"):
            a = msg[3]  # type: ignore[index]
            if a.shape != ((64,) if kind == "shared" else (1 << 14,)) or \
                    not (a == wid * 100_000 + i).all():
                return None
        elif kind == "long":
            if msg[3] != bytes([i & 0xFF]) * (70 << 10):  # type: ignore[index]
                return None
        elif kind != "small":
            return None
        return wid, i
    except Exception:
        return None


def produce_mixed(q, wid: int, n: int) -> None:
    for i in range(n):
        q.put(mixed_message(wid, i))
    q.close()
    q.join_thread()


def consume_mixed(q, out) -> None:
    """Take messages until None; report (all intact, [(producer, number), ...])."""
    seen, ok = [], True
    while True:
        msg = q.get(timeout=60)
        if msg is None:
            break
        got = check_mixed(msg)
        ok = ok and got is not None
        if got is not None:
            seen.append(got)
        del msg
    out.put((ok, seen))
    out.close()
    out.join_thread()


def unsent(q) -> int:
    """Frames ``q``'s feeder has not sent yet: those in its buffer, and one being sent
    (the feeder holds the sending lock while a frame is off the buffer and unsent)."""
    if not q._sending.lock.acquire(False):
        return len(q._buffer) + 1
    try:
        return len(q._buffer)
    finally:
        q._sending.lock.release()
