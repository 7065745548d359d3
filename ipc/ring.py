"""A bounded ring of byte messages in one shared memfd, for any number of writer and
reader processes and threads: the lean channel's transport (docs/channel-design.md).

Facts this module is built on (Linux, x86-64 or aarch64, glibc or musl):

* A process-shared *robust* pthread mutex lives in the mapping and costs no syscall when
  nobody contends for it.  When the thread that owns it dies (SIGKILL included), the
  kernel marks it from the thread's robust list and the next locker gets ``EOWNERDEAD``:
  it owns the lock, repairs what the dead owner left, and calls
  ``pthread_mutex_consistent``.  Each thread owns it on its own (no process-wide
  ``threading.Lock`` is needed), a wait for it can have a deadline
  (``pthread_mutex_clocklock``), and a forked child owns nothing it did not lock itself.
  Made error-checking, it refuses an unlock by a thread that does not own it (``EPERM``)
  and tells its owner's try-lock ``EDEADLK``: after an exception (a signal handler's)
  anywhere from the try-lock on, a call lets go of what it holds and nothing else.
* ``futex(2)`` ``FUTEX_WAIT`` on a 32-bit word of a shared mapping sleeps only if the word
  still holds the expected value, compared in the kernel after a full barrier;
  ``FUTEX_WAKE`` wakes a sleeper of that word in any process.
* x86-64 keeps a thread's stores in order and its loads in order.  A store followed by a
  load of another word may pass it: the mutex's unlock (an atomic exchange, a full
  barrier) closes that on the waker's side, the futex wait on the sleeper's side.  Every
  sleep is also bounded (``SLICE``) and re-checks, so a wake missed in any other way costs
  a slice, never a hang.  Elsewhere, ``_fence`` orders what x86-64 orders by itself.  The
  C fast path (below) orders its accesses with release stores and acquire loads, and a
  full fence between publishing and reading the other side's sleeper flag.
* An OFD lock (``F_OFD_SETLK``) belongs to an open file description, and goes when the last
  fd of it closes: at the latest when its process dies.  A fork shares descriptions.

Layout of the memfd (native byte order, every word aligned)::

    0    magic, version, capacity, record size
    64   the writers' lock (a robust pthread mutex)
    128  the readers' lock
    192  tail: the number of records ever written; its low 32 bits are the readers' futex word
    200  head: the number of records ever taken; its low 32 bits are the writers' futex word
    208  a reader sleeps (0/1), a writer sleeps (0/1), next process index to try
    256  ``capacity`` records of ``record_size`` bytes: sequence number (the tail it was
         written at, plus one), writer's process index, length, then the message

Protocol.  A writer takes the writers' lock; while ``tail - head == capacity`` it sleeps on
the head word (flagging that a writer sleeps), or fails with ``queue.Full`` at its
deadline; it writes record ``tail % capacity`` whole, then stores ``tail + 1`` (which
publishes it), lets go of the lock, and wakes a reader if one sleeps.  A reader does the
mirror image under the readers' lock: it sleeps on the tail word while ``head == tail``,
copies record ``head % capacity`` out, stores ``head + 1``, lets go, and wakes a writer if
one sleeps.  Only the holder of a lock sleeps on the ring, so each flag is written by one
thread at a time; other writers (readers) wait on the lock itself.  Before it sleeps, a
waiter looks at the word for up to ``Ring.spin`` seconds (``sched_yield`` between looks,
so that a process it waits for gets the CPU), while its recent waits were that short: a
reader that keeps up with its writers spares them the wake-up, and a round trip its
sleep.

What a death leaves (the kernel frees the dead thread's lock; the next holder repairs):

* a writer, before it stored ``tail``: a partial record past ``tail``, which nobody reads
  and the next writer overwrites; after: a whole record, delivered;
* a reader, before it stored ``head``: the record stays at ``head`` and the next reader
  gets it (the dead reader's ``get`` never returned it: no loss, no duplicate); after:
  the message went with the reader, as it would with the stdlib's queue;
* a sleeper: its flag, which the next holder clears (a stale flag costs one spurious
  wake per message until then, never a missed one).

A record whose sequence number or length is wrong (memory written by something else) is
stepped over and reported as an ``OSError``; the ring stays in step (records have a
fixed size).

Two implementations of one protocol.  Where the C extension ``_cring`` (ipc/_cring.c) was
built and ``SHMTENSOR_PURE_PYTHON`` is not set (ipc/_native.py), ``put`` and ``get`` first
try the whole call in C: it goes through when the lock is free and there is room (a
message); otherwise C changes nothing, holds nothing, and the Python code below does the
call (waits with deadlines, a lock taken over from a dead owner, a malformed record, the
errors).  The C call runs no Python code but the caller's hook, so a Python signal
handler runs before or after it, never inside.  The slow paths call the locks and futexes
through C too (ctypes without it).  Same layout, same steps, same flags: processes on
either path share a ring.

Taking a message and handing it to the caller are two steps: an exception (a signal
handler's) after ``head`` advanced and before the caller holds the message loses it.
``get(into=list)`` closes that window: the append and the advance are one step (nothing
runs between them in C; in Python, an exception between them is caught and the advance
made), so if ``get`` raises, the message is in the list or still in the ring.  A caller
that must not lose a message takes it with ``into`` (or records it in ``hook``, which runs
before ``head`` advances and leaves the message in the ring if it raises).

Each process that maps a ring holds a *process index* ``k``: a write lock on byte
``LIVE + k`` of the memfd, through a description of its own.  The index is written into
each record and tells whether other processes still have the ring (:meth:`Ring.alive`,
:meth:`Ring.peers_alive`); a forked child takes a new index through a new description.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import platform
import queue
import struct
import sys
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._native import native
from .posix_shm import PREFIX

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

__all__ = ["HAVE_RING", "Ring", "RingClosed", "SLICE", "MAX_PROCS"]

_ARCH = platform.machine()
_SYS_FUTEX = {"x86_64": 202, "AMD64": 202, "aarch64": 98, "arm64": 98}.get(_ARCH)
_TSO = _ARCH in ("x86_64", "AMD64")  # stores stay in order, and loads do (see _fence)
# little-endian: a futex word is the low half of a sequence number, at the same address
HAVE_RING = (_SYS_FUTEX is not None and sys.byteorder == "little"
             and hasattr(fcntl, "F_OFD_SETLK") and hasattr(os, "memfd_create"))

SLICE = 0.05  # longest sleep between re-checks: bounds a missed wake, lets signals run
SPIN = 50e-6  # the default of Ring.spin
MAX_PROCS = 1 << 16  # process indices per ring
LIVE = 1 << 40  # byte of the memfd whose lock is process index 0 (locks may lie past EOF)

_MAGIC = 0x31474E4952545453  # b"STTRING1"
_VERSION = 2
_HEADER = struct.Struct("QIII")  # magic, version, capacity, record size
_W_LOCK, _R_LOCK = 64, 128
_TAIL, _HEAD, _R_SLEEPS, _W_SLEEPS, _NEXT = 192, 200, 208, 212, 216
# The same words as items of the mapping cast to 8-byte (4-byte) words.  Words that other
# processes read while one writes go through these: a memoryview stores an item with one
# machine store, where ``struct.pack_into`` first zeroes the bytes it packs (a reader could
# see the tail at 0 in between).
_TAIL_Q, _HEAD_Q = _TAIL // 8, _HEAD // 8
_R_SLEEPS_I, _W_SLEEPS_I, _NEXT_I = _R_SLEEPS // 4, _W_SLEEPS // 4, _NEXT // 4
_USER = 224  # USER_WORDS 8-byte words the ring's user keeps (zero when made): Ring.user
# Ring.user of a ring not mapped (closed): any use raises ValueError, as a closed ring's calls
_NO_WORDS = memoryview(b"\0" * 8).cast("Q")
_NO_WORDS.release()
USER_WORDS = 8
_RECORDS = 320  # records start on a cache line
_Q = struct.Struct("Q")
_REC = struct.Struct("QII")  # sequence number, writer's process index, length
_REC_SIZE = _REC.size
_FLOCK = struct.Struct("hhqqi4x")  # struct flock on Linux x86-64 and aarch64
_MASK = 0xFFFFFFFF

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not _PRIVATE): the sleepers are in other processes
_CLOCK_MONOTONIC = 1
_EBUSY, _ETIMEDOUT, _EOWNERDEAD = errno.EBUSY, errno.ETIMEDOUT, errno.EOWNERDEAD
_EDEADLK = errno.EDEADLK


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _timespec(seconds: float) -> _Timespec:
    whole = int(seconds)
    return _Timespec(whole, int((seconds - whole) * 1e9))


# The calls on the mapping's locks and futex words, from ``_cring`` (C, ipc/_cring.c) where
# it was built, else through ctypes.  Addresses are ints; results are error numbers.
_trylock: Callable[[int], int]  # pthread_mutex_trylock: never blocks
_unlock: Callable[[int], int]
_consistent: Callable[[int], int]  # pthread_mutex_consistent
_lock_for: Callable[[int, float], int]  # pthread_mutex_*lock with a deadline seconds away
_wait: Callable[[int, int, float], object]  # FUTEX_WAIT on a word holding expected
_wake: Callable[[int], object]  # FUTEX_WAKE one sleeper
_fence: Callable[[], object]  # a full barrier (where the hardware does not keep order)
# Ring.put's and Ring.get's whole call when it needs no wait and no repair (ipc/_cring.c
# says what they answer); None: the Python code below does every call.
_cput: Callable[[int, int, int, int, ReadableBuffer, Callable[[int], object] | None,
                 list[int] | None], int] | None
_cget: Callable[[int, int, int, Callable[[int, int, bytes], object] | None,
                 list[bytes] | None], bytes | int] | None

_libc = ctypes.CDLL(None, use_errno=True)  # lets go of the GIL in a call
_c = native("_cring")
if _c is not None:
    if _c.LAYOUT != (_W_LOCK, _R_LOCK, _TAIL, _HEAD, _R_SLEEPS, _W_SLEEPS, _RECORDS, _REC_SIZE,
                     MAX_PROCS, _VERSION):
        raise ImportError(f"shmtensor.ipc._cring was built for another ring layout "
                          f"({_c.LAYOUT}) than ring.py's: rebuild it (`pip install .`, or "
                          "`pip install -e .` in a checkout), or set SHMTENSOR_PURE_PYTHON=1")
    _trylock, _unlock, _consistent = _c.trylock, _c.unlock, _c.consistent
    _lock_for, _wait, _wake, _fence = _c.lock_for, _c.futex_wait, _c.futex_wake, _c.fence
    _cput, _cget = _c.put, _c.get
else:
    _cput = _cget = None
    # Calls that may block go through CDLL, which lets go of the GIL; calls that never
    # block (try-lock, unlock, wake) go through PyDLL, which keeps it and costs less.
    _pylibc = ctypes.PyDLL(None, use_errno=True)
    _trylock = _pylibc.pthread_mutex_trylock
    _unlock = _pylibc.pthread_mutex_unlock
    _consistent = _pylibc.pthread_mutex_consistent
    for _f in (_pylibc.pthread_mutex_trylock, _pylibc.pthread_mutex_unlock,
               _pylibc.pthread_mutex_consistent):
        _f.argtypes, _f.restype = [ctypes.c_void_p], ctypes.c_int
    _clocklock: Any = getattr(_libc, "pthread_mutex_clocklock", None)  # glibc >= 2.30
    if _clocklock is not None:
        _clocklock.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Timespec)]
        _clocklock.restype = ctypes.c_int
    _timedlock = _libc.pthread_mutex_timedlock
    _timedlock.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]
    _timedlock.restype = ctypes.c_int
    _futex_wait = _libc.syscall
    _futex_wait.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint,
                            ctypes.POINTER(_Timespec), ctypes.c_void_p, ctypes.c_uint]
    _futex_wait.restype = ctypes.c_long
    _futex_wake = _pylibc.syscall
    _futex_wake.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    _futex_wake.restype = ctypes.c_long

    def _lock_for(lock: int, seconds: float) -> int:
        if _clocklock is not None:
            return int(_clocklock(lock, _CLOCK_MONOTONIC,
                                  _timespec(time.monotonic() + seconds)))
        return int(_timedlock(lock, _timespec(time.time() + seconds)))

    def _wait(addr: int, expected: int, seconds: float) -> object:
        return _futex_wait(_SYS_FUTEX, addr, _FUTEX_WAIT, expected, _timespec(seconds),
                           None, 0)

    def _wake(addr: int) -> object:
        return _futex_wake(_SYS_FUTEX, addr, _FUTEX_WAKE, 1)

    # A barrier: a store with release semantics (letting go of a private spinlock) then an
    # atomic exchange with acquire semantics (trying to take it) keeps every access before
    # the pair before every access after it.  A try-lock never waits: threads may fence at
    # the same time.
    _fence_lock = ctypes.c_int(0)
    _fence_addr = ctypes.addressof(_fence_lock)
    _spin_trylock, _spin_unlock = _pylibc.pthread_spin_trylock, _pylibc.pthread_spin_unlock
    _spin_trylock.argtypes = _spin_unlock.argtypes = [ctypes.c_void_p]

    def _fence() -> object:
        _spin_unlock(_fence_addr)
        return _spin_trylock(_fence_addr)


def _settle(lock: int) -> None:
    """After an exception in a call that may hold ``lock`` (a signal handler's, say): if
    this thread took it over from a dead owner and was cut short before making it
    consistent, make it consistent, or the unlock that follows would make it unusable for
    good.  (Taking it here, free or from a dead owner, is let go of by that unlock too.)"""
    if _trylock(lock) in (_EDEADLK, _EOWNERDEAD):  # EDEADLK: this thread holds it
        _consistent(lock)  # EINVAL, nothing done, unless it is inconsistent


def _deadline(block: bool, timeout: float | None) -> float | None:
    if not block:
        return 0.0
    if timeout is None:
        return None
    return time.monotonic() + max(timeout, 0.0)


_LATER = -1.0  # a deadline not computed yet (the fast path never needs one)
_rings: weakref.WeakSet[Ring] = weakref.WeakSet()


class RingClosed(ValueError):
    """A call on a ring this process closed, or one that was waiting in it (for a message,
    for room or for a lock) when another thread of this process shut or closed it."""


def _reopen(fd: int) -> int:
    """A new open file description of ``fd``'s file (close-on-exec)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


class Ring:
    """A bounded ring of byte messages in shared memory (see the module's docstring).

    Make one with :meth:`create`; map it in another process with :meth:`attach` (its
    :attr:`fd` passed by ``socket.send_fds``, say).  A forked child uses the rings it
    inherits, under a process index of its own.  Both ends are safe to use from several
    threads.  ``put`` and ``get`` follow ``queue.Queue``: ``block``, ``timeout``,
    ``queue.Full`` and ``queue.Empty``.

    ``spin``: how long (seconds) a wait looks at the ring before it sleeps, while this
    process's recent waits were no longer (0: sleep at once)."""

    __slots__ = ("fd", "capacity", "record_size", "payload_max", "index", "recovered",
                 "spin", "user", "_hot", "_mem", "_q", "_i", "_anchor", "_base", "_live",
                 "_shut", "__weakref__")

    fd: int
    capacity: int
    record_size: int
    payload_max: int
    index: int
    recovered: int

    def __init__(self, fd: int, mem: mmap.mmap) -> None:
        """Use :meth:`create` or :meth:`attach`; takes ``fd`` and ``mem``."""
        self.fd = fd
        self._mem: mmap.mmap | None = mem
        self._q: memoryview | None = None
        # words of the ring's header its user keeps, shared by every process (a store of
        # an item is one machine store): the channel's own bookkeeping
        self.user: memoryview = _NO_WORDS
        self._i: memoryview | None = None
        self._anchor: ctypes.c_char | None = None
        self._live = -1
        self._base = 0
        self.index = -1
        _, _, self.capacity, self.record_size = _HEADER.unpack_from(mem, 0)
        self.payload_max = self.record_size - _REC_SIZE
        self.recovered = 0  # locks this process took over from a dead owner
        self.spin = SPIN
        self._hot = True
        self._shut = False  # see shut
        try:
            self._q = memoryview(mem).cast("Q")
            self._i = memoryview(mem).cast("I")
            self.user = self._q[_USER // 8:_USER // 8 + USER_WORDS]
            # held for the mapping's life: the mmap cannot be closed under the address
            self._anchor = ctypes.c_char.from_buffer(mem)
            self._base = ctypes.addressof(self._anchor)
            self._live = _reopen(fd)
            self.index = self._claim_index()
        except BaseException:
            self.close()
            raise
        _rings.add(self)

    @classmethod
    def create(cls, capacity: int, record_size: int = 256) -> Ring:
        """A new ring of ``capacity`` records of ``record_size`` bytes (a multiple of 8;
        each carries up to ``record_size - 16`` bytes of message)."""
        if not HAVE_RING:
            raise OSError(errno.ENOSYS, f"shmtensor's ring needs Linux with memfd, OFD locks "
                          f"and a known futex syscall number, little-endian (x86-64, "
                          f"aarch64); this is {_ARCH}, {sys.byteorder}-endian")
        if not 1 <= capacity < 1 << 31:
            raise ValueError(f"a ring's capacity must be between 1 and 2**31 - 1 records, "
                             f"not {capacity}")
        if record_size % 8 or not _REC_SIZE <= record_size <= 1 << 24:
            raise ValueError(f"a ring's record size must be a multiple of 8 between "
                             f"{_REC_SIZE} and 16 MiB, not {record_size}")
        fd = os.memfd_create(f"{PREFIX}_ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, _RECORDS + capacity * record_size)
            # its size for good: a process that shrank it would kill every mapper (SIGBUS)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            mem = mmap.mmap(fd, _RECORDS + capacity * record_size)
            try:
                _HEADER.pack_into(mem, 0, 0, _VERSION, capacity, record_size)
                _init_robust_mutexes(mem, (_W_LOCK, _R_LOCK))
                _Q.pack_into(mem, 0, _MAGIC)  # last: a ring is whole once it has its magic
            except BaseException:
                mem.close()
                raise
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, mem)  # takes both (and closes them if it fails)

    @classmethod
    def attach(cls, fd: int) -> Ring:
        """Map the ring whose memfd ``fd`` is (the caller keeps ``fd``; the ring uses a
        duplicate of its own)."""
        size = os.fstat(fd).st_size
        if size < _RECORDS:
            raise ValueError(f"fd {fd} is not a ring: its file has {size} bytes, fewer than "
                             "a ring's header")
        own = os.dup(fd)
        try:
            mem = mmap.mmap(own, size)
            try:
                magic, version, capacity, record_size = _HEADER.unpack_from(mem, 0)
                if magic != _MAGIC or version != _VERSION:
                    raise ValueError(f"fd {fd} is not a ring of this version of shmtensor "
                                     f"(magic {magic:#x}, version {version})")
                if (record_size % 8 or record_size < _REC_SIZE or capacity < 1
                        or _RECORDS + capacity * record_size > size):
                    raise ValueError(f"fd {fd}: a ring of {capacity} records of "
                                     f"{record_size} bytes does not fit its {size} bytes")
            except BaseException:
                mem.close()
                raise
        except BaseException:
            os.close(own)
            raise
        return cls(own, mem)

    def put(self, data: ReadableBuffer, block: bool = True, timeout: float | None = None,
            *, hook: Callable[[int], object] | None = None,
            sent: list[int] | None = None) -> None:
        """Append ``data`` (bytes-like, at most :attr:`payload_max` bytes); with a full
        ring, wait for room (``block``, up to ``timeout`` seconds) or raise
        ``queue.Full``.

        ``hook(number)``: called under the writers' lock once there is room, before the
        record is written; ``number`` is the record's place in the stream (0, 1, ...:
        the tail).  If it raises, nothing is written.

        ``sent``: a list the record's number is appended to as it is written.  An
        exception from a signal handler can come after the write and before the caller
        knows of it; with ``sent``, the write and the append are one step (no Python code
        runs between them), so the caller tells a record written from one that was not."""
        mem = self._mem  # the mapping stays while this call uses it (see close)
        if _cput is not None:  # the whole call in C, unless it must wait or repair
            done = _cput(self._base, self.capacity, self.record_size, self.index, data,
                         hook, sent)
            if done == 1:
                return
            if done:
                self.recovered += 1  # C took a lock over from a dead owner
        if sent is not None and type(sent) is not list:
            raise TypeError(f"put(): sent must be None or a list, not {type(sent).__name__}")
        if type(data) is not bytes:
            data = memoryview(data).cast("B")
        n = len(data)
        base, q, words = self._base, self._q, self._i
        if n > self.payload_max or not base or mem is None or q is None or words is None:
            raise self._refusal(n)
        lock = base + _W_LOCK
        deadline: float | None = _LATER
        nested = False  # this thread held the lock before this call: not ours to let go
        try:  # from the try-lock on: an exception right after it finds the lock let go of
            rc = _trylock(lock)
            if rc:
                nested = rc == _EDEADLK
                deadline = self._take(lock, rc, _W_SLEEPS_I, block,
                                      _deadline(block, timeout), queue.Full)
            t = q[_TAIL_Q]
            if t - q[_HEAD_Q] >= self.capacity:
                if deadline == _LATER:
                    deadline = _deadline(block, timeout)
                self._sleep_while(base, _HEAD_Q, t - self.capacity, _W_SLEEPS_I,
                                  deadline, queue.Full)
            if hook is not None:
                hook(t)
            off = _RECORDS + t % self.capacity * self.record_size
            _REC.pack_into(mem, off, t + 1, self.index, n)
            mem[off + _REC_SIZE:off + _REC_SIZE + n] = data
            if not _TSO:
                _fence()  # the record before the tail that publishes it
            q[_TAIL_Q] = t + 1
            if sent is not None:
                sent.append(t)  # (the store above runs no Python code, nor does this call)
        except BaseException:
            if not nested:
                _settle(lock)
            raise
        finally:
            if not nested:
                _unlock(lock)  # EPERM, and nothing done, where this thread does not hold it
        if words[_R_SLEEPS_I]:
            _wake(base + _TAIL)

    def get(self, block: bool = True, timeout: float | None = None,
            *, hook: Callable[[int, int, bytes], object] | None = None,
            into: list[bytes] | None = None) -> bytes:
        """Take the oldest message; with an empty ring, wait for one (``block``, up to
        ``timeout`` seconds) or raise ``queue.Empty``.

        ``hook(number, writer_index, data)``: called under the readers' lock with the
        message before it is taken (``number`` as in :meth:`put`; ``writer_index`` the
        writer's process index).  If it raises, the message stays for the next ``get``.

        ``into``: a list the message is appended to as it is taken.  A message is taken
        when ``head`` advances past it; an exception from a signal handler can come after
        that and before the caller has the returned message, which is then lost (as with
        the stdlib's Queue).  With ``into``, the append and the advance are one step: if
        ``get`` raises, the message is in ``into`` or still in the ring, never lost and
        never both.  (With the C extension nothing runs between the two; in pure Python,
        an exception between them is caught and the advance made, and only a second
        exception inside that repair could leave the message in both.)"""
        mem = self._mem  # as in put
        if _cget is not None:  # the whole call in C, unless it must wait or repair
            got = _cget(self._base, self.capacity, self.record_size, hook, into)
            if type(got) is bytes:
                return got
            if got:
                self.recovered += 1  # C took a lock over from a dead owner
        base, q, words = self._base, self._q, self._i
        if not base or mem is None or q is None or words is None:
            raise self._refusal(0)
        lock = base + _R_LOCK
        deadline: float | None = _LATER
        nested = False  # as in put
        had = -1 if into is None else len(into)  # to tell whether into got the message
        try:
            rc = _trylock(lock)
            if rc:
                nested = rc == _EDEADLK
                deadline = self._take(lock, rc, _R_SLEEPS_I, block,
                                      _deadline(block, timeout), queue.Empty)
            h = q[_HEAD_Q]
            if q[_TAIL_Q] == h:
                if deadline == _LATER:
                    deadline = _deadline(block, timeout)
                self._sleep_while(base, _TAIL_Q, h, _R_SLEEPS_I, deadline, queue.Empty)
            if not _TSO:
                _fence()  # the tail that published the record before the record
            off = _RECORDS + h % self.capacity * self.record_size
            seq, k, n = _REC.unpack_from(mem, off)
            if seq == h + 1 and n <= self.payload_max and k < MAX_PROCS:
                data = mem[off + _REC_SIZE:off + _REC_SIZE + n]
                if hook is not None:
                    hook(h, k, data)
                if into is not None:
                    into.append(data)
                q[_HEAD_Q] = h + 1
            else:
                data = None
                q[_HEAD_Q] = h + 1  # stepped over: the ring stays in step
        except BaseException:
            if into is not None and len(into) > had and q[_HEAD_Q] == h:
                q[_HEAD_Q] = h + 1  # into has it (an exception came right after): taken
            if not nested:
                _settle(lock)
            raise
        finally:
            if not nested:
                _unlock(lock)
        if words[_W_SLEEPS_I]:
            _wake(base + _HEAD)
        if data is None:
            raise OSError(errno.EBADMSG, f"ring record {h} (place {h % self.capacity}) is "
                          f"malformed: sequence number {seq} (expected {h + 1}), writer "
                          f"index {k}, length {n} (at most {self.payload_max}); it was "
                          "skipped.  Something other than a ring's writer wrote its memory")
        return data

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether a message is waiting, after waiting up to ``timeout`` seconds for one
        (``None``: until one comes), without taking it: what ``Connection.poll`` needs.
        The wait holds the readers' lock, as a waiting ``get`` does."""
        mem, base, q = self._mem, self._base, self._q  # mem: as in put
        if mem is None or not base or q is None:
            raise self._refusal(0)
        if q[_TAIL_Q] != q[_HEAD_Q] or (timeout is not None and timeout <= 0):
            return bool(q[_TAIL_Q] != q[_HEAD_Q])
        lock = base + _R_LOCK
        deadline = _deadline(True, timeout)
        nested = False  # as in put
        try:
            rc = _trylock(lock)
            if rc:
                nested = rc == _EDEADLK
                self._take(lock, rc, _R_SLEEPS_I, True, deadline, queue.Empty)
            h = q[_HEAD_Q]
            if q[_TAIL_Q] == h:
                self._sleep_while(base, _TAIL_Q, h, _R_SLEEPS_I, deadline, queue.Empty)
            return True
        except queue.Empty:
            return False
        except BaseException:
            if not nested:
                _settle(lock)
            raise
        finally:
            if not nested:
                _unlock(lock)

    def sync_writers(self, timeout: float | None = None,
                     then: Callable[[], object] | None = None) -> None:
        """Take the writers' lock and let go of it: every write begun before this call
        is then whole (or its writer dead).  ``TimeoutError`` after ``timeout`` seconds
        (a writer may hold the lock while it waits for room).  ``then()``: called while
        the lock is held, so no write is in progress meanwhile."""
        self._sync(_W_LOCK, _W_SLEEPS_I, timeout, then)

    def sync_readers(self, timeout: float | None = None,
                     then: Callable[[], object] | None = None) -> None:
        """:meth:`sync_writers` with the readers' lock: ``then()`` runs while no reader
        takes a record (a reader that waits on an empty ring holds the lock: then
        ``TimeoutError``)."""
        self._sync(_R_LOCK, _R_SLEEPS_I, timeout, then)

    def _sync(self, offset: int, flag: int, timeout: float | None,
              then: Callable[[], object] | None) -> None:
        mem, base = self._mem, self._base  # mem: as in put
        if mem is None or not base:
            raise self._refusal(0)
        lock = base + offset
        nested = False  # as in put
        try:
            rc = _trylock(lock)
            if rc:
                nested = rc == _EDEADLK
                self._take(lock, rc, flag, True, _deadline(True, timeout), TimeoutError)
            if then is not None:
                then()
        except BaseException:
            if not nested:
                _settle(lock)
            raise
        finally:
            if not nested:
                _unlock(lock)

    @property
    def tail(self) -> int:
        """The number of records ever written (the next record's number)."""
        if self._q is None:
            raise self._refusal(0)
        return int(self._q[_TAIL_Q])

    @property
    def head(self) -> int:
        """The number of records ever taken (the oldest waiting record's number)."""
        if self._q is None:
            raise self._refusal(0)
        return int(self._q[_HEAD_Q])

    def peek(self, number: int, size: int) -> bytes | None:
        """The first ``size`` bytes of record ``number`` (fewer if it is shorter), read
        without a lock, or None where its place holds another record.  Only a record not
        yet taken (``head <= number < tail``) reads whole: once taken, its place may be
        written again while it is read."""
        mem = self._mem
        if mem is None:
            raise self._refusal(0)
        if not _TSO:
            _fence()  # the tail the caller read before the record it published
        off = _RECORDS + number % self.capacity * self.record_size
        seq, _, n = _REC.unpack_from(mem, off)
        if seq != number + 1:
            return None
        return mem[off + _REC_SIZE:off + _REC_SIZE + min(n, size, self.payload_max)]

    @property
    def closed(self) -> bool:
        """Whether this process closed or shut the ring."""
        return self._shut

    def shut(self) -> None:
        """End this process's waits in the ring, now and to come: a call of any thread
        that waits in ``put``, ``get`` or ``poll`` (for room, a message or a lock) raises
        ``RingClosed``, at once if it sleeps on the ring, else within :data:`SLICE`.  A
        call that need not wait still goes through, and the syncs (the channel's own
        bookkeeping) still wait: the ring stays mapped until :meth:`close`."""
        self._shut = True
        base, mem = self._base, self._mem  # mem: mapped while this call wakes
        if base and mem is not None:  # a sleeper of this process wakes to see it shut
            _wake(base + _TAIL)
            _wake(base + _HEAD)

    def _refusal(self, n: int) -> Exception:
        if self._shut:
            return RingClosed("this ring is closed")
        return ValueError(f"a message of {n} bytes does not fit a ring record (at most "
                          f"{self.payload_max} bytes): send it another way, or make the "
                          "ring with a larger record_size")

    def _take(self, lock: int, rc: int, flag: int, block: bool, deadline: float | None,
              exc: type[Exception]) -> float | None:
        """Finish taking ``lock`` after a try-lock returned ``rc``: wait for it (up to
        ``deadline``; without ``block``, only while its holder is not asleep on the ring,
        which means the ring is full (empty)), and take it over from a dead owner.
        ``flag``: this lock's sleeper flag (an index of ``_i``).  Returns ``deadline``."""
        words = self._i
        assert words is not None
        while rc == _EBUSY or rc == _ETIMEDOUT:
            if self._shut and exc is not TimeoutError:  # (a sync waits on: see shut)
                raise self._refusal(0)
            if not block:
                if words[flag]:
                    raise exc()
                left = 0.0002  # a holder that reads or writes lets go in microseconds
            elif deadline is None:
                left = SLICE
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise exc()
            rc = _lock_for(lock, min(left, SLICE))
        if rc == _EOWNERDEAD:
            _consistent(lock)
            words[flag] = 0  # the dead owner may have been asleep
            self.recovered += 1
        elif rc == _EDEADLK:
            raise OSError(rc, "this thread already holds the ring's lock: a put or get "
                          "called inside another (from a signal handler?) would wait for "
                          "itself")
        elif rc:
            raise OSError(rc, f"could not take a ring's lock: {os.strerror(rc)}")
        if self._shut and exc is not TimeoutError:  # shut while this thread waited
            raise self._refusal(0)
        return deadline

    def _sleep_while(self, base: int, word: int, value: int, flag: int,
                     deadline: float | None, exc: type[Exception]) -> None:
        """Wait until the sequence number ``_q[word]`` is no longer ``value`` (the caller
        holds the lock whose sleeper flag is ``_i[flag]``), or raise ``exc`` at
        ``deadline`` (``RingClosed`` once another thread closed the ring): spin for up to
        :attr:`spin` seconds while waits have been that short, then sleep on the word's
        futex.  ``base``: the mapping's address, which the caller keeps mapped."""
        q, words = self._q, self._i
        assert q is not None and words is not None
        spin = self.spin
        if spin and self._hot and deadline != 0.0:
            clock, pause = time.monotonic, os.sched_yield  # pause: let others have the CPU
            end = clock() + spin if deadline is None else min(clock() + spin, deadline)
            while q[word] == value:
                if clock() > end:
                    self._hot = False  # waited past the budget: sleep at once next time
                    break
                if self._shut:  # shut by another thread: the loop below raises
                    break
                pause()
            else:
                return
        addr, expected = base + 8 * word, value & _MASK
        began = time.monotonic()
        words[flag] = 1
        try:
            while q[word] == value:
                if self._shut:  # shut by another thread (which woke this one)
                    raise self._refusal(0)
                if deadline is None:
                    left = SLICE
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise exc()
                _wait(addr, expected, min(left, SLICE))
        finally:
            words[flag] = 0
        self._hot = time.monotonic() - began <= spin  # a short sleep: spin next time

    def qsize(self) -> int:
        """The number of messages in the ring (approximate while others use it)."""
        q = self._q
        if q is None:
            raise self._refusal(0)
        return max(0, min(int(q[_TAIL_Q] - q[_HEAD_Q]), self.capacity))

    __len__ = qsize

    def empty(self) -> bool:
        return self.qsize() == 0

    def full(self) -> bool:
        return self.qsize() == self.capacity

    def _claim_index(self) -> int:
        """Lock the first free liveness byte from the ring's hint on: this process's index."""
        words = self._i
        assert words is not None
        start = int(words[_NEXT_I])
        for i in range(MAX_PROCS):
            k = (start + i) % MAX_PROCS
            try:
                fcntl.fcntl(self._live, fcntl.F_OFD_SETLK,
                            _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, LIVE + k, 1, 0))
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EACCES):
                    continue
                raise
            words[_NEXT_I] = (k + 1) % MAX_PROCS  # a hint: a race costs a probe
            return k
        raise OSError(errno.EUSERS, f"all {MAX_PROCS} process indices of this ring are "
                      "taken: close rings in processes that no longer use them")

    def alive(self, k: int) -> bool:
        """Whether process index ``k`` belongs to a process that has this ring now."""
        if k == self.index:
            return True
        got = fcntl.fcntl(self._live, fcntl.F_OFD_GETLK,
                          _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, LIVE + k, 1, 0))
        return bool(_FLOCK.unpack(got)[0] != fcntl.F_UNLCK)

    def peers_alive(self) -> bool:
        """Whether another process has this ring now (one probe of every index)."""
        got = fcntl.fcntl(self._live, fcntl.F_OFD_GETLK,
                          _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, LIVE, MAX_PROCS, 0))
        return bool(_FLOCK.unpack(got)[0] != fcntl.F_UNLCK)

    def _after_fork_in_child(self) -> None:
        """A new description and index: the inherited description's lock is the parent's
        (it would outlive the parent while this child keeps the fd)."""
        if self._mem is None:
            return
        old, self._live = self._live, _reopen(self.fd)
        os.close(old)
        self.index = self._claim_index()

    def close(self) -> None:
        """Close the ring's fds and let go of its mapping.  A call of another thread that
        waits in the ring (for a message, for room, for a lock) raises ``RingClosed``, at
        once if it sleeps on the ring, else within :data:`SLICE` (see :meth:`shut`); every
        later call raises it too.  The mapping goes once no call uses it: a call holds it
        (its local ``mem``), so a close never unmaps the memory under a lock, futex or
        record in use."""
        self.shut()
        self._base = 0  # the C fast paths refuse a closed ring by it
        self._mem = None
        _rings.discard(self)
        self._anchor = None
        self._q = self._i = None
        self.user = _NO_WORDS
        for fd in (self._live, self.fd):
            if fd >= 0:
                os.close(fd)
        self._live = self.fd = -1

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._mem is None else f"{self.qsize()}/{self.capacity}"
        return (f"<Ring {state}, {self.record_size}-byte records, process index "
                f"{self.index}>")


