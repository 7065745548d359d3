"""How a received array's lease is held: by the message's own in-flight description when it
covers that one slot, by a lock through the table's description otherwise; across fork."""

import errno
import fcntl
import gc
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp
from shmtensor.ipc import ofd_lease
from shmtensor import _reductions, _segments

from conftest import JOIN, join_all
from helpers import send_array


# Arrays past SLAB_ITEM_MAX have a segment of their own: the lease of each is the array's
# alone (a small array's is its slab's, which the slab allocator also holds).
OWN = _segments.SLAB_ITEM_MAX // 8 + 1000


def _send_to_self(box: list):
    """Send ``box``'s one item to this process, dropping every other reference to it (so
    the receipt holds the lease anew) before receiving it."""
    r, w = smp.Pipe(duplex=False)
    try:
        w.send(box.pop())
        gc.collect()
        return r.recv()
    finally:
        r.close()
        w.close()


def _holding(seg):
    return ofd_lease._holdings[seg.table_id]


def test_a_sole_slot_is_held_by_the_kept_inflight_description():
    kept_before = ofd_lease._kept
    a = shmtensor.zeros(OWN)
    seg = _segments.segment_of(a)
    table = ofd_lease.own_table()
    assert _holding(seg).by[seg.slot] == -1  # a lock: never sent yet, it costs no fd
    assert ofd_lease._kept == kept_before
    box = [a]
    del a
    b = _send_to_self(box)  # the creator's hold is gone before the receipt
    assert _holding(seg).by[seg.slot] >= 0  # the message's description, kept
    assert ofd_lease._kept == kept_before + 1
    assert table.is_held(seg.slot)
    b[:] = 3
    del b
    gc.collect()
    assert seg.slot not in _holding(seg).by
    assert ofd_lease._kept == kept_before
    assert not table.is_held(seg.slot)


def test_an_own_hold_travels_with_every_message_without_a_new_description(monkeypatch):
    """An own slot's first send makes it a description of its own, which every message
    then carries: no open, lock and close per message after the first; the lock outlives
    the creator's hold while in flight.  A segment never sent costs no fd for it."""
    kept_before = ofd_lease._kept
    a = shmtensor.zeros(OWN)
    seg = _segments.segment_of(a)
    table = ofd_lease.own_table()
    made = []
    real = ofd_lease._reopen_into
    monkeypatch.setattr(ofd_lease, "_reopen_into",
                        lambda out, k, fd: made.append(fd) or real(out, k, fd))
    r, w = smp.Pipe(duplex=False)
    try:
        assert ofd_lease._kept == kept_before and _holding(seg).by[seg.slot] == -1
        for _ in range(5):
            w.send(a)
        got = [r.recv() for _ in range(5)]
        assert len(made) == 1 and all(g.ctypes.data == a.ctypes.data for g in got)
        assert ofd_lease._kept == kept_before + 1 and _holding(seg).by[seg.slot] >= 0
        del got
        w.send(a)  # in flight, covered by the creator's description only
        del a
        gc.collect()  # the creator's hold (its copy of that description) is closed
        assert seg.slot not in _holding(seg).by
        assert table.is_held(seg.slot)  # the message's copy still locks it
        b = r.recv()
        assert table.is_held(seg.slot) and float(b.sum()) == 0
        del b
        gc.collect()
        assert not table.is_held(seg.slot)
    finally:
        r.close()
        w.close()


def test_a_message_owns_the_hold_it_travels_with_when_the_holder_lets_go():
    """The hold a message travels with may belong to something the message does not keep
    (a CUDA block sent home is held by its received use, while the message keeps the
    block's memory): letting go of it before the send must leave the message its lock."""
    import socket

    from shmtensor import _wire
    from shmtensor.ipc import scm_rights

    table = ofd_lease.own_table()
    slot = table.new_slot()
    back = ofd_lease.inflight_fd(table.id, [slot])  # as a message sending it home brings
    assert ofd_lease.hold(table.id, slot, [back])  # the receipt's hold is that description
    ctx = _wire.LaneContext(object(), None, table.id, slot)
    ctx.wire_fds()  # worked out before the send (a full socket, the feeder's buffer)
    ofd_lease.release(table.id, slot)  # the receipt dies first: its description is closed
    other = os.open(os.devnull, os.O_RDONLY)  # and its fd number may be taken meanwhile
    a, b = socket.socketpair()
    try:
        scm_rights.send_frame(a, b"x", ctx.wire_fds())
        ctx.release()
        assert table.is_held(slot)  # the message's own fd keeps the lock while in flight
        _, got = scm_rights.recv_frame(b)
        assert os.readlink(f"/proc/self/fd/{got[0]}").startswith("/memfd:")
        assert table.is_held(slot)
        scm_rights.close_fds(got)
        assert not table.is_held(slot)
    finally:
        os.close(other)
        a.close()
        b.close()


