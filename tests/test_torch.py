"""torch CPU tensors on shmtensor's channels (issue 14): through segments, not torch's fds.

Round trips of every dtype and layout through Pipe, Queue and Pool under fork and spawn,
zero-copy both ways for tensors on segments, views of one storage arriving as views of one
storage, release when the last tensor dies, torch's DataLoader with default collate on
shmtensor's context against torch's own, and the stdlib's context as the reference.
"""

import contextlib
import multiprocessing
import pickle
import re
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import shmtensor  # noqa: E402
import shmtensor.multiprocessing as smp  # noqa: E402
from shmtensor import _segments  # noqa: E402
from shmtensor.testing import leak_checker  # noqa: E402

import torch_helpers as th  # noqa: E402
from conftest import JOIN, START_METHODS, join_all  # noqa: E402
from test_arrays import roundtrip  # noqa: E402

METHODS = [m for m in START_METHODS if m in ("fork", "spawn")]


def _on_segment(t) -> bool:
    return t.numel() > 0 and _segments.segment_at(t.data_ptr()) is not None


def _check_same(got, want, name, alone=True):
    """Same values, type, dtype, shape, requires_grad; same strides and offset, except for a
    small view of a large storage sent alone (compacted: contiguous).  In a message that
    holds its whole storage too, a view stays one of that storage."""
    assert th.describe(got) == th.describe(want), name
    if "compacted" in name and alone:
        assert got.is_contiguous() and got.storage_offset() == 0, name
    elif "compacted" not in name:
        assert got.stride() == want.stride() and got.storage_offset() == (
            want.storage_offset()), name


def _start(ctx, target, *args):
    p = ctx.Process(target=target, args=args)
    p.start()
    return p


@contextlib.contextmanager
def _child(ctx, target):
    """``target(conn)`` in a child: yields the parent's end; the child must exit 0 after the
    body (it is killed when the body fails, so a failed test leaves no child waiting)."""
    a, b = ctx.Pipe()
    p = _start(ctx, target, b)
    b.close()
    try:
        yield a
    except BaseException:
        p.kill()
        p.join(JOIN)
        raise
    finally:
        a.close()
    join_all(p)
    assert p.exitcode == 0


# -- in one process ---------------------------------------------------------------------------

def test_every_case_round_trips_in_process(strategy):
    cases = th.cases()
    got = roundtrip([t for _, t in cases])
    for (name, want), t in zip(cases, got):
        _check_same(t, want, name, alone=False)
        if want.numel() * want.element_size() >= shmtensor.get_inline_threshold():
            assert _on_segment(t), name


def test_plain_pickle_and_forking_pickler_keep_torch_reducers():
    t = torch.arange(10.0)
    assert torch.equal(pickle.loads(pickle.dumps(t)), t)
    roundtrip(t)  # the registry is installed by now
    from torch.multiprocessing.reductions import reduce_tensor
    assert ForkingPickler._extra_reducers[torch.Tensor] is reduce_tensor


def test_non_leaf_requiring_grad_is_refused_as_torch_refuses():
    t = torch.rand(3, requires_grad=True) * 2
    a, b = smp.Pipe()
    with a, b, pytest.raises(RuntimeError, match="Cowardly refusing to serialize non-leaf"):
        a.send(t)


def test_tensor_and_numpy_array_on_one_segment_arrive_on_one_memory():
    arr = shmtensor.zeros(100_000, np.float32)
    t = torch.from_numpy(arr)
    got_t, got_arr = roundtrip([t[10:], arr])
    assert got_t.data_ptr() == got_arr.ctypes.data + 40 == t.data_ptr() + 40


# -- across processes -------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_pipe_round_trip_of_every_case(method, lc):
    with _child(smp.get_context(method), th.echo) as a:
        cases = th.cases()
        for name, want in cases:  # one message each
            a.send(want)
            _check_same(a.recv(), want, name)
        a.send([t for _, t in cases])  # all in one message
        for (name, want), got in zip(cases, a.recv()):
            _check_same(got, want, name, alone=False)
        a.send(None)


@pytest.mark.parametrize("method", METHODS)
def test_views_of_one_storage_arrive_as_views_of_one_storage(method, lc):
    with _child(smp.get_context(method), th.echo) as a:
        for base in (torch.arange(100_000.0).reshape(100, 1000),  # copied into a segment
                     torch.from_numpy(shmtensor.zeros((100, 1000), np.float64)),  # on one
                     torch.arange(100.0).reshape(10, 10)):  # inline
            a.send([base, base[3], base[:, 5], base.t()])
            got = a.recv()
            assert len({g.untyped_storage().data_ptr() for g in got}) == 1
            got[1][5] = -1
            assert got[0][3, 5] == got[2][3] == got[3][5, 3] == -1
        a.send(None)


@pytest.mark.parametrize("method", METHODS)
def test_tensors_on_segments_cross_without_a_copy_both_ways(method, strategy, lc):
    with _child(smp.get_context(method), th.writer) as a:
        mine = torch.from_numpy(shmtensor.zeros((300, 300), np.float32))
        a.send(mine[5:])
        assert a.recv() == "filled"
        assert (mine[5:] == 7).all() and (mine[:5] == 0).all()
        theirs = a.recv()
        assert all(_on_segment(t) for t in theirs)
        theirs[0][0] = 3
        theirs[1][0, 0] = 4
        a.send("wrote")
        assert a.recv() == [3.0, 4.0]
        del theirs
        a.send(None)


