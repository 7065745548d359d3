import os

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
def lc():
    """Every test that starts processes runs under the leak checker."""
    with leak_checker(timeout=15) as checker:
        yield checker


def join_all(*procs, timeout=JOIN):
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(5)
            raise AssertionError(f"process {p.pid} did not finish within {timeout}s")
