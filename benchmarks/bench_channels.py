"""Channels: how fast arrays cross between processes through each library's own channel.

Three workloads, each in fresh spawned processes:

* **round trip**: the parent sends a 1 KiB float64 array to a child, which sends it back;
  time per round trip.
* **fan-in**: 8 producers each send the same 1 KiB array ``count`` times to one consumer;
  aggregate arrays/s, counted between the 10% and the 90% mark of the total (the ends,
  where producers start and finish at different times, are left out).
* **fan-out**: one producer sends each 4 MiB array to 4 consumers (one channel per
  consumer, each consumer gets every array and reads one element of it); GB/s delivered.

Every contender copies each message's data once on the producer's side, as a program
that makes fresh data per message would: the stdlib's ``multiprocessing.Queue`` and
shmtensor's with plain numpy arrays (pickled, or copied into a segment), shmtensor's with
shared arrays (the producer writes each message into a fresh ``shmtensor.empty_like``
array: no array is overwritten while in flight), faster-fifo's ``Queue`` (a ring in shared
memory; arrays pickled into it) and iceoryx2's publish-subscribe (each array copied into
a chunk loaned from the publisher's shared memory, the reader woken through an iceoryx2
event).  A consumer reads one element of each array.  Queues are bounded (64 items, 8 for
4 MiB arrays) and so is iceoryx2's subscriber buffer; iceoryx2's publisher retries until
delivered, so nothing is dropped.  A contender whose package does not import is skipped
with the reason.  Rounds are interleaved: each round runs every (workload, contender)
once, in turn; each result is the median round.

This section alone: ``python -m benchmarks.bench_channels [--quick]``.
"""

from __future__ import annotations

import ctypes
import itertools
import multiprocessing
import os
import statistics
import sys
import time
from dataclasses import dataclass
from queue import Empty
from typing import Callable

import numpy as np

import shmtensor as st

from . import _report
from ._harness import check_exit_codes, stop_processes
from ._page import value_label
from ._report import KB, MB, Section, ratio, target

PRODUCERS, CONSUMERS = 8, 4
SMALL, LARGE = KB, 4 * MB
DTYPE = np.dtype(np.float64)
TIMEOUT = 60.0        # one receive; a peer that stays silent this long has failed
START_TIMEOUT = 120.0
ROUND_TRIP, FANIN, FANOUT = "round trip", "fan-in", "fan-out"


def maxsize(nbytes: int) -> int:
    """Items a channel holds: 64 small arrays, 8 large ones (32 MiB per consumer)."""
    return 64 if nbytes <= 64 * KB else 8


def _first(a: np.ndarray) -> float:
    """What a consumer does with an array: read one element of it."""
    return a[0]


# -- channels: one-way, many senders, one receiver; made in the parent, handed to children


class QueueLink:
    """A ``multiprocessing.Queue`` of the stdlib or of shmtensor."""

    def __init__(self, ctx, nbytes: int, senders: int) -> None:
        self.q = ctx.Queue(maxsize(nbytes))

    def sender(self) -> Callable[[np.ndarray], None]:
        return self.q.put

    def receiver(self) -> Callable[[Callable], object]:
        get = self.q.get
        return lambda use: use(get(timeout=TIMEOUT))

    def close(self) -> None:
        self.q.close()
        self.q.join_thread()


class FasterFifoLink:
    """faster-fifo's ``Queue``: a ring of pickled messages in shared memory."""

    def __init__(self, ctx, nbytes: int, senders: int) -> None:
        import faster_fifo
        self.q = faster_fifo.Queue(max_size_bytes=maxsize(nbytes) * (nbytes + 4 * KB))

    def sender(self) -> Callable[[np.ndarray], None]:
        put = self.q.put
        return lambda a: put(a, timeout=TIMEOUT)

    def receiver(self) -> Callable[[Callable], object]:
        get = self.q.get
        return lambda use: use(get(timeout=TIMEOUT))

    def close(self) -> None:
        self.q.close()


_link_ids = itertools.count()
ICEORYX2_SMALL_BUFFER = 8192  # >= the most 1 KiB messages one sender sends in a run


