"""Children and datasets for test_torch (importable by spawned children; torch imported here).

Children compute with numpy, not torch: a forked child's first multi-threaded torch op
hangs in OpenMP when the parent already ran one (torch's limit with any fork context)."""

import numpy as np
import torch

import shmtensor


def cases():
    """(name, tensor): every dtype, shapes 0-d to 4-d, empty, views, strided, large."""
    g = torch.Generator().manual_seed(0)
    out = [(f"dtype {dt}", (torch.rand(3, 5, generator=g) * 100).to(dt)) for dt in (
        torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
        torch.complex128, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
        torch.bool, torch.uint16, torch.uint32, torch.uint64)]
    big = torch.arange(600 * 500, dtype=torch.float32).reshape(600, 500)  # 1.2 MB
    out += [
        ("0-d", torch.tensor(2.5)),
        ("empty", torch.zeros(0, 3)),
        ("empty int", torch.zeros(4, 0, dtype=torch.int64)),
        ("large", big),
        ("large transposed", big.t()),
        ("slab-sized", torch.arange(100_000, dtype=torch.int32)),
        ("column of large", big[:, 7]),
        ("offset view (compacted, inline)", big[10:20, 100:300]),
        ("rows of a larger one (compacted)", torch.ones(2000, 500)[100:250]),
        ("every other row", big[::2]),
        ("expanded", torch.arange(4.0).expand(3, 4)),
        ("channels_last", torch.rand(2, 3, 4, 5, generator=g)
         .to(memory_format=torch.channels_last)),
        ("requires_grad", torch.rand(4, 4, generator=g).requires_grad_()),
        ("parameter", torch.nn.Parameter(torch.rand(3, 3, generator=g))),
        ("frozen parameter", torch.nn.Parameter(torch.rand(3, generator=g),
                                                requires_grad=False)),
        ("int parameter", torch.nn.Parameter(torch.arange(3), requires_grad=False)),
        ("conj", torch.rand(3, dtype=torch.complex64, generator=g).conj()),
        ("from numpy", torch.from_numpy(np.arange(50_000, dtype=np.float64))),
    ]
    return out


def describe(t):
    """What must survive a crossing (strides of a compacted view may change)."""
    return (type(t).__name__, str(t.dtype), tuple(t.shape), t.requires_grad,
            t.detach().resolve_conj().tolist())


def echo(conn):
    while True:
        msg = conn.recv()
        if msg is None:
            break
        conn.send(msg)
    conn.close()


def queue_echo(inq, outq):
    while True:
        msg = inq.get()
        if msg is None:
            break
        outq.put(msg)


def writer(conn):
    """Zero-copy both ways: fill what arrives; send tensors on segments (a small one in a
    slab, a large one alone) and report what the parent wrote into them."""
    t = conn.recv()
    t.numpy().fill(7)
    conn.send("filled")
    del t
    mine = [torch.from_numpy(shmtensor.zeros(1000, np.float32)),
            torch.from_numpy(shmtensor.zeros((1024, 1024), np.float32))[1:, ::2]]
    conn.send(mine)
    conn.recv()  # the parent wrote
    conn.send([float(m[0, 0] if m.ndim == 2 else m[0]) for m in mine])
    conn.recv()
    conn.close()


def hold_then_drop(conn):
    """Send a tensor on this child's segment; after the parent dropped it, report whether
    the segment went idle here (released everywhere) and was handed out again."""
    t = torch.from_numpy(shmtensor.zeros((512, 1024), np.float32))  # 2 MiB, its own segment
    ptr = t.data_ptr()
    conn.send(t)
    del t
    conn.recv()  # the parent dropped its tensor
    again = torch.from_numpy(shmtensor.zeros((512, 1024), np.float32))
    conn.send(again.data_ptr() == ptr)
    conn.close()


def double(t):
    return torch.from_numpy(t.numpy() * 2)


class NumpyItems:
    """A map-style dataset of numpy items (dicts of a large array, a small one, an int)."""

    def __init__(self, n=12, shape=(128, 256)):
        self.n, self.shape = n, shape

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": np.full(self.shape, i, np.float32), "y": np.arange(3) + i, "i": i}


def batch_rows(batches):
    return [{k: (str(v.dtype), tuple(v.shape), v.tolist()) for k, v in b.items()}
            for b in batches]