def _init_robust_mutexes(mem: mmap.mmap, offsets: tuple[int, ...]) -> None:
    """Make a process-shared robust mutex at each of ``offsets`` of ``mem``."""
    attr = ctypes.create_string_buffer(64)  # pthread_mutexattr_t: 4 bytes in glibc and musl
    anchor = ctypes.c_char.from_buffer(mem)
    try:
        for call in (_libc.pthread_mutexattr_init(attr),
                     _libc.pthread_mutexattr_setpshared(attr, 1),  # PTHREAD_PROCESS_SHARED
                     _libc.pthread_mutexattr_setrobust(attr, 1),  # PTHREAD_MUTEX_ROBUST
                     # PTHREAD_MUTEX_ERRORCHECK: the owner's own try-lock says EDEADLK
                     _libc.pthread_mutexattr_settype(attr, 2)):
            if call:
                raise OSError(call, f"pthread_mutexattr: {os.strerror(call)}")
        for off in offsets:
            rc = _libc.pthread_mutex_init(ctypes.c_void_p(ctypes.addressof(anchor) + off),
                                          attr)
            if rc:
                raise OSError(rc, f"pthread_mutex_init: {os.strerror(rc)}")
        _libc.pthread_mutexattr_destroy(attr)
    finally:
        del anchor


def _after_fork_in_child() -> None:
    for ring in list(_rings):
        ring._after_fork_in_child()


if HAVE_RING:
    os.register_at_fork(after_in_child=_after_fork_in_child)
