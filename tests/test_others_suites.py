"""Other people's test suites against shmtensor's drop-in: a failure the stdlib does not
have is a failure.

- CPython's ``test._test_multiprocessing``: the "processes" flavour, the module-level
  "misc" classes and the "manager" flavour, with shmtensor's Process, Queue,
  JoinableQueue, Pipe, Pool, Manager, SimpleQueue and Listener/Client swapped in
  (``others/swap.py``), where the interpreter ships its ``test`` package.
- ``test_concurrent_futures``' process-pool tests with ``mp_context=`` shmtensor's context,
  where the interpreter ships that module (3.10 and 3.12+ upstream; this venv's 3.11 build
  lacks it: skipped with the reason).
- torch's DataLoader with ``multiprocessing_context=`` (in this process, beside the
  stdlib's context in the same test), when torch imports.

Each suite runs in subprocesses (``others/driver.py``): shmtensor's context first, then the
tests that did not pass are run again, alone, with the stdlib's context and shmtensor's.
The baseline is measured live, on this machine and interpreter, for just those tests
(nothing checked in per Python version goes stale): a test fails here when it passes with
the stdlib and fails with shmtensor twice.  Differences on purpose are listed in
``driver.INTENDED``.  The suites run two at a time (``SHMTENSOR_SUITES_JOBS``).

Default run (this module: about 2.5 minutes on 2 cores): CPython's processes flavour in
full under spawn (~70 s), and under fork and forkserver the classes that exercise what
shmtensor replaces (``CHANNELS``, ~15 s each); the misc classes and the process-pool tests
under spawn; the manager flavour under fork (~15 s); every DataLoader case under fork,
the plain one under spawn too.
``SHMTENSOR_FULL_SUITES=1`` runs every suite in full under every start method, DataLoader
cases included: 14 minutes today, 10 of them the manager flavour hanging under spawn and
forkserver (30 s per test, 5 minutes per run, then the hung tests again); about 5 once it
does not, more where test_concurrent_futures exists.
``SHMTENSOR_SUITE_PYTHONS=/path/to/python3.13:...`` adds interpreters (each with shmtensor
installed) for the CPython and concurrent.futures suites.

The stdlib's baseline on the 2-core machines (``python tests/others/driver.py cpython spawn
fork forkserver``, ``--flavours misc``, ``futures``): no test fails with the stdlib's
context.  Skipped with it, the same with shmtensor's: the processes flavour skips 3 tests
under fork and 2 under spawn (forkserver-only, or not for fork), none under forkserver; misc
skips 6/2/5 (fork/spawn/forkserver: Windows-only, start-method-only); the process-pool
tests skip 5/2/2 on 3.13.0 and 4/2/2 on 3.10.13 (a Windows-only limit, gh-83386, tests
"incompatible with the fork start method").
"""

from __future__ import annotations

import concurrent.futures
import faulthandler
import os
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import shmtensor.multiprocessing as smp

from conftest import START_METHODS

sys.path.insert(0, str(Path(__file__).resolve().parent / "others"))
import driver  # noqa: E402

FULL = os.environ.get("SHMTENSOR_FULL_SUITES", "") not in ("", "0")
JOBS = int(os.environ.get("SHMTENSOR_SUITES_JOBS", "2"))
PYTHONS = [sys.executable] + [p for p in os.environ.get("SHMTENSOR_SUITE_PYTHONS", "")
                              .split(os.pathsep) if p]

# the classes of CPython's suite whose objects shmtensor replaces (Process, queues,
# connections, pools); the others (locks, values, shared memory ...) use the stdlib's
# objects beside shmtensor's Process, which spawn's full run covers.  test_many_processes
# starts 100 children: 40 s under forkserver, where each imports shmtensor and numpy.
CHANNELS = (r"\.WithProcessesTest(Process|SubclassingProcess|Queue|Connection|Listener"
            r"|ListenerClient|Poll|PicklingConnections|Pool|PoolWorkerErrors"
            r"|PoolWorkerLifetime)\.(?!test_many_processes)")