class Iceoryx2Link:
    """iceoryx2: a publish-subscribe service of byte slices (one publisher per sender, one
    subscriber) and an event service through which senders wake the receiver.  Pickles as
    its name: each process opens the services itself."""

    def __init__(self, ctx, nbytes: int, senders: int) -> None:
        self.name = f"shmtensor-bench-{os.getpid()}-{next(_link_ids)}"
        self.nbytes, self.senders = nbytes, senders
        self._held = self._open()  # the parent keeps the services while children use them

    def __getstate__(self) -> dict:
        return {"name": self.name, "nbytes": self.nbytes, "senders": self.senders}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _held=None)

    def _open(self):
        import iceoryx2 as iox2
        iox2.set_log_level_from_env_or(iox2.LogLevel.Error)  # no "No config file" per node
        node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)
        data = (node.service_builder(iox2.ServiceName.new(self.name))
                .publish_subscribe(iox2.Slice[ctypes.c_uint8])
                .max_publishers(self.senders).max_subscribers(1)
                .subscriber_max_buffer_size(self.buffer()).history_size(0)
                .enable_safe_overflow(False).open_or_create())
        event = (node.service_builder(iox2.ServiceName.new(self.name + "-wake")).event()
                 .max_notifiers(self.senders).max_listeners(1).open_or_create())
        return iox2, node, data, event

    def buffer(self) -> int:
        """Samples the subscriber holds per publisher.  Small ones: every message of a run
        (ICEORYX2_SMALL_BUFFER), as iceoryx2's back-pressure (retry until delivered)
        deadlocked under fan-in here: a run never waits on a full buffer."""
        return ICEORYX2_SMALL_BUFFER if self.nbytes <= 64 * KB else maxsize(self.nbytes)

    def sender(self) -> Callable[[np.ndarray], None]:
        iox2, node, data, event = self._open()
        pub = (data.publisher_builder().initial_max_slice_len(self.nbytes)
               .backpressure_strategy(iox2.BackpressureStrategy.RetryUntilDelivered).create())
        notifier = event.notifier_builder().create()
        memmove = ctypes.memmove

        def send(a: np.ndarray) -> None:
            sample = pub.loan_slice_uninit(a.nbytes)
            memmove(sample.payload_ptr, a.ctypes.data, a.nbytes)
            sample.assume_init().send()
            notifier.notify()

        send.ports = (node, data, event, pub, notifier)  # alive as long as send is
        return send

    def receiver(self) -> Callable[[Callable], object]:
        iox2, node, data, event = self._open()
        sub = data.subscriber_builder().create()
        listener = event.listener_builder().create()
        wait = iox2.Duration.from_millis(500)

        def recv(use: Callable):
            deadline = None
            while True:
                sample = sub.receive()
                if sample is not None:
                    try:  # the array is a view of the sample: used before it is released
                        return use(np.frombuffer(sample.payload().as_memory_view(), DTYPE))
                    finally:
                        sample.delete()
                listener.timed_wait(wait)
                deadline = deadline or time.monotonic() + TIMEOUT
                if time.monotonic() > deadline:
                    raise TimeoutError(f"iceoryx2: nothing received for {TIMEOUT:g} s")

        recv.ports = (node, data, event, sub, listener)
        return recv

    def close(self) -> None:
        self._held = None


