"""The CUDA receive's bookkeeping, without a GPU: each kind of device memory (VMM slab,
legacy IPC allocation) has one attach, which a pickled message and a one-array lane reach
alike; only what the hold is made from differs (the in-flight description with
``deferred``, or the lane's fd list, whose description becomes the hold at once).

CuPy, the driver calls and the releaser are stand-ins that record what they are asked:
what is checked is which fds the attach keeps (they leave the message's list), the
holds and uses it makes, and that letting go of every use releases every hold and
mapping.  The GPU suite (tests/test_cuda.py) runs the same paths on a device.
"""

from __future__ import annotations

import os
import pickle
import types
from collections import OrderedDict

import pytest

from shmtensor import _wire
from shmtensor.cuda import _device, _events, _ipc, _release, _vmm
from shmtensor.ipc import cuda_vmm, ofd_lease


class _Mem:
    def __init__(self, ptr, size, owner, device):
        self.ptr, self.size, self.owner, self.device = ptr, size, owner, device


class _Ptr:
    def __init__(self, mem, offset):
        self.mem, self.offset = mem, offset


class _Array:
    def __init__(self, shape, dtype, data, strides=None):
        self.shape, self.dtype, self.data, self.strides = shape, dtype, data, strides


@pytest.fixture
def fake(monkeypatch):
    """A fake CuPy on devices 0 and 1 (``fake.current`` is current), and the record of
    device switches, stream waits and releases enqueued."""
    rec = types.SimpleNamespace(current=0, calls=[], released=[])

    class Device:
        def __init__(self, d):
            self.d = d

        def __enter__(self):
            rec.calls.append(("device", self.d))

        def __exit__(self, *exc):
            return None

    runtime = types.SimpleNamespace(getDevice=lambda: rec.current,
                                    ipcOpenMemHandle=lambda handle, flags: 0x5000)
    rec.cp = types.SimpleNamespace(ndarray=_Array, cuda=types.SimpleNamespace(
        UnownedMemory=_Mem, MemoryPointer=_Ptr, Device=Device, runtime=runtime,
        get_current_stream=lambda: types.SimpleNamespace(ptr=77)))
    monkeypatch.setattr(_device, "cupy", lambda: rec.cp)
    monkeypatch.setattr(_device, "local_device", lambda cp, bus_id: int(bus_id[-1]))
    monkeypatch.setattr(_release, "poll", lambda: None)
    monkeypatch.setattr(_release, "ensure_releaser", lambda: None)
    monkeypatch.setattr(_release, "enqueue", lambda *args: rec.released.append(args))
    monkeypatch.setattr(_events, "stream_wait",
                        lambda cp, ev, stream: rec.calls.append(("stream_wait", ev, stream)))
    monkeypatch.setattr(_events, "wait", lambda cp, ev: rec.calls.append(("wait", ev)))
    monkeypatch.setattr(cuda_vmm, "import_fd", lambda device, fd: ("handle", fd))
    monkeypatch.setattr(cuda_vmm, "map_handle", lambda device, handle, size: 0x1000)
    monkeypatch.setattr(cuda_vmm, "release", lambda device, handle: None)
    monkeypatch.setattr(cuda_vmm, "unmap", lambda device, ptr, size: None)
    monkeypatch.setattr(_vmm, "_maps", OrderedDict())
    monkeypatch.setattr(_ipc, "_mappings", _ipc._Mappings())
    rec.table = ofd_lease.own_table()
    yield rec
    _vmm._evict(0, 0)  # closes the slab fds the fake mappings kept
    assert not _vmm._maps, "a mapping still had a user after every use let go"


def _let_go(rec):
    """What the releaser does with the releases enqueued so far."""
    for _, table_id, slot, *done in rec.released:
        ofd_lease.release(table_id, slot)
        if done and done[0] is not None:
            done[0](1)
    rec.released.clear()


