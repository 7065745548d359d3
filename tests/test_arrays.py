"""Allocation and the reducers, within one process (through a real shmtensor Pipe)."""

import pickle

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp
from shmtensor import _reductions


def roundtrip(obj):
    a, b = smp.Pipe()
    try:
        a.send(obj)
        return b.recv()
    finally:
        a.close()
        b.close()


def test_alloc_functions_return_plain_shared_arrays(strategy):
    for arr, val in [(shmtensor.zeros((3, 4)), 0), (shmtensor.ones(5, dtype=np.int32), 1),
                     (shmtensor.full((2, 2), 7.5), 7.5)]:
        assert type(arr) is np.ndarray and shmtensor.is_shared(arr)
        assert (arr == val).all()
    f = shmtensor.empty((3, 4), order="F")
    assert f.flags.f_contiguous and not f.flags.c_contiguous
    base = np.arange(12.0).reshape(3, 4).T
    like = shmtensor.zeros_like(base)
    assert like.shape == base.shape and like.flags.f_contiguous and shmtensor.is_shared(like)
    assert shmtensor.empty_like(base, dtype=np.float32).dtype == np.float32


def test_share_memory_copies_once_and_is_idempotent():
    a = np.arange(10)
    s = shmtensor.share_memory(a)
    assert shmtensor.is_shared(s) and not shmtensor.is_shared(a)
    assert (s == a).all() and shmtensor.share_memory(s) is s
    assert shmtensor.is_shared(s[2:5]) and not shmtensor.is_shared(np.arange(3))


def test_bad_input_errors_name_the_fix():
    with pytest.raises(TypeError, match="Python objects"):
        shmtensor.empty(3, dtype=object)
    with pytest.raises(ValueError, match="negative"):
        shmtensor.empty((-1, 2))
    with pytest.raises(ValueError, match="order"):
        shmtensor.empty(3, order="K")
    with pytest.raises(ValueError, match="file_descriptor"):
        smp.set_sharing_strategy("bogus")
    with pytest.raises(ValueError, match="non-negative"):
        shmtensor.set_inline_threshold(-5)


LAYOUTS = {
    "c": lambda m: m(np.arange(24.0).reshape(4, 6)),
    "fortran": lambda m: m(np.asfortranarray(np.arange(24.0).reshape(4, 6))),
    "transposed": lambda m: m(np.arange(24.0).reshape(4, 6)).T,
    "strided": lambda m: m(np.arange(60.0).reshape(6, 10))[::2, 1::3],
    "negative": lambda m: m(np.arange(10.0))[::-1],
    "new-axis": lambda m: m(np.arange(12.0).reshape(3, 4))[:, None, :],  # stride 0, C order
    "offset": lambda m: m(np.arange(10, dtype=np.int16))[3:7],
    "big-endian": lambda m: m(np.arange(6, dtype=">i4")),
    "structured": lambda m: m(np.array([(1, 2.5), (3, 4.5)], dtype=[("a", "<i2"), ("b", ">f8")])),
    "zero-size": lambda m: m(np.zeros((0, 3))),
    "zero-d": lambda m: m(np.array(3.25)),
    "bool": lambda m: m(np.array([True, False, True])),
    "complex": lambda m: m(np.arange(4) * (1 + 2j)),
    "datetime": lambda m: m(np.array(["2026-01-01", "2026-11-21"], dtype="M8[D]")),
}
MAKERS = {"plain": lambda a: a, "shared": shmtensor.share_memory,
          "large": lambda a: np.tile(a, (4096,) + (1,) * (a.ndim - 1)) if a.ndim else a}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("maker", sorted(MAKERS))
def test_layout_survives(layout, maker, strategy):
    a = LAYOUTS[layout](MAKERS[maker])
    b = roundtrip(a)
    assert b.dtype == a.dtype and b.shape == a.shape
    np.testing.assert_array_equal(b, a)
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    compacted = (maker == "large" and root is not a and root.nbytes > 2 * a.nbytes)
    if compacted:  # a small view of a large base travels as a compact copy, same order
        assert b.flags.f_contiguous == (a.flags.f_contiguous or (
            not a.flags.c_contiguous and a.strides[0] < a.strides[-1]))
    elif a.size:
        assert b.strides == a.strides
        assert b.flags.f_contiguous == a.flags.f_contiguous
        assert b.flags.c_contiguous == a.flags.c_contiguous