@dataclass(frozen=True)
class Contender:
    label: str      # shown in the tables
    column: str     # its column in the summary table
    module: str     # the package it needs
    shmtensor_context: bool
    shared: bool    # each message a fresh shared array (else the same plain array)
    link_type: type

    def missing(self) -> str | None:
        """Why this contender can't run here, or None."""
        try:
            __import__(self.module)
        except Exception as e:  # ImportError, or a wheel whose libraries do not load
            return f"{self.module} does not import ({type(e).__name__}: {e})"
        return None

    def context(self):
        if self.shmtensor_context:
            import shmtensor.multiprocessing as smp
            return smp.get_context("spawn")
        return multiprocessing.get_context("spawn")

    def link(self, ctx, nbytes: int, senders: int):
        return self.link_type(ctx, nbytes, senders)

    def messages(self, nbytes: int) -> Callable[[], np.ndarray]:
        """The producer's next message: the same plain array (the channel copies it), or
        a fresh shared array the producer writes it into (never one still in flight)."""
        a = np.full(nbytes // DTYPE.itemsize, 1.0, DTYPE)
        if not self.shared:
            return lambda: a

        def fresh() -> np.ndarray:
            b = st.empty_like(a)
            b[...] = a
            return b
        return fresh


STDLIB = Contender("stdlib mp.Queue", "stdlib", "multiprocessing", False, False, QueueLink)
SHM = Contender("shmtensor Queue, plain", "shmtensor", "shmtensor", True, False, QueueLink)
SHM_SHARED = Contender("shmtensor Queue, shared", "shmtensor", "shmtensor", True, True,
                       QueueLink)
FASTER_FIFO = Contender("faster-fifo Queue", "faster-fifo", "faster_fifo", False, False,
                        FasterFifoLink)
ICEORYX2 = Contender("iceoryx2 publish-subscribe", "iceoryx2", "iceoryx2", False, False,
                     Iceoryx2Link)
CONTENDERS = (STDLIB, SHM, SHM_SHARED, FASTER_FIFO, ICEORYX2)


# -- the processes' bodies (module level: spawned children import them)


def _echo(contender: Contender, inbox, outbox, ready, done, count: int) -> None:
    recv, send = inbox.receiver(), outbox.sender()
    ready.put(None)
    for _ in range(count):
        recv(send)
    done.wait()


def _produce(contender: Contender, link, nbytes: int, count: int, ready, go, done) -> None:
    send, message = link.sender(), contender.messages(nbytes)
    ready.put(None)
    go.wait()
    for _ in range(count):
        send(message())
    done.wait()


def _consume(link, warm: int, count: int, ready) -> None:
    recv = link.receiver()
    ready.put(None)
    for _ in range(warm):
        recv(_first)
    ready.put(None)
    for _ in range(count):
        recv(_first)
    ready.put(None)


def _await(ready, n: int, procs) -> None:
    """Take ``n`` notes from ``ready``; fail if a child dies or stays silent too long."""
    deadline = time.monotonic() + START_TIMEOUT
    for _ in range(n):
        while True:
            try:
                ready.get(timeout=0.5)
                break
            except Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(f"children gave no word (exit codes {failed})") from None


class Session:
    """Fresh links and children for one measurement; everything closed on exit."""

    def __init__(self, contender: Contender) -> None:
        self.contender, self.ctx = contender, contender.context()
        self.ready = self.ctx.Queue()
        # Senders stay until the receiver has everything: iceoryx2 drops the samples of a
        # publisher that is gone, even those already in the subscriber's buffer.
        self.done = self.ctx.Event()
        self.links: list = []
        self.procs: list = []

    def link(self, nbytes: int, senders: int = 1):
        link = self.contender.link(self.ctx, nbytes, senders)
        self.links.append(link)
        return link

    def start(self, target, *args) -> None:
        p = self.ctx.Process(target=target, args=args, daemon=True)
        p.start()
        self.procs.append(p)

    def wait(self, n: int) -> None:
        _await(self.ready, n, self.procs)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        stop_processes(self.procs, 60 if exc[0] is None else 1)
        for link in self.links:
            link.close()
        self.ready.close()
        self.ready.join_thread()
        st.empty_cache()
        if exc[0] is None:
            check_exit_codes(self.procs, self.contender.label)


def round_trip(contender: Contender, count: int) -> float:
    """Seconds per round trip of a 1 KiB array, after ``count // 10`` untimed ones."""
    warm = max(10, count // 10)
    with Session(contender) as s:
        inbox, outbox = s.link(SMALL), s.link(SMALL)
        recv = outbox.receiver()
        s.start(_echo, contender, inbox, outbox, s.ready, s.done, warm + count)
        s.wait(1)
        send, message = inbox.sender(), contender.messages(SMALL)
        for _ in range(warm):
            send(message())
            recv(_first)
        t0 = time.perf_counter()
        for _ in range(count):
            send(message())
            recv(_first)
        return (time.perf_counter() - t0) / count


def fan_in(contender: Contender, count: int) -> float:
    """Arrays/s that one consumer takes from ``PRODUCERS`` producers of 1 KiB arrays."""
    with Session(contender) as s:
        link, go = s.link(SMALL, PRODUCERS), s.ctx.Event()
        recv = link.receiver()
        for _ in range(PRODUCERS):
            s.start(_produce, contender, link, SMALL, count, s.ready, go, s.done)
        s.wait(PRODUCERS)
        total = PRODUCERS * count
        lo, hi = total // 10, total - total // 10
        go.set()
        for _ in range(lo):
            recv(_first)
        t0 = time.perf_counter()
        for _ in range(hi - lo):
            recv(_first)
        elapsed = time.perf_counter() - t0
        for _ in range(total - hi):
            recv(_first)
        return (hi - lo) / elapsed


def fan_out(contender: Contender, count: int) -> float:
    """Bytes/s delivered when one producer sends each 4 MiB array to ``CONSUMERS``."""
    warm = 4
    with Session(contender) as s:
        links = [s.link(LARGE) for _ in range(CONSUMERS)]
        for link in links:
            s.start(_consume, link, warm, count, s.ready)
        s.wait(CONSUMERS)
        sends, message = [link.sender() for link in links], contender.messages(LARGE)
        for _ in range(warm):
            a = message()
            for send in sends:
                send(a)
        s.wait(CONSUMERS)
        t0 = time.perf_counter()
        for _ in range(count):
            a = message()
            for send in sends:
                send(a)
        s.wait(CONSUMERS)
        return CONSUMERS * count * LARGE / (time.perf_counter() - t0)


@dataclass(frozen=True)
class Workload:
    name: str
    measure: Callable[[Contender, int], float]
    unit: str           # "s" (time per item: lower is better), "/s" or "B/s" (higher)
    quick: int
    full: int

    def better(self, value: float, than: float) -> float:
        """How many times better ``value`` is than ``than``."""
        return than / value if self.unit == "s" else value / than


WORKLOADS = (
    Workload(ROUND_TRIP, round_trip, "s", 300, 2000),
    Workload(FANIN, fan_in, "/s", 1000, 4000),
    Workload(FANOUT, fan_out, "B/s", 40, 150),
)


def measure_all(quick: bool) -> tuple[dict, dict[str, str]]:
    """Every (workload, contender) once per round, interleaved; the rounds' values."""
    rounds = 1 if quick else 3
    skipped = {c.label: why for c in CONTENDERS if (why := c.missing()) is not None}
    values: dict[tuple[str, str], list[float]] = {}
    errors: dict[tuple[str, str], str] = {}
    for r in range(rounds):
        for w in WORKLOADS:
            for c in CONTENDERS:
                if c.label in skipped or (w.name, c.label) in errors:
                    continue
                try:
                    v = w.measure(c, w.quick if quick else w.full)
                except Exception as e:  # one broken contender must not hide the others
                    errors[(w.name, c.label)] = f"{type(e).__name__}: {e}"
                    print(f"  channels     {w.name:<10} {c.label:<28} failed: {e}",
                          file=sys.stderr, flush=True)
                    continue
                values.setdefault((w.name, c.label), []).append(v)
                print(f"  channels     round {r + 1} {w.name:<10} {c.label:<28} "
                      f"{value_label(v, w.unit):>12}", file=sys.stderr, flush=True)
    return {"values": values, "errors": errors}, skipped


def summarize(medians: dict, skipped: dict[str, str], errors: dict, cpus: int) -> tuple:
    """The summary rows, the targets (issue 27's, by the machine's size) and the table."""
    many = (cpus or 0) >= 16
    limits = {ROUND_TRIP: 5 if many else 3, FANIN: 3.5 if many else 3}
    summary, targets, rows = [], [], []
    for w in WORKLOADS:
        base = medians.get((w.name, STDLIB.label))
        cells = {}
        for c in CONTENDERS:
            v = medians.get((w.name, c.label))
            note = skipped.get(c.label) or errors.get((w.name, c.label))
            cells.setdefault(c.column, []).append(
                {"label": "shared" if c.shared else ("plain" if c.column == "shmtensor"
                                                     else ""),
                 "value": v, "note": None if v is not None else note})
            rows.append((w.name, c.label, value_label(v, w.unit),
                         f"{w.better(v, base):.2f}x" if v and base else "-",
                         "" if v is not None else f"skipped: {note}"))
        shared = medians.get((w.name, SHM_SHARED.label))
        if w.name in limits:
            row_targets = [target(f"{w.name}, 1 KiB shared arrays: shmtensor vs stdlib "
                                  f"({'16+' if many else 'fewer than 16'} CPUs)",
                                  w.better(shared, base) if shared and base else None,
                                  ">=", limits[w.name], section="channels")]
        else:
            ice = medians.get((w.name, ICEORYX2.label))
            name = f"{w.name}, 4 MiB shared arrays: shmtensor GB/s / iceoryx2 GB/s"
            if ICEORYX2.label in skipped:
                name += f" [skipped: {skipped[ICEORYX2.label]}]"
            row_targets = [target(name, ratio(shared, ice), ">=", 1, section="channels")]
        targets += row_targets
        summary.append({"workload": WORKLOAD_TITLES[w.name], "unit": w.unit,
                        "baseline": "stdlib", "cells": cells, "targets": row_targets})
    table = _report.format_rows(("workload", "contender", "median", "vs stdlib", ""),
                                rows, left=2)
    return summary, targets, table


WORKLOAD_TITLES = {
    ROUND_TRIP: "round trip of a 1 KiB array (time per round trip)",
    FANIN: f"fan-in {PRODUCERS} -> 1 of 1 KiB arrays (arrays/s)",
    FANOUT: f"fan-out 1 -> {CONSUMERS} of 4 MiB arrays (GB/s delivered)",
}


def run(quick: bool) -> Section:
    measured, skipped = measure_all(quick)
    medians = {k: statistics.median(v) for k, v in measured["values"].items()}
    summary, targets, table = summarize(medians, skipped, measured["errors"], os.cpu_count())
    rounds = 1 if quick else 3
    return Section(
        key="channels",
        title=f"channels: round trip, fan-in {PRODUCERS} -> 1, fan-out 1 -> {CONSUMERS} "
              f"(spawn; median of {rounds} interleaved round(s))",
        table=table, targets=targets, summary=summary,
        data={"values": {f"{w} | {c}": v for (w, c), v in measured["values"].items()},
              "errors": {f"{w} | {c}": e for (w, c), e in measured["errors"].items()},
              "skipped": skipped,
              "counts": {w.name: w.quick if quick else w.full for w in WORKLOADS}})


if __name__ == "__main__":  # this section alone: python -m benchmarks.bench_channels [--quick]
    print(run("--quick" in sys.argv).render())
