"""Subclasses of a registered type (issue 27: dispatch by type accepts subclasses).

pickle finds a reducer by an object's exact type, so a ``numpy.ndarray`` subclass used to
miss shmtensor's reducer: a shared array viewed as a subclass arrived as a copy, and the
receiver's writes were lost.  A subclass that keeps ndarray's own pickling is now sent as
an ndarray and rebuilt as itself; one with a pickling of its own keeps it.  Each case is
checked against what the stdlib's pickle gives (type, values, state).
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp

JOIN = 60


class Tagged(np.ndarray):
    """A user's subclass: an attribute set by ``__array_finalize__``."""

    def __array_finalize__(self, obj):
        self.tag = getattr(obj, "tag", "finalized")


class OwnPickle(np.ndarray):
    """A subclass with a pickling of its own (its ``note`` travels)."""

    def __reduce__(self):
        return _own_pickle, (np.asarray(self).copy(), self.note)


def _own_pickle(a, note):
    out = a.view(OwnPickle)
    out.note = note
    return out


def _write_back(q, done):
    a = q.get(timeout=JOIN)
    a[0] = 42
    done.put((type(a).__name__, float(a[1])))


def test_a_shared_subclass_array_crosses_as_the_same_memory(lc):
    """The child's write to a received ``Tagged`` view of a shared array is seen here."""
    ctx = smp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Queue()
    a = shmtensor.zeros(1000).view(Tagged)
    a[1] = 7
    p = ctx.Process(target=_write_back, args=(q, done))
    p.start()
    lc.check_pid(p.pid)
    q.put(a)
    got = done.get(timeout=JOIN)
    p.join(JOIN)
    assert p.exitcode == 0
    assert got == ("Tagged", 7.0)
    assert a[0] == 42, "the child's write was lost: the subclass array arrived as a copy"
    q.close()
    done.close()


def _cases():
    small = np.arange(12.0).reshape(3, 4)
    big = np.arange(300_000.0)  # over the inline threshold: copied into shared memory
    owned = Tagged((200_000,))  # a subclass owning its memory (not a view of an ndarray)
    owned[:] = 3
    own = np.arange(5.0).view(OwnPickle)
    own.note = "kept"
    return {
        "small subclass view": small.view(Tagged),
        "large subclass view": big.view(Tagged),
        "subclass owning its memory": owned,
        "strided subclass view": big[::3].view(Tagged),
        "matrix": np.matrix(small),
        "recarray": np.rec.array([(1, 2.0), (3, 4.0)], dtype=[("a", "i8"), ("b", "f8")]),
        "masked array (its own pickling)": np.ma.masked_array([1.0, 2.0, 3.0],
                                                              mask=[0, 1, 0]),
        "own pickling": own,
        "read-only subclass view": _readonly(big.view(Tagged)),
    }


def _readonly(a):
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("name", list(_cases()))
def test_a_subclass_arrives_as_the_stdlib_pickle_rebuilds_it(lc, name):
    """Through a shmtensor pipe and through the stdlib's pickle: the same type, values,
    flags and state."""
    obj = _cases()[name]
    expected = pickle.loads(pickle.dumps(obj))
    r, w = smp.Pipe()
    try:
        w.send(obj)
        got = r.recv()
    finally:
        r.close()
        w.close()
    assert type(got) is type(expected)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert got.flags.writeable == obj.flags.writeable
    if isinstance(obj, np.ma.MaskedArray):
        np.testing.assert_array_equal(got.mask, expected.mask)
    if isinstance(obj, OwnPickle):
        assert got.note == expected.note == "kept"
    del got, expected, obj
    shmtensor.empty_cache()


def test_a_large_subclass_array_is_shared_not_pickled_by_value():
    """A large plain subclass array is copied into shared memory once, as an ndarray is
    (not pickled by value: the message stays small)."""
    from shmtensor import _reductions
    a = np.ones(1 << 20).view(Tagged)
    data, ctx = _reductions.dumps(a)
    try:
        assert len(data) < 4096, f"a {a.nbytes}-byte array was pickled by value"
    finally:
        ctx.release()
    shmtensor.empty_cache()