def test_an_empty_shared_view_keeps_its_strides_alone_and_in_a_container():
    a = shmtensor.empty((0, 4))[:, ::2]  # C-contiguous by its flags, whatever its strides
    alone, (inside,) = roundtrip(a), roundtrip([a])
    assert alone.strides == inside.strides == a.strides
    assert alone.shape == inside.shape == (0, 2) and shmtensor.is_shared(alone)


@pytest.mark.parametrize("maker", sorted(MAKERS))
def test_readonly_flag_survives(maker):
    a = MAKERS[maker](np.arange(8.0))
    a.flags.writeable = False
    b = roundtrip(a)
    assert not b.flags.writeable
    c = roundtrip(MAKERS[maker](np.arange(8.0)))
    assert c.flags.writeable


def test_shared_array_crosses_as_handle_writes_visible(strategy):
    a = shmtensor.zeros((4, 4))
    b = roundtrip(a)
    assert shmtensor.is_shared(b)
    b[1, 2] = 9
    assert a[1, 2] == 9


@pytest.mark.parametrize("maker", ["plain", "shared", "large"])
def test_views_of_one_base_arrive_as_views_of_one_buffer(maker, strategy):
    x = MAKERS[maker](np.random.rand(5, 5))
    data = [x, x[1:], x[:, 1:], x.T]
    new = roundtrip(data)
    for a, b in zip(data, new):
        np.testing.assert_array_equal(a, b)
    new[0][2, 1] = -1.0
    assert new[1][1, 1] == -1.0 and new[2][2, 0] == -1.0 and new[3][1, 2] == -1.0


def test_object_arrays_fall_back_to_pickle():
    a = np.array([{"x": 1}, None, "s"], dtype=object)
    b = roundtrip(a)
    assert b.dtype == object and b[0] == {"x": 1} and b[2] == "s"


def test_large_not_shared_is_copied_once_into_a_segment():
    a = np.arange(200_000, dtype=np.float64)
    before = shmtensor.debug_info()["arrays_sent_copied"]
    b = roundtrip(a)
    assert shmtensor.is_shared(b) and (b == a).all()
    assert shmtensor.debug_info()["arrays_sent_copied"] == before + 1
    b[0] = 5
    assert a[0] == 0  # a copy: the sender's array is untouched


def test_small_not_shared_is_inline_and_threshold_configurable():
    prev = shmtensor.get_inline_threshold()
    try:
        b = roundtrip(np.arange(10))
        assert not shmtensor.is_shared(b)
        shmtensor.set_inline_threshold(0)
        assert shmtensor.is_shared(roundtrip(np.arange(10)))
    finally:
        shmtensor.set_inline_threshold(prev)


def test_plain_pickle_of_shared_array_is_self_contained():
    a = shmtensor.full((3, 3), 2.0)
    blob = pickle.dumps(a)
    assert b"shmtensor" not in blob
    b = pickle.loads(blob)
    assert not shmtensor.is_shared(b) and (b == 2.0).all()


def test_segment_handle_outside_a_channel_is_refused():
    seg = shmtensor._segments.segment_of(shmtensor.zeros(3))
    _reductions._Pickler.refresh()  # the reducers as a send sees them (not only once one ran)
    with pytest.raises(pickle.PicklingError, match="shmtensor channels"):
        _reductions._Pickler(__import__("io").BytesIO()).dump(seg)


def test_segment_mapped_once_however_many_messages():
    a = shmtensor.zeros(1000)
    got = [roundtrip(a) for _ in range(5)]
    bases = {id(g.base) for g in got}
    assert len(bases) == 1  # one anchor, one mapping, in the receiver


def test_recycling_reuses_released_segments():
    shmtensor.empty_cache()
    before = shmtensor.debug_info()
    for _ in range(20):
        b = roundtrip(np.ones(300_000))  # past SLAB_ITEM_MAX: a segment of its own
        del b
    after = shmtensor.debug_info()
    assert after["segments_created"] - before["segments_created"] <= 2
    assert after["segments_recycled"] - before["segments_recycled"] >= 18


def test_no_reuse_while_a_receiver_holds_the_segment():
    kept = roundtrip(np.full(100_000, 1.0))
    again = roundtrip(np.full(100_000, 2.0))
    assert (kept == 1.0).all() and (again == 2.0).all()


