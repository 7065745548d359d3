"""What a fan-in channel can reach on this machine (a diagnostic for the fan-in of bench_channels).

``python -m benchmarks._fanin_floor [ROUNDS]``: 8 spawned producers put ``COUNT`` items
each, one consumer takes them; aggregate items/s, CPU per item of the producers and the
consumer, and the producers' voluntary context switches per item, for:

* the stdlib's ``Queue(64)`` with a 1 KB numpy array (the fan-in baseline) and with
  ``None`` (the cost of the queue alone, without an array to pickle);
* shmtensor's ``Queue(64)`` with ``None`` and with a shared 1 MB array (the former fan-in row);
* a bounded ring of 32-byte records in shared memory, counted by two POSIX semaphores
  (a futex: no syscall unless someone waits) and written under one lock: the floor of
  any channel that makes no syscall per item, with nothing carried but the record;
* one ``SOCK_SEQPACKET`` datagram per item (1 KB, with 0, 1 or 2 memfds as SCM_RIGHTS, the
  receiver closing them), bounded by a semaphore as ``Queue(64)`` is or unbounded: the
  floor of a datagram channel (no lock: a datagram is sent and taken whole), and what
  each fd per message costs.
"""

from __future__ import annotations

import array
import multiprocessing
import os
import socket
import struct
import sys
import time
from multiprocessing import shared_memory

import numpy as np
import psutil

import shmtensor as st
import shmtensor.multiprocessing as smp

from ._harness import check_exit_codes, stop_processes

PRODUCERS = 8
COUNT = 4000
CAPACITY = 64
_RECORD = struct.Struct("qqqq")
_HEAD = struct.Struct("q")


def _queue_producer(kind: str, q, ready, go) -> None:
    item = {"1 KB plain": lambda: np.ones(128), "None": lambda: None,
            "1 MB shared": lambda: st.zeros(1 << 17)}[kind]()
    ready.put(None)
    go.wait()
    for _ in range(COUNT):
        q.put(item)


def _ring_producer(name: str, free, items, lock, ready, go, k: int) -> None:
    shm = shared_memory.SharedMemory(name)
    buf = shm.buf
    ready.put(None)
    go.wait()
    for i in range(COUNT):
        free.acquire()
        with lock:  # the records go in the order of their places
            (t,) = _HEAD.unpack_from(buf, 0)
            _RECORD.pack_into(buf, 16 + (t % CAPACITY) * _RECORD.size, k, i, 1 << 20, 7)
            _HEAD.pack_into(buf, 0, t + 1)
        items.release()
    del buf
    shm.close()


def _datagram_producer(sock: socket.socket, fds: int, bounded, ready, go) -> None:
    files = [os.memfd_create("floor") for _ in range(fds)]
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", files))] if fds else []
    data, send = bytes(1024), sock.sendmsg
    ready.put(None)
    go.wait()
    for _ in range(COUNT):
        if bounded is not None:
            bounded.acquire()
        send([data], anc)


def _datagram_consumer(sock: socket.socket, n: int, fds: int, bounded) -> None:
    space, recv, close = socket.CMSG_SPACE(4 * fds) if fds else 0, sock.recvmsg, os.close
    for _ in range(n):
        _, anc, _, _ = recv(2048, space)
        for _, _, raw in anc:
            for fd in array.array("i", raw):
                close(fd)
        if bounded is not None:
            bounded.release()


def _cpu(procs) -> tuple[float, int]:
    times = [p.cpu_times() for p in procs]
    switches = [p.num_ctx_switches().voluntary for p in procs]
    return sum(t.user + t.system for t in times), sum(switches)


def session(channel: str, kind: str) -> dict:
    """One fan-in: items/s, CPU per item of producers and consumer, switches per item."""
    ctx = (smp if channel == "shmtensor" else multiprocessing).get_context("spawn")
    ready, go = ctx.SimpleQueue(), ctx.Event()
    shm = pair = None
    if channel == "datagram":
        fds, bounded = int(kind.split()[3]), not kind.endswith("unbounded")
        pair = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sem = ctx.Semaphore(CAPACITY) if bounded else None
        procs = [ctx.Process(target=_datagram_producer, args=(pair[0], fds, sem, ready, go))
                 for _ in range(PRODUCERS)]
    elif channel == "ring":
        shm = shared_memory.SharedMemory(create=True, size=16 + CAPACITY * _RECORD.size)
        free, items, lock = ctx.Semaphore(CAPACITY), ctx.Semaphore(0), ctx.Lock()
        procs = [ctx.Process(target=_ring_producer,
                             args=(shm.name, free, items, lock, ready, go, k))
                 for k in range(PRODUCERS)]
    else:
        q = ctx.Queue(CAPACITY)
        procs = [ctx.Process(target=_queue_producer, args=(kind, q, ready, go))
                 for _ in range(PRODUCERS)]
    try:
        for p in procs:
            p.start()
        for _ in procs:
            ready.get()
        handles = [psutil.Process(p.pid) for p in procs]
        me = psutil.Process()
        c0, s0 = _cpu(handles)
        m0 = me.cpu_times()
        n = PRODUCERS * COUNT
        go.set()
        t0 = time.perf_counter()
        if pair is not None:
            _datagram_consumer(pair[1], n, fds, sem)
        elif shm is not None:
            buf, take, give = shm.buf, items.acquire, free.release
            for j in range(n):
                take()
                _RECORD.unpack_from(buf, 16 + (j % CAPACITY) * _RECORD.size)
                give()
            del buf
        else:
            for _ in range(n):
                q.get(timeout=60)
        elapsed = time.perf_counter() - t0
        m1 = me.cpu_times()
        c1, s1 = _cpu(handles)
    finally:
        stop_processes(procs, 60)
        if shm is not None:
            shm.close()
            shm.unlink()
        for sock in pair or ():
            sock.close()
        st.empty_cache()
    check_exit_codes(procs, "producers")
    return {"rate": n / elapsed, "producers_us": (c1 - c0) / n * 1e6,
            "consumer_us": (m1.user + m1.system - m0.user - m0.system) / n * 1e6,
            "switches": (s1 - s0) / n}


CASES = [("stdlib", "1 KB plain"), ("stdlib", "None"), ("shmtensor", "None"),
         ("shmtensor", "1 MB shared"), ("ring", "32-byte record"),
         ("datagram", "1 KB + 0 fds, bounded"), ("datagram", "1 KB + 1 fds, bounded"),
         ("datagram", "1 KB + 2 fds, bounded"), ("datagram", "1 KB + 0 fds, unbounded"),
         ("datagram", "1 KB + 1 fds, unbounded"), ("datagram", "1 KB + 2 fds, unbounded")]


def main(rounds: int) -> None:
    print(f"{PRODUCERS} producers x {COUNT} items -> 1 consumer, capacity {CAPACITY}; "
          f"load {psutil.getloadavg()[0]:.2f}", flush=True)
    for r in range(rounds):
        for channel, kind in CASES:
            s = session(channel, kind)
            print(f"round {r + 1}  {channel:<10} {kind:<24} {s['rate']:9.0f} items/s   CPU per "
                  f"item: producers {s['producers_us']:5.1f} us, consumer "
                  f"{s['consumer_us']:5.1f} us; producer switches per item "
                  f"{s['switches']:.2f}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