def test_out_of_fds_a_process_gives_up_its_kept_descriptions_and_goes_on():
    """A process that keeps descriptions as holds (one per own segment sent, up to an
    eighth of its fd limit) closes them when it runs out of fds, holding those slots by
    locks instead, and keeps no more: the segment or send that hit the limit goes on, and
    every array kept stays intact and held."""
    import helpers

    limit, ctx = 128, smp.get_context("spawn")
    out = ctx.SimpleQueue()
    p = ctx.Process(target=helpers.keep_sent_segments_until_out_of_fds,
                    args=(out, limit, OWN))
    p.start()
    count, start, error, intact, held, kept, budget, child_exit = out.get()
    join_all(p)
    assert child_exit == 0
    assert "no file descriptor left" in error, error  # the limit is reached in the end
    assert intact and held
    assert kept == 0 and budget == 0  # every kept description was given up, none made since
    # each segment kept costs its memfd alone: what was open at the start, the table's
    # descriptions of its files and the description the last send needed take the rest
    # (with the kept descriptions, an eighth of the limit fewer segments fit)
    assert count >= limit - start - ofd_lease.SHARDS - 2, (count, start, error)


def test_giving_up_kept_descriptions_survives_a_gc_pass_that_lets_go_of_holds():
    """A GC pass while kept descriptions are given up may run finalizers that let go of
    holds in the same thread (the holding's lock is re-entrant): none may run in there,
    or shedding failed with "dictionary changed size during iteration" and left the kept
    count wrong (about one round in four before)."""
    import helpers

    ctx = smp.get_context("spawn")
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=helpers._drop_all, args=(r,))
    p.start()
    r.close()
    h = ofd_lease._holdings[ofd_lease.own_table().id]
    budget, thresholds = ofd_lease._budget[:], gc.get_threshold()
    try:
        for round_ in range(60):
            ofd_lease._budget[:] = [256]  # keep descriptions again after the last shed
            arrays = [shmtensor.zeros(OWN) for _ in range(12)]
            for a in arrays:
                w.send(a)  # first send: each is held by a description of its own now
            cycles = []
            for a in arrays[:6]:
                c = [a]
                c.append(c)
                cycles.append(c)
            del c, a
            gc.collect(0)
            gc.collect(0)  # the cycles age into an older generation, still referenced
            arrays = arrays[6:]
            del cycles  # garbage now, for a later pass of an older generation
            gc.set_threshold(1, 1 + round_ % 4, 1 + round_ % 3)
            try:
                ofd_lease.shed_kept()
            finally:
                gc.set_threshold(*thresholds)
            assert not any(b >= 0 for b in h.by.values())  # every one given up
            del arrays
            gc.collect()
            assert ofd_lease._kept == 0  # counted right: nothing kept is left
        w.send(None)
        join_all(p)
    finally:
        ofd_lease._budget[:] = budget
        gc.set_threshold(*thresholds)
        if p.is_alive():
            p.kill()
            p.join()


def _two_in_one_file():
    """Two shared arrays (zeros, ones) whose slots are in the same lease table file."""
    made, seen = [], {}
    while True:
        a = shmtensor.zeros(OWN)
        slot = _segments.segment_of(a).slot
        other = seen.get(slot % ofd_lease.SHARDS)
        if other is not None:
            other[:] = 0
            a[:] = 1
            return other, a
        seen[slot % ofd_lease.SHARDS] = a
        made.append(a)