def test_full_dev_shm_raises_a_clear_error_instead_of_sigbus(strategy):
    import shutil
    huge = shutil.disk_usage("/dev/shm").free * 4 + (1 << 40)
    with pytest.raises(shmtensor.ShmSpaceError) as err:
        shmtensor.empty(huge, dtype=np.uint8)
    msg = str(err.value)
    assert "MiB" in msg and ("--shm-size" in msg or "memory" in msg)
    with pytest.raises(shmtensor.ShmSpaceError):
        roundtrip(np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), (huge,), (0,)))


def test_channel_survives_dropped_fds():
    import resource
    a, b = smp.Pipe()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    x = shmtensor.zeros(10)
    import os
    fillers = []
    try:
        a.send(x)
        top = max(int(f) for f in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1, hard))
        while True:  # take every free fd number: no room for the received fds
            try:
                fillers.append(os.dup(0))
            except OSError:
                break
        with pytest.raises(OSError, match="ulimit"):
            b.recv()
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    a.send(x)  # the failed message was read whole: the channel still works
    assert b.recv().base is x.base
    a.close()
    b.close()


def test_one_shared_array_alone_skips_the_pickler_and_crosses_as_in_a_container(strategy):
    a = shmtensor.zeros((20, 30))
    a[...] = np.arange(600.0).reshape(20, 30)
    view = a[2::3, ::-2]
    data, sent = _reductions.dumps(view)  # alone: the lane, no pickler
    assert bytes(data[:len(_reductions.NUMPY_LANE)]) == _reductions.NUMPY_LANE
    sent.release()
    data, sent = _reductions.dumps([view])  # in a container: the pickler
    assert bytes(data[:1]) == pickle.PROTO
    sent.release()
    ro = a[1]
    ro.flags.writeable = False
    alone, (inside,), got_ro = roundtrip(view), roundtrip([view]), roundtrip(ro)
    for b in (alone, inside):
        assert b.strides == view.strides and shmtensor.is_shared(b)
        np.testing.assert_array_equal(b, view)
    assert not got_ro.flags.writeable and got_ro[3] == 33.0
    alone[0, 0] = -1.0  # the same memory as the sender's
    assert a[2, 29] == -1.0 and inside[0, 0] == -1.0


PLAIN_ALONE = {
    "c": np.arange(24.0).reshape(4, 6),
    "fortran": np.asfortranarray(np.arange(24, dtype=np.int16).reshape(4, 6)),
    "new-axis": np.arange(12.0).reshape(3, 4)[:, None, :],
    "big-endian": np.arange(6, dtype=">i4"),
    "unicode": np.array(["a", "bcd", ""]),
    "bytes": np.array([b"xy", b"z"]),
    "zero-d": np.array(3.25),
    "zero-size": np.zeros((0, 3), np.float32),
    "timedelta": np.array([1, -2], dtype="m8[ms]"),
}


@pytest.mark.parametrize("name", sorted(PLAIN_ALONE))
def test_one_plain_array_alone_skips_the_pickler_and_arrives_as_its_own_copy(name):
    a = PLAIN_ALONE[name]
    data, sent = _reductions.dumps(a)
    assert bytes(data[:2]) == _reductions.PLAIN_LANE and sent.wire_fds() == []
    sent.release()
    b = _reductions.loads(data, [])
    assert type(b) is np.ndarray and b.dtype == a.dtype and b.shape == a.shape
    assert b.strides == a.strides and b.flags.writeable
    np.testing.assert_array_equal(b, a)
    assert not shmtensor.is_shared(b) and not np.shares_memory(a, b)
    if b.size:  # its own buffer: writing it changes nothing else
        b.reshape(-1)[0] = b.reshape(-1)[-1]
        np.testing.assert_array_equal(_reductions.loads(data, []), a)
    ro = a.copy(order="K")
    ro.flags.writeable = False
    got = roundtrip(ro)
    assert not got.flags.writeable and got.strides == ro.strides
    np.testing.assert_array_equal(got, a)


def test_a_strided_or_structured_plain_array_alone_takes_the_pickler():
    for a in (np.arange(10.0)[::2], np.zeros(3, dtype=[("a", "<i2"), ("b", ">f8")]),
              np.array([None, 1], dtype=object)):
        data, sent = _reductions.dumps(a)
        assert bytes(data[:1]) == pickle.PROTO
        sent.release()