def _plan():
    """(name, suite, method, select, flavours) of each suite run this session makes."""
    plan = []
    for method in START_METHODS:
        full = FULL or method == "spawn"
        plan.append(("cpython", "mp_suite", method, None if full else CHANNELS, "processes"))
        if full:
            plan.append(("cpython-misc", "mp_suite", method, None, "misc"))
            plan.append(("futures", "cf_suite", method, None, ""))
        if FULL or method == "fork":
            plan.append(("cpython-manager", "mp_suite", method, None, "manager"))
    return plan


PLAN = _plan()
_ids = [f"{name}-{method}" for name, _, method, _, _ in PLAN]


def _pyid(py: str) -> str:
    return "py" + ("" if py == sys.executable else Path(py).name)


@pytest.fixture(scope="module")
def launched(request):
    """Starts every selected suite run at once, ``JOBS`` at a time; each test waits for
    its own."""
    wanted = {(it.callspec.params["python"], it.callspec.params["run"])
              for it in request.session.items
              if it.module is request.module and "run" in getattr(it, "callspec", {}).params}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=JOBS)
    futures = {}
    for python, run in sorted(wanted, key=lambda k: (PLAN.index(k[1]), k[0])):
        _, suite, method, select, flavours = run
        # a manager that hangs hangs every test: each may take 30 s, the run 5 minutes
        limits = {"hang": 30, "budget": 300} if flavours == "manager" else {}
        futures[python, run] = pool.submit(
            driver.compare, suite, method, python=python, select=select,
            env={"SHMTENSOR_SUITE_FLAVOURS": flavours}, **limits)
    yield futures
    for f in futures.values():
        f.cancel()
    pool.shutdown(wait=True)


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("python", PYTHONS, ids=_pyid)
@pytest.mark.parametrize("run", PLAN, ids=_ids)
def test_suite(run, python, launched):
    name, suite, method, select, flavours = run
    # the runs bound their own time (a hang per test, a budget per run): no tracebacks of
    # this thread waiting for them from pytest's faulthandler_timeout
    faulthandler.cancel_dump_traceback_later()
    verdict = launched[python, run].result()
    title = f"{name} under {method} ({python}{', subset' if select else ''})"
    if verdict.shm.skipped_suite:
        pytest.skip(f"{name}: {verdict.shm.skipped_suite}")
    report = verdict.report(title)
    for tid in verdict.flaky:  # shown in the warnings summary; they do not fail
        warnings.warn(f"{title}: {tid} failed with shmtensor once, passed alone", stacklevel=1)
    if not verdict.shm.outcomes:
        pytest.fail(f"{title}: no test ran")
    if verdict.regressions or verdict.shm.left_behind:
        pytest.fail(report, pytrace=False)
    print(report)  # shown with -rA: what was compared, the flaky and the intended


# ---- torch's DataLoader, with the stdlib's context and shmtensor's in the same test ----

# by default: every case under fork (torch's default on Linux), and the plain one under
# spawn too (the dataset pickled to each worker; ~6 s per loader, as each imports torch)
LOADER_METHODS = START_METHODS if FULL else [m for m in START_METHODS if m == "fork"]
WORKERS_METHODS = START_METHODS if FULL else [m for m in START_METHODS if m != "forkserver"]


def _outcome(fn):
    """What ``fn()`` did, comparable across contexts: ('ok', value) or ('raises', type,
    message with numbers as N)."""
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the outcome is what is compared
        return ("raises", type(exc).__name__, re.sub(r"\d+", "N", str(exc)))


def _both(method, scenario):
    """``scenario(ctx)``'s outcome with the stdlib's context, then with shmtensor's."""
    import multiprocessing
    return (_outcome(lambda: scenario(multiprocessing.get_context(method))),
            _outcome(lambda: scenario(smp.get_context(method))))