def test_a_description_covering_two_slots_is_not_kept():
    a1, a2 = _two_in_one_file()
    s1, s2 = _segments.segment_of(a1), _segments.segment_of(a2)
    assert s1.table_id == s2.table_id and s1.slot != s2.slot
    assert s1.slot % ofd_lease.SHARDS == s2.slot % ofd_lease.SHARDS
    table = ofd_lease.own_table()
    box = [[a1, a2]]
    del a1, a2
    got = _send_to_self(box)
    assert _holding(s1).by[s1.slot] == -1 and _holding(s2).by[s2.slot] == -1
    assert table.is_held(s1.slot) and table.is_held(s2.slot)
    assert float(got[1].sum()) == OWN
    del got
    gc.collect()
    assert not table.is_held(s1.slot) and not table.is_held(s2.slot)


def test_past_the_budget_holds_are_locks(monkeypatch):
    monkeypatch.setattr(ofd_lease, "_budget", [0])
    a = shmtensor.zeros(OWN)
    seg = _segments.segment_of(a)
    box = [a]
    del a
    b = _send_to_self(box)
    assert _holding(seg).by[seg.slot] == -1
    assert ofd_lease.own_table().is_held(seg.slot)
    del b
    gc.collect()
    assert not ofd_lease.own_table().is_held(seg.slot)


_INHERITED: list = []


def _drop_inherited_then_wait(ready, go):
    _INHERITED.clear()  # the child's copy of the received array dies: its hold goes
    gc.collect()
    ready.set()
    go.wait(JOIN)


def test_a_forked_child_does_not_keep_the_parents_kept_description():
    ctx = smp.get_context("fork")
    a = shmtensor.zeros(OWN)
    seg = _segments.segment_of(a)
    table = ofd_lease.own_table()
    box = [a]
    del a
    _INHERITED.append(_send_to_self(box))
    assert _holding(seg).by[seg.slot] >= 0
    ready, go = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_drop_inherited_then_wait, args=(ready, go))
    p.start()
    try:
        assert ready.wait(JOIN)
        _INHERITED.clear()  # the parent lets go too
        gc.collect()
        # both let go while the child still lives: had the child kept its inherited copy
        # of the parent's description, the slot would still be held
        assert not table.is_held(seg.slot)
    finally:
        go.set()
        p.join(JOIN)
    assert p.exitcode == 0
    _INHERITED.clear()


def test_numpy_reference_values_survive_the_round_trip():
    b = _send_to_self([shmtensor.full(1000, 7, dtype=np.int32)])
    assert b.dtype == np.int32 and int(b.sum()) == 7000


def test_a_kept_description_is_not_inherited_by_programs_started_here():
    a = shmtensor.zeros(OWN)
    seg = _segments.segment_of(a)
    box = [a]
    del a
    b = _send_to_self(box)
    kept = _holding(seg).by[seg.slot]
    assert kept >= 0 and not os.get_inheritable(kept)
    del b


def _fail_to_rebuild(x):
    raise ValueError("cannot rebuild")


class _Unrebuildable:
    def __init__(self, x) -> None:
        self.x = x

    def __reduce__(self):
        return _fail_to_rebuild, (self.x,)


def test_a_failed_load_keeps_no_description_for_slots_it_never_reached():
    a1, a2 = _two_in_one_file()
    s1, s2 = _segments.segment_of(a1), _segments.segment_of(a2)
    table = ofd_lease.own_table()
    box = [[a1, _Unrebuildable(a1), a2]]
    del a1, a2
    saved = None
    try:
        _send_to_self(box)
    except ValueError as e:
        saved = e  # its traceback keeps the first array's anchor alive
    assert saved is not None
    gc.collect()
    assert _holding(s1).by.get(s1.slot, -1) == -1  # a lock, not the shared description
    assert not table.is_held(s2.slot)  # nobody has the second array: free at once
    del saved
    gc.collect()
    assert not table.is_held(s1.slot)