def _message_fds(rec, slot):
    """A VMM lane message's fds: a copy of the slab's fd, then an in-flight description
    of ``slot``."""
    return [os.memfd_create("slab", os.MFD_CLOEXEC), ofd_lease.inflight_fd(rec.table.id, [slot])]


@pytest.mark.parametrize("current", [0, 1])
def test_vmm_lane_keeps_the_slab_fd_and_the_description(fake, current):
    fake.current = current  # 1: the slab's device (0) is made current for the array
    slot = fake.table.new_slot()
    fds = _message_fds(fake, slot)
    slab_fd = fds[0]
    fields = ("peer.1", "bus0", 1 << 21, 512, (2, 3), None, "<f4", fake.table.id, slot, b"e")
    a = _vmm.lane_loads(_vmm.LANE + pickle.dumps(fields), fds)
    assert fds == [-1, -1]  # the mapping keeps the slab's fd, the hold the description
    m = _vmm._maps["peer.1"]
    assert m.fd == slab_fd and m.users == 1
    use = a.data.mem.owner
    assert (use.slab, use.slot, use.done) == (m, slot, m.done)
    assert (a.shape, a.strides, a.data.offset) == ((2, 3), None, 512)
    assert ("stream_wait", b"e", 77) in fake.calls
    assert (("device", 0) in fake.calls) == (current == 1)
    assert fake.table.is_held(slot)

    fds = _message_fds(fake, slot)  # the same block again: the mapping is found
    b = _vmm.lane_loads(_vmm.LANE + pickle.dumps(fields), fds)
    assert m.users == 2 and b.data.mem.owner is not use  # two uses, two counted holds
    del a, b, use
    assert len(fake.released) == 2
    _let_go(fake)
    assert not fake.table.is_held(slot) and m.users == 0


def test_vmm_pickled_array_takes_the_slab_fd_from_the_message_and_defers_its_hold(fake):
    slot = fake.table.new_slot()
    fds = _message_fds(fake, slot)
    lease = fds[1]
    ctx = _wire.RecvContext(fds)
    _wire.current.recv = ctx
    try:
        a = _vmm._rebuild_array("peer.2", "bus0", 1 << 21, 0, 0, (3,), (4,), "<f4",
                                fake.table.id, slot, 1, b"e")
    finally:
        _wire.current.recv = None
    assert fds == [-1, lease] and ctx.deferred == [(fake.table.id, slot, lease)]
    assert ("wait", b"e") in fake.calls  # once per message and stream
    ctx.establish(True)
    assert fds == [-1, -1] and fake.table.is_held(slot)  # the description is the hold
    del a
    _let_go(fake)
    assert not fake.table.is_held(slot)


def test_ipc_lane_and_pickled_array_share_one_use_per_chunk(fake):
    slot = fake.table.new_slot()
    fields = (b"H" * 64, "bus0", 4096, 16, (4,), None, "<f4", fake.table.id, slot, b"i")
    fds = [ofd_lease.inflight_fd(fake.table.id, [slot])]
    a = _ipc.lane_loads(_ipc.LANE + pickle.dumps(fields), fds)
    assert fds == [-1] and fake.table.is_held(slot)  # the description is the hold
    assert ("stream_wait", b"i", 77) in fake.calls

    fake.current = 1  # the pickled path, another device current: no new hold, one use
    lease = ofd_lease.inflight_fd(fake.table.id, [slot])
    ctx = _wire.RecvContext([lease])
    _wire.current.recv = ctx
    try:
        b = _ipc._rebuild_cupy_array(b"H" * 64, "bus0", 4096, 0, (4,), (4,), "<f4",
                                     fake.table.id, slot, 0, b"j")
    finally:
        _wire.current.recv = None
    assert b.data.mem.owner is a.data.mem.owner and ctx.deferred == []
    assert ("wait", b"j") in fake.calls and ("device", 0) in fake.calls
    os.close(lease)  # what loads closes
    del a, b
    assert len(fake.released) == 1
    _let_go(fake)
    assert not fake.table.is_held(slot)