def test_a_malformed_plain_array_message_is_an_unpickling_error_and_closes_its_fds():
    import os
    data, _ = _reductions.dumps(np.arange(6.0).reshape(2, 3))
    for cut in (2, 4, 5, 20, len(data) - 1):
        with pytest.raises(pickle.UnpicklingError, match="malformed array message"):
            _reductions.loads(data[:cut], [])
    with pytest.raises(pickle.UnpicklingError, match="unknown message kind"):
        _reductions.loads(data[:1], [])
    for name in (b"|O", b"i4,O"):  # an object dtype would read its bytes as pointers
        head = _reductions.PLAIN_LANE + bytes([0, 1, len(name)])
        bad = head + (1).to_bytes(8, "little") + (8).to_bytes(8, "little") + name + bytes(8)
        with pytest.raises(pickle.UnpicklingError, match="holds Python objects"):
            _reductions.loads(bad, [])
    r, w = os.pipe()
    with pytest.raises(pickle.UnpicklingError, match="came with 2 fds"):
        _reductions.loads(data, [r, w])
    for fd in (r, w):
        with pytest.raises(OSError):
            os.fstat(fd)


def _plain_message(shape, strides, name, data, readonly=0):
    import struct
    return (struct.pack("<2sBBB", _reductions.PLAIN_LANE, readonly, len(shape), len(name))
            + struct.pack(f"<{2 * len(shape)}q", *shape, *strides) + name + data)


@pytest.mark.parametrize("shape, strides, name, data, readonly", [
    # strides whose extents wrap around int64 pass numpy's own bounds check
    ((2, 2, 2, 2), (-2**62, -2**62, -2**62, -2**62 + 256), b"u1", bytes(16), 0),
    ((2, 2), (2**63 - 1, 2**63 - 1), b"u1", bytes(4), 0),
    ((4096,), (8,), b"<f8", b"", 0),          # no bytes: numpy checks nothing
    ((2,), (8,), b"<f8", bytes(24), 0),       # bytes left over
    ((2, 3), (8, 8), b"<f8", bytes(48), 0),   # overlapping items
    ((2,), (-8,), b"<f8", bytes(16), 0),      # before the buffer
    ((2,), (8,), b"<f8", bytes(16), 2),       # a flag that is no flag
    ((-1, -8), (8, 8), b"u1", bytes(8), 0),   # negative lengths
    ((1,), (8,), b"9)", bytes(8), 0),         # a dtype string numpy parses as Python
    ((1,), (8,), b"<08[s]", bytes(8), 0),
], ids=["wrapping-strides", "wrapping-strides-2", "no-bytes", "bytes-left-over", "overlapping",
        "before-the-buffer", "bad-flag", "negative-lengths", "dtype-syntax", "dtype-syntax-2"])
def test_a_plain_array_header_that_does_not_describe_its_bytes_is_refused(
        shape, strides, name, data, readonly):
    with pytest.raises(pickle.UnpicklingError, match="malformed array message"):
        _reductions.loads(_plain_message(shape, strides, name, data, readonly), [])


def test_a_plain_array_header_may_give_any_stride_to_an_axis_of_length_one():
    a = _reductions.loads(_plain_message((2, 1, 3), (24, 0, 8), b"<f8", bytes(48)), [])
    assert a.shape == (2, 1, 3) and a.strides == (24, 0, 8) and not a.any()


def test_a_dtype_with_metadata_keeps_it_after_the_same_dtype_went_plain():
    plain = roundtrip(np.ones(3))
    dt = np.dtype(np.float64, metadata={"unit": "m"})
    got = roundtrip(np.ones(3, dt))
    assert plain.dtype.metadata is None and got.dtype.metadata == {"unit": "m"}


def test_a_shared_array_keeps_its_dtypes_metadata_after_the_same_dtype_without_it():
    # a dtype with metadata is equal (and hashes equal) to the one without: no cache of
    # either may answer for the other
    dt = np.dtype(np.float64, metadata={"unit": "m"})
    plain = roundtrip(shmtensor.ones(3, np.dtype(np.float64)))
    made = shmtensor.ones(3, dt)
    got = roundtrip(made)
    assert plain.dtype.metadata is None
    assert made.dtype.metadata == {"unit": "m"} and got.dtype.metadata == {"unit": "m"}
