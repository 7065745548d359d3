"""SIGKILL at random points of a Queue's channel (issue 27): producers, consumers, and
processes killed while they hold the channel's writers' or readers' lock, with the
survivors running on; then every acknowledged message is counted.

What may be lost (docs/channel-design.md, "Failure table", and the ring's in
docs/architecture.md):

* a producer, whenever it dies: nothing it acknowledged.  A producer acknowledges a
  message once ``put()`` returned and its queue has nothing left unsent (``_unsent``: its
  buffer empty and no frame being sent: the feeder thread, or ``put`` itself, has written
  the record); a record written is
  delivered, the datagram of a record never written (a death between the two) is closed.
* a consumer, whenever it dies: at most one message, the one it was taking (the ring's
  head moved, or its body's datagram read off the side socket, before the consumer
  logged it); a survivor that meets such a record gets ``Lost``, not a hang.
* a lock holder: a writer, nothing acknowledged; a reader stopped before the channel's
  hook read the record, nothing; after it, at most the record's body (then ``Lost``).

Nothing arrives twice or corrupt, shared arrays included (their producer may be dead);
the channel never wedges; no process, fd or segment is left (``lc``).

Children are forked; every wait has a deadline and every child's exit code is checked."""

from __future__ import annotations

import mmap
import os
import queue
import random
import signal
import struct
import time

import pytest

import shmtensor.multiprocessing as smp
from shmtensor._channel import Lost
from shmtensor.ipc import ring as ringmod

from channel_helpers import check_mixed, mixed_message, unsent

pytestmark = pytest.mark.skipif(not ringmod.HAVE_RING, reason="needs memfd, OFD locks, futex")

ctx = smp.get_context("fork")
JOIN = 30  # seconds: only reached when something is wedged
PRODUCERS, CONSUMERS = 2, 2
BACKLOG = 64  # a producer waits while more than this are in the ring or its feeder

# The board: an anonymous shared mapping the children inherit.  Counters are written
# through memoryview items (one store each: a process killed mid-store leaves the old or
# the new value, never a torn one); each has one writer.
_STOP, _DONE = 0, 1  # bytes: producers stop; consumers drain and exit
_STALLED = 64  # bytes: _STALLED + id is 1 while that staller holds a lock, stalled
_ACKS = 1024  # u32 per producer id: messages acknowledged
_LOST = 4096  # u32 per consumer id: Lost raised to it
_LOGS = 8192  # per consumer id: a u32 count, padding, then LOG u64 entries
LOG = 1 << 14
MAX_IDS = 512
_CORRUPT = 1 << 63
_SIZE = _LOGS + MAX_IDS * (8 + 8 * LOG)


def _u32(board: mmap.mmap) -> memoryview:
    return memoryview(board).cast("I")


def _log_base(cid: int) -> int:
    return _LOGS + cid * (8 + 8 * LOG)


# -- the workers ------------------------------------------------------------------------

def _stall_in(method: str, board: mmap.mmap, slot: int, nth: int, after: bool) -> None:
    """Make this process's ``Ring.<method>`` stop, holding the ring's lock, in its
    ``nth`` call that reaches the hook: before the channel's hook runs, or ``after`` it
    (a side record's datagram sent, or read, and the record not yet written, or taken).
    It flags the board and sleeps there until killed."""
    real = getattr(ringmod.Ring, method)
    calls = [0]

    def stall():
        board[_STALLED + slot] = 1
        time.sleep(JOIN)
        os._exit(4)  # not reached: killed

    def stalling(self, *args, hook=None, **kwargs):
        def wrapped(*hook_args):
            calls[0] += 1
            if calls[0] == nth and not after:
                stall()
            if hook is not None:
                hook(*hook_args)
            if calls[0] == nth and after:
                stall()
        return real(self, *args, hook=wrapped, **kwargs)

    setattr(ringmod.Ring, method, stalling)  # this child's class only