def test_a_lock_failure_at_the_end_of_a_load_leaks_no_fd(monkeypatch):
    a1, a2 = _two_in_one_file()
    r, w = smp.Pipe(duplex=False)
    try:
        w.send([a1, a2])  # one description covering two slots: locked at the end of the load
        del a1, a2
        gc.collect()
        data, fds = r.recv_frame()
    finally:
        r.close()
        w.close()
    real = ofd_lease._setlk

    def no_locks(fd, kind, slot):
        if kind == fcntl.F_RDLCK:
            raise OSError(errno.ENOLCK, "no locks available")
        return real(fd, kind, slot)

    monkeypatch.setattr(ofd_lease, "_setlk", no_locks)
    with pytest.raises(OSError, match="no locks"):
        _reductions.loads(data, fds)
    monkeypatch.undo()
    gc.collect()
    assert not [fd for fd in fds if os.path.exists(f"/proc/self/fd/{fd}")]


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_one_array_message_whose_hold_fails_leaks_no_fd_and_stays_evictable(lc, monkeypatch):
    """The receipt of a shared array from another process fails at its hold (no locks):
    nothing is left open, the new mapping idles in the receive cache (evictable), and the
    next message of the same segment is received whole."""
    ctx = smp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=send_array, args=(q, done))  # ones((5, 5)), sent twice
    p.start()
    try:
        def no_locks(*args):
            raise OSError(errno.ENOLCK, "no locks available")

        monkeypatch.setattr(ofd_lease, "hold", no_locks)
        kept, fds = _segments._kept_fds, _open_fds()
        with pytest.raises(OSError, match="no locks available; the message was received and "
                           "discarded"):
            q.get(timeout=JOIN)
        monkeypatch.undo()
        assert _open_fds() == fds
        assert _segments._kept_fds == kept
        idle = [s for s in _segments._cache.values() if not s.alive()]
        assert len(idle) == 1
        b = q.get(timeout=JOIN)
        assert b.shape == (5, 5) and (b == 1).all()
        assert _segments.segment_of(b) is idle[0]
        assert idle[0].key not in _segments._cache  # held again
        del b
    finally:
        done.set()
        join_all(p)
    assert p.exitcode == 0


_EXIT_HOLDING = """
import os
import numpy as np
import shmtensor, shmtensor.multiprocessing as smp
r, w = smp.Pipe(duplex=False)
box = [shmtensor.full({n}, 2.0)]
w.send(box.pop())
kept = r.recv()                      # held by the message's description at exit
cycle = [kept[:10]]
cycle.append(cycle)                  # a view left to the GC at shutdown
os.KEPT = kept[10:20]                # views kept by modules imported before shmtensor's,
np.KEPT = shmtensor.zeros(10)        # whose dicts are cleared late in the shutdown
assert kept.sum() == 2.0 * {n}
"""


def test_a_process_exiting_with_received_arrays_alive_exits_quietly():
    """Anchors that die during interpreter shutdown release nothing (the kernel drops the
    locks with the process) and report no error."""
    out = subprocess.run([sys.executable, "-c", _EXIT_HOLDING.format(n=OWN)],
                         capture_output=True, text=True, timeout=JOIN)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""


def _forward_once(qin, qout) -> None:
    b = qin.get(timeout=JOIN)
    qout.put(b)  # travels with the description this process holds the slot by
    del b
    qout.close()
    qout.join_thread()


def _hold_until_told(qin, report, release) -> None:
    b = qin.get(timeout=JOIN)
    report.put(float(b.sum()))
    release.wait(JOIN)
    del b
    report.put("let go")


def test_a_forwarded_array_stays_held_until_its_last_receiver_lets_go(lc):
    """Creator -> forwarder -> holder: the creator and the forwarder both let go (the
    forwarder exits); the holder's copy of the forwarded description keeps the slot."""
    ctx = smp.get_context("spawn")
    q1, q2, report, release = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    a = shmtensor.full(OWN, 2.0)
    seg = _segments.segment_of(a)
    table = ofd_lease.own_table()
    forwarder = ctx.Process(target=_forward_once, args=(q1, q2))
    holder = ctx.Process(target=_hold_until_told, args=(q2, report, release))
    forwarder.start()
    holder.start()
    try:
        q1.put(a)
        del a
        assert report.get(timeout=JOIN) == 2.0 * OWN
        forwarder.join(JOIN)
        assert forwarder.exitcode == 0
        gc.collect()
        assert seg.slot not in _holding(seg).by  # the creator let go
        assert table.is_held(seg.slot)  # the holder's copy keeps it
        release.set()
        assert report.get(timeout=JOIN) == "let go"
        deadline = time.monotonic() + JOIN
        while table.is_held(seg.slot) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not table.is_held(seg.slot)
    finally:
        release.set()
        join_all(forwarder, holder)
    assert holder.exitcode == 0