def _loader(ctx, dataset, **kw):
    from torch.utils.data import DataLoader
    kw.setdefault("batch_size", 4)
    return DataLoader(dataset, num_workers=kw.pop("num_workers", 2), pin_memory=False,
                      multiprocessing_context=ctx, **kw)


def _batches(loader):
    return [np.asarray(b).tolist() for b in loader]


@pytest.fixture
def dl():
    pytest.importorskip("torch")
    import dataloader_helpers
    return dataloader_helpers


@pytest.mark.parametrize("method", WORKERS_METHODS)
def test_dataloader_workers(method, dl, lc):
    def scenario(ctx):
        tensors = _batches(_loader(ctx, dl.Squares()))
        arrays = _batches(_loader(ctx, dl.Squares(), collate_fn=dl.numpy_collate))
        return tensors, arrays
    stdlib, shm = _both(method, scenario)
    want = [[np.full((3, 5), i * i).tolist() for i in range(b, b + 4)]
            for b in range(0, dl.N, 4)]
    assert stdlib == ("ok", (want, want))
    assert shm == stdlib


@pytest.mark.parametrize("method", LOADER_METHODS)
def test_dataloader_persistent_workers(method, dl, lc):
    def scenario(ctx):
        loader = _loader(ctx, dl.Pids(), batch_size=2, persistent_workers=True,
                         collate_fn=dl.numpy_collate)
        epochs = [[b.tolist() for b in loader] for _ in range(3)]
        items = [[row[0] for batch in e for row in batch] for e in epochs]
        pids = [{row[1] for batch in e for row in batch} for e in epochs]
        del loader
        return items, len(pids[0]), pids[0] == pids[1] == pids[2], os.getpid() in pids[0]
    stdlib, shm = _both(method, scenario)
    assert stdlib == ("ok", ([list(range(8))] * 3, 2, True, False))
    assert shm == stdlib


@pytest.mark.parametrize("how", ["exit", "sigkill"])
@pytest.mark.parametrize("method", LOADER_METHODS)
def test_dataloader_worker_crash(method, how, dl, lc):
    # torch words it as whichever of its checks sees the death first (its SIGCHLD handler
    # or the status poll): either is the stdlib's behaviour
    # numpy batches, so that both sides of the comparison are deterministic: under the
    # stdlib's context a batch of torch tensors from a worker killed right after sending
    # may not be rebuilt (torch's fd sharing needs the sender alive: EOFError).  Under
    # shmtensor's, torch tensors cross in-band; tests/test_torch.py checks the same crash
    # with tensor batches and default collate.
    died = r"DataLoader worker \(pid(\(s\))? N\) (exited unexpectedly|is killed by signal)"
    stdlib, shm = _both(method, lambda ctx: _batches(
        _loader(ctx, dl.DiesAt(9, how), collate_fn=dl.numpy_collate)))
    assert stdlib[:2] == ("raises", "RuntimeError") and re.match(died, stdlib[2]), stdlib
    assert shm[:2] == stdlib[:2] and re.match(died, shm[2]), shm


@pytest.mark.parametrize("method", LOADER_METHODS)
def test_dataloader_timeout(method, dl, lc):
    stdlib, shm = _both(method, lambda ctx: _batches(_loader(ctx, dl.Stalls(5, 3),
                                                             timeout=1)))
    assert stdlib == ("raises", "RuntimeError", "DataLoader timed out after N seconds")
    assert shm == stdlib


@pytest.mark.parametrize("method", LOADER_METHODS)
def test_dataloader_iterable_sharded(method, dl, lc):
    def scenario(ctx):
        rows = [r for b in _batches(_loader(ctx, dl.Shards(), batch_size=3)) for r in b]
        return sorted(rows)
    stdlib, shm = _both(method, scenario)
    assert stdlib == ("ok", [[i, i % 2] for i in range(dl.N)])
    assert shm == stdlib