@pytest.mark.parametrize("method", METHODS)
def test_torch_shared_memory_stays_shared(method, lc):
    with _child(smp.get_context(method), th.writer) as a:
        t = torch.zeros(1000).share_memory_()
        a.send(t)  # the child fills it, in torch's shared memory, through the fd in the message
        assert a.recv() == "filled"
        assert (t == 7).all()
        a.recv()
        a.send("wrote")
        a.recv()
        a.send(None)


@pytest.mark.parametrize("method", METHODS)
def test_received_tensor_releases_its_segment_when_it_dies(method, lc):
    with _child(smp.get_context(method), th.hold_then_drop) as a:
        t = a.recv()
        assert shmtensor.debug_info()["segments_attached_live"] == 1
        view = t[3:5]
        del t
        assert shmtensor.debug_info()["segments_attached_live"] == 1  # the view holds it
        del view
        assert shmtensor.debug_info()["segments_attached_live"] == 0
        a.send("dropped")
        assert a.recv() is True  # the child's next segment of that size was the same one


@pytest.mark.parametrize("method", METHODS)
def test_queue_round_trip(method, lc):
    ctx = smp.get_context(method)
    inq, outq = ctx.Queue(), ctx.Queue()
    p = _start(ctx, th.queue_echo, inq, outq)
    try:
        cases = th.cases()
        for name, want in cases:
            inq.put((name, want))
        for name, want in cases:
            got_name, got = outq.get(timeout=JOIN)
            assert got_name == name
            _check_same(got, want, name)
        inq.put(None)
    except BaseException:
        p.kill()
        raise
    finally:
        join_all(p)
    assert p.exitcode == 0
    for q in (inq, outq):
        q.close()
        q.join_thread()


@pytest.mark.parametrize("method", METHODS)
def test_pool_map(method, lc):
    ctx = smp.get_context(method)
    tensors = [torch.full((256, 256), float(i)) for i in range(6)] + [torch.arange(5)]
    with ctx.Pool(2) as pool:
        got = pool.map(th.double, tensors)
        pool.close()
        pool.join()
    for want, g in zip(tensors, got):
        assert torch.equal(g, want * 2)
    assert all(_on_segment(g) for g in got[:-1])


# -- the stdlib's context as the reference ----------------------------------------------------

def _echo_scenario(ctx):
    """Every case through a Pipe to a child and back, and what a refused send raises."""
    out = []
    with _child(ctx, th.echo) as a:
        for name, t in th.cases():
            if name == "conj":  # torch's own reducer drops the conjugate bit (torch 2.13)
                continue
            a.send(t)
            out.append((name, th.describe(a.recv())))
        try:
            a.send(torch.rand(2, requires_grad=True) * 1)
        except RuntimeError as e:
            out.append(("refused", str(e)))
        a.send(None)
    return out


@pytest.mark.parametrize("method", METHODS)
def test_same_outcomes_as_the_stdlib_context(method):
    # torch's reducers on the stdlib's channels leave their fd server's socket behind: only
    # shmtensor's run is leak-checked
    stdlib = _echo_scenario(multiprocessing.get_context(method))
    with leak_checker(timeout=15):
        shm = _echo_scenario(smp.get_context(method))
    assert shm == stdlib
    assert stdlib[-1][0] == "refused" and len(stdlib) == len(th.cases())


# -- torch's DataLoader -----------------------------------------------------------------------

def _loader(ctx, dataset, **kw):
    from torch.utils.data import DataLoader
    return DataLoader(dataset, batch_size=kw.pop("batch_size", 4), num_workers=2,
                      multiprocessing_context=ctx, **kw)


@pytest.mark.parametrize("method", METHODS)
def test_dataloader_default_collate_same_batches_as_torch(method, lc):
    import torch.multiprocessing.reductions as tmr
    torch_batches = list(_loader(multiprocessing.get_context(method), th.NumpyItems()))
    shm_batches = list(_loader(smp.get_context(method), th.NumpyItems()))
    assert th.batch_rows(shm_batches) == th.batch_rows(torch_batches)
    assert len(shm_batches) == 3
    # torch's context hands batches over as torch shared memory, shmtensor's as segments
    assert not any(_on_segment(b["x"]) for b in torch_batches)
    assert all(_on_segment(b["x"]) for b in shm_batches)
    assert all(b["x"].untyped_storage().is_shared() for b in torch_batches)
    before = len(tmr.shared_cache)
    del torch_batches, shm_batches
    list(_loader(smp.get_context(method), th.NumpyItems()))
    assert len(tmr.shared_cache) <= before  # nothing came through torch's fd passing


@pytest.mark.parametrize("how", ["exit", "sigkill"])
@pytest.mark.parametrize("method", ["fork"])
def test_dataloader_worker_crash_with_tensor_batches(method, how, lc):
    # the batches are torch tensors (default collate): in the message itself, so a batch
    # from a worker that dies right after sending still arrives whole (with torch's own
    # fd passing it may not: EOFError), and the death is reported as torch reports it
    import dataloader_helpers as dl
    died = r"DataLoader worker \(pid(\(s\))? \d+\) (exited unexpectedly|is killed by signal)"
    with pytest.raises(RuntimeError) as info:
        list(_loader(smp.get_context(method), dl.DiesAt(9, how)))
    assert re.match(died, str(info.value)), info.value