def test_unheld_finds_the_free_slots_with_a_probe_per_file_and_probes_within_budget():
    table = ofd_lease.own_table()
    slots = [table.new_slot() for _ in range(5 * ofd_lease.SHARDS)]  # five in each file
    held = {slots[3], slots[17], slots[30]}
    fds = [ofd_lease.inflight_fd(table.id, (s,)) for s in held]
    try:
        assert table.unheld(slots, len(slots)) == set(slots) - held
        # no probe one by one: a file whose range holds a lock counts as held throughout
        busy = {s % ofd_lease.SHARDS for s in held}
        free0 = table.unheld(slots, 0)
        assert free0 == {s for s in slots if s % ofd_lease.SHARDS not in busy}
        free2 = table.unheld(slots, 2)  # two probed alone: one or two more found free
        assert free0 < free2 and len(free2 - free0) <= 2 and free2.isdisjoint(held)
        assert table.unheld([slots[3]], 1) == set()  # one slot alone: probed by itself
    finally:
        for fd in fds:
            os.close(fd)
    assert table.unheld(slots, 0) == set(slots)


def test_release_many_lets_go_of_each_hold_once_and_of_the_lock_with_the_last():
    table = ofd_lease.own_table()
    a, b = table.new_slot(), table.new_slot()
    for slot in (a, a, b):
        ofd_lease.hold(table.id, slot)
    assert table.is_held(a) and table.is_held(b)
    ofd_lease.release_many(table.id, [a, b])
    assert table.is_held(a) and not table.is_held(b)  # a was held twice
    ofd_lease.release_many(table.id, [a])
    assert not table.is_held(a)
    ofd_lease.release_many("no-such-table", [a])  # a table never held here: nothing to do


_TABLE_AT_LIMIT = """
import os, resource
from shmtensor.ipc import ofd_lease
top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (top + 4, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
before = sorted(os.listdir("/proc/self/fd"))
try:
    ofd_lease.LeaseTable()
except OSError as e:
    print(e.errno, e)
print(sorted(os.listdir("/proc/self/fd")) == before)
"""


def test_a_lease_table_past_the_fd_limit_says_which_limit_and_the_fix():
    """A process whose fd limit leaves no room for its lease table's files gets an error
    that names the limit and how to raise it, and keeps none of the files it made."""
    out = subprocess.run([sys.executable, "-c", _TABLE_AT_LIMIT], capture_output=True,
                         text=True, timeout=JOIN)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert first.startswith(f"{errno.EMFILE} ") and "lease table" in first
    assert "ulimit -n" in first and "RLIMIT_NOFILE" in first
    assert second == "True"


def _reopened_files(out):
    """In a forked child: the inode of a new in-flight description of this process's own
    table, and of the table's file it should be a description of."""
    table = ofd_lease.own_table()
    fd = ofd_lease.inflight_fd(table.id, [1])
    try:
        out.put((os.fstat(fd).st_ino, os.fstat(table.fds[1 % ofd_lease.SHARDS]).st_ino))
    finally:
        os.close(fd)


def test_a_forked_child_opens_descriptions_of_its_own_files():
    """Descriptions are opened through this process's /proc/self/fd, kept open: a forked
    child must open its own (the inherited one lists the parent's fds, whose numbers its
    new table may reuse), or its in-flight locks would be on the parent's files."""
    ctx = smp.get_context("fork")
    # the parent's table and its /proc/self/fd made and in use
    os.close(ofd_lease.inflight_fd(ofd_lease.own_table().id, [1]))
    out = ctx.Queue()
    p = ctx.Process(target=_reopened_files, args=(out,))
    p.start()
    try:
        got, want = out.get(timeout=JOIN)
    finally:
        p.join(JOIN)
    assert p.exitcode == 0
    assert got == want
    parent = os.fstat(ofd_lease.own_table().fds[1 % ofd_lease.SHARDS]).st_ino
    assert got != parent
    out.close()
