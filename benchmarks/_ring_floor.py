"""The ring (``shmtensor.ipc.ring``) against the stdlib and the fan-in floor, in one run.

``python -m benchmarks._ring_floor [ROUNDS]``: each round runs, interleaved:

* fan-in, 8 spawned producers x ``COUNT`` items -> 1 consumer, 1 KiB messages:
  the stdlib's ``multiprocessing.Queue(64)`` carrying 1 KiB ``bytes``; the ring (64
  records of 1,040 bytes); and the floor of ``benchmarks._fanin_floor`` (32-byte records
  counted by two semaphores, no crash safety, nothing carried);
* round trip of 1 KiB ``bytes`` between two processes: the stdlib's ``Pipe``
  (``send_bytes``/``recv_bytes``, its fastest path) and ``Queue``, and two rings.

* one call: a ``put`` then a ``get`` of 1 KiB in one process, nobody else on the ring
  (what a call itself costs).

Rings run with their default spin (``SPIN``) and with none ("no spin": every wait sleeps
on the futex at once), each on the C extension ("C") and on the pure-Python path
("Python", ``SHMTENSOR_PURE_PYTHON=1``).  Every session runs in a fresh process (and its
children), with the environment of its path.

Each line is one session: items/s or microseconds per round trip, with the 1-minute load
average at its start.

Children run with ``OPENBLAS_NUM_THREADS=1``: importing shmtensor imports numpy, whose
OpenBLAS threads spin (yielding) for a while after they start, and a round trip between
spinning rings took 3x as long beside them (12 us against 4.3 us, adjacent runs; no case
here uses BLAS).

Written on the 2-vCPU session VM (x86-64, Python 3.11, other sessions' tests running
beside it: the load column says how much); the numbers in the report of issue 27's ring
come from there.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time

import psutil

from shmtensor.ipc.ring import SPIN, Ring

from ._harness import check_exit_codes, stop_processes

PRODUCERS = 8  # as in benchmarks._fanin_floor
COUNT = 4000
CAPACITY = 64
PAYLOAD = bytes(range(256)) * 4  # 1 KiB
TRIPS = 2000


def _attach(pid: int, fd: int, spin: float) -> Ring:
    """The ring whose memfd is ``fd`` in process ``pid`` (spawned children inherit nothing)."""
    own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    try:
        ring = Ring.attach(own)
    finally:
        os.close(own)
    ring.spin = spin
    return ring


def _spin(kind: str) -> float:
    return 0.0 if kind.endswith("no spin") else SPIN


def _ring_producer(pid: int, fd: int, spin: float, ready, go) -> None:
    ring = _attach(pid, fd, spin)
    put, data = ring.put, PAYLOAD
    ready.put(None)
    go.wait()
    for _ in range(COUNT):
        put(data)
    ring.close()


def _queue_producer(q, ready, go) -> None:
    ready.put(None)
    go.wait()
    for _ in range(COUNT):
        q.put(PAYLOAD)


def fan_in(kind: str) -> float:
    """Items/s of 8 producers -> 1 consumer."""
    if kind == "floor":
        from . import _fanin_floor
        assert (_fanin_floor.PRODUCERS, _fanin_floor.COUNT) == (PRODUCERS, COUNT)
        return float(_fanin_floor.session("ring", "32-byte record")["rate"])
    ctx = multiprocessing.get_context("spawn")
    ready, go = ctx.SimpleQueue(), ctx.Event()
    ring = q = None
    if kind.startswith("ring"):
        ring = Ring.create(CAPACITY, 1024 + 16)
        ring.spin = _spin(kind)
        procs = [ctx.Process(target=_ring_producer,
                             args=(os.getpid(), ring.fd, ring.spin, ready, go))
                 for _ in range(PRODUCERS)]
    else:
        q = ctx.Queue(CAPACITY)
        procs = [ctx.Process(target=_queue_producer, args=(q, ready, go))
                 for _ in range(PRODUCERS)]
    n = PRODUCERS * COUNT
    try:
        for p in procs:
            p.start()
        for _ in procs:
            ready.get()
        go.set()
        t0 = time.perf_counter()
        if ring is not None:
            get = ring.get
            for _ in range(n):
                get(timeout=60)
        else:
            assert q is not None
            for _ in range(n):
                q.get(timeout=60)
        elapsed = time.perf_counter() - t0
    finally:
        stop_processes(procs, 60)
        if ring is not None:
            ring.close()
    check_exit_codes(procs, "producers")
    return n / elapsed


def _ring_echo(pid: int, there: int, back: int, spin: float) -> None:
    inbox, outbox = _attach(pid, there, spin), _attach(pid, back, spin)
    for _ in range(TRIPS + 1):
        outbox.put(inbox.get(timeout=60))
    inbox.close()
    outbox.close()


def _pipe_echo(conn) -> None:
    for _ in range(TRIPS + 1):
        conn.send_bytes(conn.recv_bytes())


def _queue_echo(there, back) -> None:
    for _ in range(TRIPS + 1):
        back.put(there.get(timeout=60))


def round_trip(kind: str) -> float:
    """Microseconds per round trip of 1 KiB between two processes."""
    ctx = multiprocessing.get_context("spawn")
    rings: list[Ring] = []
    if kind.startswith("ring"):
        rings = [Ring.create(CAPACITY, 1024 + 16), Ring.create(CAPACITY, 1024 + 16)]
        there, back = rings
        there.spin = back.spin = _spin(kind)
        proc = ctx.Process(target=_ring_echo,
                           args=(os.getpid(), there.fd, back.fd, back.spin))
        send, recv = there.put, back.get
    elif kind == "Pipe":
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_pipe_echo, args=(theirs,))
        send, recv = mine.send_bytes, mine.recv_bytes
    else:
        qt, qb = ctx.Queue(CAPACITY), ctx.Queue(CAPACITY)
        proc = ctx.Process(target=_queue_echo, args=(qt, qb))
        send, recv = qt.put, qb.get
    try:
        proc.start()
        send(PAYLOAD)
        recv()  # the echo is up and both sides are warm
        t0 = time.perf_counter()
        for _ in range(TRIPS):
            send(PAYLOAD)
            recv()
        elapsed = time.perf_counter() - t0
    finally:
        stop_processes([proc], 60)
        for ring in rings:
            ring.close()
    check_exit_codes([proc], "echo")
    return elapsed / TRIPS * 1e6


def one_call(kind: str) -> float:
    """Microseconds per put and get of 1 KiB, one process, nobody else on the ring."""
    with Ring.create(CAPACITY, 1024 + 16) as ring:
        put, get, data = ring.put, ring.get, PAYLOAD
        for _ in range(1000):
            put(data)
            get()
        n = 100_000
        t0 = time.perf_counter()
        for _ in range(n):
            put(data)
            get()
        return (time.perf_counter() - t0) / n * 1e6


RINGS = ["ring C", "ring Python", "ring C, no spin", "ring Python, no spin"]
SECTIONS = {  # name: (what it runs, unit, format, its kinds)
    "one call": (one_call, "us", "9.2f", ["ring C", "ring Python"]),
    "fan-in": (fan_in, "items/s", "9.0f", ["stdlib Queue(64)", *RINGS, "floor"]),
    "round trip": (round_trip, "us", "9.1f", ["Pipe", "Queue", *RINGS]),
}


def session(section: str, kind: str) -> float:
    """One session, in a process of its own whose environment picks the ring's path."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1",  # see the docstring
               SHMTENSOR_PURE_PYTHON="1" if "Python" in kind else "")
    r = subprocess.run([sys.executable, "-m", "benchmarks._ring_floor", "--session",
                        section, kind], env=env, capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise RuntimeError(f"{section} / {kind} failed:\n{r.stdout}\n{r.stderr}")
    return float(r.stdout.split()[-1])


def main(rounds: int) -> None:
    print(f"fan-in: {PRODUCERS} producers x {COUNT} items of 1 KiB -> 1 consumer, capacity "
          f"{CAPACITY}; round trip: {TRIPS} x 1 KiB; {os.cpu_count()} CPUs", flush=True)
    for r in range(rounds):
        for section, (_, unit, fmt, kinds) in SECTIONS.items():
            for kind in kinds:
                load = psutil.getloadavg()[0]
                print(f"round {r + 1}  {section:<10} {kind:<20} "
                      f"{format(session(section, kind), fmt)} {unit:<8} (load {load:.2f})",
                      flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--session"]:
        section, kind = sys.argv[2:4]
        from shmtensor.ipc import ring as _ring
        assert (_ring._cput is None) == ("Python" in kind), "the path is not the one asked"
        print(SECTIONS[section][0](kind))
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