def producer(q, board: mmap.mmap, wid: int, stall: tuple[int, int, bool] | None) -> None:
    """Put mixed messages until told to stop, acknowledging each once it is in the
    channel; then flush and exit 0."""
    if stall is not None:
        _stall_in("put", board, *stall)
    acks = _u32(board)
    ring = q._chan.ring
    seq = 0
    while not board[_STOP]:
        q.put(mixed_message(wid, seq))
        seq += 1
        if not unsent(q):  # every message put so far is a record of the ring
            acks[_ACKS // 4 + wid] = seq
        while ring.qsize() + unsent(q) > BACKLOG and not board[_STOP]:
            time.sleep(0.0005)
    deadline = time.monotonic() + JOIN
    while unsent(q):
        if time.monotonic() > deadline:
            os._exit(6)
        time.sleep(0.001)
    acks[_ACKS // 4 + wid] = seq


def consumer(q, board: mmap.mmap, cid: int, stall: tuple[int, int, bool] | None) -> None:
    """Take messages, logging each ((producer, number), or corrupt); exit 0 once the
    producers are done and the queue is empty, 5 once the log is full."""
    if stall is not None:
        _stall_in("get", board, *stall)
    counts, entries = _u32(board), memoryview(board).cast("Q")
    base = _log_base(cid)
    n = 0
    while n < LOG:
        try:
            msg = q.get(timeout=0.05)
        except queue.Empty:
            if board[_DONE]:
                return
            continue
        except Lost:
            counts[_LOST // 4 + cid] += 1
            continue
        except Exception:  # a message that cannot be loaded: corrupt
            got = None
        else:
            got = check_mixed(msg)
            del msg
        entries[(base + 8) // 8 + n] = _CORRUPT if got is None else got[0] << 32 | got[1]
        n += 1
        counts[base // 4] = n
    os._exit(5)


# -- the test ---------------------------------------------------------------------------

class Run:
    """The processes of one run, by role, and what was done to them."""

    def __init__(self, q, board: mmap.mmap, lc) -> None:
        self.q, self.board, self.lc = q, board, lc
        self.live: dict[str, list] = {"p": [], "c": []}
        self.ids = {"p": 0, "c": 0}
        self.killed = {"p": 0, "c": 0, "writer": 0, "reader before": 0, "reader after": 0}

    def spawn(self, role: str, stall: tuple[int, int, bool] | None = None):
        k = self.ids[role]
        self.ids[role] += 1
        assert k < MAX_IDS, "more ids than the board has room for"
        p = ctx.Process(target=producer if role == "p" else consumer,
                        args=(self.q, self.board, k, stall), daemon=True)
        p.start()
        self.lc.check_pid(p.pid)
        if stall is None:
            self.live[role].append(p)
        return p, k

    def kill(self, p) -> None:
        p.kill()
        p.join(JOIN)
        assert p.exitcode == -signal.SIGKILL, f"a victim ended with {p.exitcode}"

    def replace_full_consumers(self) -> None:
        for p in [p for p in self.live["c"] if not p.is_alive()]:
            p.join(JOIN)
            assert p.exitcode == 5, f"a consumer ended with {p.exitcode}"
            self.live["c"].remove(p)
            self.spawn("c")

    def finish(self) -> None:
        """Stop the producers (they flush), then let the consumers drain and exit."""
        self.board[_STOP] = 1
        for p in self.live["p"]:
            p.join(JOIN)
            assert p.exitcode == 0, f"a producer ended with {p.exitcode}"
        self.board[_DONE] = 1
        while self.live["c"]:
            p = self.live["c"].pop()
            p.join(JOIN)
            assert p.exitcode in (0, 5), f"a consumer ended with {p.exitcode}"
            if p.exitcode == 5:
                self.spawn("c")

    def stop_all(self) -> None:
        for p in self.live["p"] + self.live["c"]:
            if p.is_alive():
                p.kill()
            p.join(5)


def _count(run: Run) -> tuple[dict[tuple[int, int], int], int, list[int], int]:
    board = run.board
    received: dict[tuple[int, int], int] = {}
    corrupt = 0
    for cid in range(run.ids["c"]):
        base = _log_base(cid)
        (n,) = struct.unpack_from("I", board, base)
        for e in struct.unpack_from(f"{n}Q", board, base + 8):
            if e == _CORRUPT:
                corrupt += 1
            else:
                key = (e >> 32, e & 0xFFFFFFFF)
                received[key] = received.get(key, 0) + 1
    acks = list(struct.unpack_from(f"{run.ids['p']}I", board, _ACKS))
    lost = sum(struct.unpack_from(f"{run.ids['c']}I", board, _LOST))
    return received, corrupt, acks, lost


def _victims(run: Run, rng: random.Random, kills: int, kind: str) -> None:
    for _ in range(kills):
        run.replace_full_consumers()
        if kind == "lock holders":
            role = rng.choice("pc")
            after = rng.random() < 0.5
            slot = run.ids[role] if role == "p" else MAX_IDS // 2 + run.ids[role]
            assert slot < MAX_IDS
            p, _ = run.spawn(role, (slot, rng.randrange(1, 8), after))
            deadline = time.monotonic() + JOIN
            while not run.board[_STALLED + slot]:
                run.replace_full_consumers()
                assert p.is_alive(), f"a staller ended with {p.exitcode}"
                assert time.monotonic() < deadline, (
                    f"a staller ({role}, after={after}) never reached its stall: "
                    f"{run.q._chan.ring.qsize()} records waiting, consumers' exit codes "
                    f"{[c.exitcode for c in run.live['c']]}, producers alive "
                    f"{[c.is_alive() for c in run.live['p']]}")
                time.sleep(0.0005)
            time.sleep(rng.random() * 0.002)
            run.kill(p)
            run.killed["writer" if role == "p" else
                       "reader after" if after else "reader before"] += 1
        else:
            time.sleep(rng.random() * 0.02)
            role = "p" if kind == "producers" else "c"
            victim = run.live[role].pop(rng.randrange(len(run.live[role])))
            run.kill(victim)
            run.killed[role] += 1
            run.spawn(role)


@pytest.mark.parametrize("kind,kills,seed", [
    ("producers", 120, 1),
    ("consumers", 120, 2),
    ("lock holders", 120, 3)])
@pytest.mark.timeout(120)
def test_random_sigkills(lc, kind, kills, seed):
    rng = random.Random(seed)
    board = mmap.mmap(-1, _SIZE)
    q = ctx.Queue()
    run = Run(q, board, lc)
    try:
        for _ in range(PRODUCERS):
            run.spawn("p")
        for _ in range(CONSUMERS):
            run.spawn("c")
        _victims(run, rng, kills, kind)
        run.finish()
    finally:
        run.stop_all()
    received, corrupt, acks, lost = _count(run)
    killed = run.killed
    board.close()
    q.close()
    q.join_thread()
    del q, run  # before any assertion: a failure's traceback keeps its frame's locals

    duplicated = sorted(m for m, c in received.items() if c > 1)
    missing = [(w, s) for w in range(len(acks)) for s in range(acks[w])
               if (w, s) not in received]
    # at most one message per consumer killed while it may hold one (see the docstring)
    may_lose = killed["c"] + killed["reader after"]
    print(f"\n{kind}: killed {killed}, {sum(acks)} acknowledged, {len(received)} "
          f"received, {len(missing)} missing, {lost} reported lost")
    assert corrupt == 0, f"{corrupt} corrupt messages"
    assert not duplicated, f"delivered twice: {duplicated[:10]}"
    assert len(missing) <= may_lose, f"lost {len(missing)} (at most {may_lose}): {missing[:10]}"
    assert lost <= may_lose
    assert sum(acks) > kills  # the survivors kept working
