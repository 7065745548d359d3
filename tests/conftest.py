import gc
import multiprocessing
import os
import time

import pytest

import shmtensor
import shmtensor.multiprocessing as smp
from shmtensor.testing import leak_checker

START_METHODS = [m for m in ("fork", "spawn", "forkserver") if m in smp.get_all_start_methods()]
STRATEGIES = sorted(smp.get_all_sharing_strategies())
JOIN = 60  # seconds: only reached when something deadlocks


@pytest.fixture(params=STRATEGIES)
def strategy(request):
    prev = smp.get_sharing_strategy()
    smp.set_sharing_strategy(request.param)
    yield request.param
    smp.set_sharing_strategy(prev)


@pytest.fixture
def counted(monkeypatch):
    """How many records without fds this process took (``Channel._held`` calls)."""
    from shmtensor import _channel
    calls = [0]
    real = _channel.Channel._held

    def held(self, number, data, back):
        calls[0] += 1
        return real(self, number, data, back)
    monkeypatch.setattr(_channel.Channel, "_held", held)
    return calls


@pytest.fixture
def lc():
    """Every test that starts processes runs under the leak checker."""
    with leak_checker(timeout=15) as checker:
        yield checker


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def _target(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


@pytest.fixture
def no_leaks():
    """The test leaves no child process and no fd of this process open (without the leak
    checker's process tree: for tests of one mechanism's fds)."""
    before = open_fds()
    yield
    assert not multiprocessing.active_children()
    gc.collect()  # a finished child's sentinel closes with its Process object
    # another thread of the suite (a sweeper, a janitor) may hold an fd for a moment:
    # only an fd still open after a short while is this test's
    deadline = time.monotonic() + 2
    while (left := open_fds() - before) and time.monotonic() < deadline:
        time.sleep(0.01)
    # as the deadline passes: one closed since the last look was another thread's
    targets = {fd: _target(fd) for fd in sorted(left & open_fds())}
    left = {fd for fd, target in targets.items() if target != "?"}
    assert not left, f"fds left open: {[(fd, targets[fd]) for fd in sorted(left)]}"


def join_all(*procs, timeout=JOIN):
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(5)
            raise AssertionError(f"process {p.pid} did not finish within {timeout}s")
