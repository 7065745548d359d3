"""Datasets for the DataLoader cases of test_others_suites (importable by spawned workers)."""

import os
import signal
import threading

import numpy as np

N = 24


def numpy_collate(items):
    """Batches as numpy arrays, so that they cross the worker queue as arrays."""
    return np.stack(items)


class Squares:
    """A map-style dataset of numpy arrays."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return np.full((3, 5), i * i, dtype=np.float64)


class Pids:
    """Each item names the worker that made it (persistent workers keep their pids)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.array([i, os.getpid()])


class DiesAt:
    """A worker dies at item ``at``: ``os._exit(3)`` or SIGKILL."""

    def __init__(self, at, how):
        self.at, self.how = at, how

    def __len__(self):
        return N

    def __getitem__(self, i):
        if i == self.at:
            if self.how == "exit":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGKILL)
        return np.full(4, i)


class Stalls:
    """Item ``at`` takes ``secs`` (longer than the loader's timeout)."""

    def __init__(self, at, secs):
        self.at, self.secs = at, secs

    def __len__(self):
        return N

    def __getitem__(self, i):
        if i == self.at:
            threading.Event().wait(self.secs)
        return np.full(4, i)


def _iterable_base():
    from torch.utils.data import IterableDataset
    return IterableDataset


class Shards(_iterable_base()):
    """An IterableDataset that each worker reads its share of (``get_worker_info``)."""

    def __iter__(self):
        from torch.utils.data import get_worker_info
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(wid, N, nw):
            yield np.array([i, wid], dtype=np.int64)
