"""``__main__`` objects cross by reference as with the stdlib; cloudpickle only as a fallback.

Each case is a small script run as ``__main__`` in a subprocess, under spawn, fork and
forkserver.  A differential case runs the same function with the stdlib's context and with
shmtensor's in one script and prints both results as JSON: they must agree (and be what the
stdlib documents).  The by-value cases (lambdas, closures, ``python -c``) have no stdlib
result to compare with: there the stdlib fails, and shmtensor must work.
"""

import json
import multiprocessing
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp

from conftest import JOIN, START_METHODS

SCRIPT_TIMEOUT = 180  # seconds for one script (both contexts): only reached on a hang

# Runs ``run(ctx)`` with each context; a result or the exception's type and message.
PRELUDE = """\
import json, multiprocessing, sys
import shmtensor.multiprocessing as smp

def _outcome(run, ctx):
    try:
        return run(ctx)
    except Exception as e:
        return ["raised", type(e).__name__, str(e)[:300]]

def _report(run, contexts=("stdlib", "shmtensor")):
    method = sys.argv[1]
    make = {"stdlib": multiprocessing.get_context, "shmtensor": smp.get_context}
    print(json.dumps({name: _outcome(run, make[name](method)) for name in contexts}))
"""

MAIN = """
if __name__ == "__main__":
    _report(run{args})
"""


def run_script(tmp_path, body: str, method: str, main_args: str = "", *, as_c=False,
               as_package=False) -> dict:
    """Run ``body`` (after the prelude) as ``__main__``: from a file, with ``python -c``
    (no main file) or as ``python -m pkg`` (``pkg/__main__.py``); the parsed JSON line it
    prints."""
    source = PRELUDE + textwrap.dedent(body)
    if as_c:
        source += f"\n_report(run{main_args})\n"
        cmd = [sys.executable, "-c", source, method]
    elif as_package:
        (tmp_path / "mainpkg").mkdir()
        (tmp_path / "mainpkg" / "__init__.py").write_text("")
        (tmp_path / "mainpkg" / "__main__.py").write_text(source + MAIN.format(args=main_args))
        cmd = [sys.executable, "-m", "mainpkg", method]
    else:
        source += MAIN.format(args=main_args)
        path = tmp_path / "main_case.py"
        path.write_text(source)
        cmd = [sys.executable, str(path), method]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT,
                          cwd=tmp_path)
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


POOL_GLOBAL = """
G = None

def init(value):
    global G
    G = value

def f(x):
    return G + x

def run(ctx):
    pool = ctx.Pool(2, initializer=init, initargs=(10,))
    try:
        return pool.map(f, [0, 1])
    finally:
        pool.close()
        pool.join()
"""


@pytest.mark.parametrize("method", START_METHODS)
def test_pool_initializer_sets_main_global(tmp_path, method, lc):
    out = run_script(tmp_path, POOL_GLOBAL, method)
    assert out["stdlib"] == [10, 11]
    assert out["shmtensor"] == out["stdlib"]


@pytest.mark.skipif("fork" not in START_METHODS, reason="needs the fork start method")
def test_python_m_package_main_goes_by_reference(tmp_path, lc):
    """``python -m pkg``: a main file the stdlib's spawn does not import; under fork its
    objects are the child's own, as with the stdlib (under spawn both fail alike)."""
    out = run_script(tmp_path, POOL_GLOBAL, "fork", as_package=True)
    assert out["stdlib"] == [10, 11]
    assert out["shmtensor"] == out["stdlib"]


IDENTITY = """
import dataclasses, enum

class Color(enum.Enum):
    RED = 1
    BLUE = 2

@dataclasses.dataclass
class Point:
    x: int
    y: int

def child(inq, outq):
    color, point = inq.get(timeout=60)
    outq.put([color is Color.RED, isinstance(point, Point), Color.BLUE, Point(3, 4)])

def run(ctx):
    q = ctx.Queue()
    q.put(Color.RED)
    here = q.get(timeout=60) is Color.RED
    inq, outq = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(inq, outq))
    p.start()
    inq.put((Color.RED, Point(1, 2)))
    red, is_point, blue, point = outq.get(timeout=60)
    p.join(60)
    return {"here": here, "child enum": red, "child isinstance": is_point,
            "back enum": blue is Color.BLUE, "back isinstance": isinstance(point, Point),
            "back eq": point == Point(3, 4), "exitcode": p.exitcode}
"""


@pytest.mark.parametrize("method", START_METHODS)
def test_enum_identity_and_dataclass_isinstance(tmp_path, method, lc):
    out = run_script(tmp_path, IDENTITY, method)
    assert out["stdlib"] == {"here": True, "child enum": True, "child isinstance": True,
                             "back enum": True, "back isinstance": True, "back eq": True,
                             "exitcode": 0}
    assert out["shmtensor"] == out["stdlib"]


EXCEPTION = """
class AppError(Exception):
    pass

def boom(x):
    raise AppError(f"bad {x}")

def child(q):
    try:
        boom(5)
    except AppError as e:
        q.put(e)

def run(ctx):
    got = []
    pool = ctx.Pool(1)
    try:
        pool.apply(boom, (3,))
    except AppError as e:
        got.append(["AppError", str(e)])
    except Exception as e:
        got.append(["other", type(e).__module__, type(e).__name__, str(e)])
    finally:
        pool.close()
        pool.join()
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    e = q.get(timeout=60)
    p.join(60)
    got.append([type(e) is AppError, str(e), p.exitcode])
    return got
"""


@pytest.mark.parametrize("method", START_METHODS)
def test_main_exception_arrives_as_its_class(tmp_path, method, lc):
    out = run_script(tmp_path, EXCEPTION, method)
    assert out["stdlib"] == [["AppError", "bad 3"], [True, "bad 5", 0]]
    assert out["shmtensor"] == out["stdlib"]


DATALOADER = """
import threading
import numpy as np
from torch.utils.data import DataLoader, Dataset

LOCK = threading.Lock()  # a module-level lock: fine by reference, unpicklable by value

class Squares(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        with LOCK:
            return np.full(2, i * i)

def run(ctx):
    loader = DataLoader(Squares(), batch_size=4, num_workers=2, multiprocessing_context=ctx)
    return [batch.tolist() for batch in loader]
"""


@pytest.mark.parametrize("method", START_METHODS)
def test_dataloader_with_main_dataset_and_module_lock(tmp_path, method, lc):
    pytest.importorskip("torch")
    out = run_script(tmp_path, DATALOADER, method)
    assert out["stdlib"] == [[[0, 0], [1, 1], [4, 4], [9, 9]],
                             [[16, 16], [25, 25], [36, 36], [49, 49]]]
    assert out["shmtensor"] == out["stdlib"]


BY_VALUE = """
import enum

G = None

class Color(enum.Enum):
    RED = 1

def init(value):
    global G
    G = value

def f(x):
    return G + x

def make_closure(k):
    def times(x):
        return x * k
    return times

def run(ctx):
    k = 3
    pool = ctx.Pool(2, initializer=init, initargs=(10,))
    try:
        out = {
            "lambda": pool.map(lambda x: x + k, range(3)),
            "closure": pool.map(make_closure(k), range(3)),
            # by value, but what it names in __main__ goes by reference: the worker's f
            "lambda calls f": pool.map(lambda x: f(x), [1]),
            "lambda returns enum": pool.apply(lambda: Color.RED) is Color.RED,
        }
    finally:
        pool.close()
        pool.join()
    q = ctx.Queue()
    p = ctx.Process(target=lambda: q.put(k * 2))
    p.start()
    out["process lambda"] = q.get(timeout=60)
    p.join(60)
    out["exitcode"] = p.exitcode
    return out
"""


@pytest.mark.parametrize("method", START_METHODS)
def test_lambdas_and_closures_go_by_value(tmp_path, method, lc):
    out = run_script(tmp_path, BY_VALUE, method)
    assert out["shmtensor"] == {"lambda": [3, 4, 5], "closure": [0, 3, 6],
                                "lambda calls f": [11], "lambda returns enum": True,
                                "process lambda": 6, "exitcode": 0}
    assert out["stdlib"][0] == "raised"  # the stdlib cannot pickle a lambda at all


NO_MAIN_FILE = """
import multiprocessing as _mp

def double(x):
    return 2 * x

def put_double(q, conn, x):
    conn.send(x)
    q.put(double(x))

def run(ctx):
    out = {}
    pool = ctx.Pool(2)
    try:
        out["map"] = pool.map(double, range(3))
        out["lambda"] = pool.map(lambda x: double(x) + 1, range(3))
    finally:
        pool.close()
        pool.join()
    q = ctx.Queue()
    here, there = _mp.Pipe()  # a stdlib Connection: its fd goes to the child with DupFd
    p = ctx.Process(target=put_double, args=(q, there, 21))
    p.start()
    out["process"] = [q.get(timeout=60), here.recv()]
    p.join(60)
    out["exitcode"] = p.exitcode
    return out
"""


@pytest.mark.parametrize("method", START_METHODS)
def test_main_without_file_goes_by_value(tmp_path, method, lc):
    """``python -c``: a spawned child cannot import ``__main__``, so its functions travel
    by value, as before (under spawn and forkserver the stdlib fails here)."""
    out = run_script(tmp_path, NO_MAIN_FILE, method, ', ("shmtensor",)', as_c=True)
    assert out["shmtensor"] == {"map": [0, 2, 4], "lambda": [1, 3, 5], "process": [42, 21],
                                "exitcode": 0}


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("cannot pickle '_Unpicklable' object")


@pytest.mark.parametrize("method", [m for m in ("spawn", "forkserver") if m in START_METHODS])
def test_process_fallback_passes_each_fd_once(method, lc):
    """A spawned Process whose arguments hold a stdlib Connection (its fd is registered with
    the child as it is pickled), a shared array, then a lambda: the first try fails after
    registering the fd, the by-value try registers it again; the child must get each fd
    once, and the array must be the parent's memory."""
    ctx = smp.get_context(method)
    here, there = multiprocessing.Pipe()
    shared = shmtensor.zeros(4, dtype=np.int64)
    try:
        p = ctx.Process(target=_fill_and_send, args=(there, shared, lambda: 42))
        p.start()
        assert here.poll(JOIN)
        assert here.recv() == 42
        p.join(JOIN)
        assert p.exitcode == 0
        assert shared.tolist() == [42] * 4
    finally:
        here.close()
        there.close()


def _fill_and_send(conn, arr, fn):
    arr[:] = fn()
    conn.send(fn())


@pytest.mark.parametrize("method", START_METHODS)
def test_fallback_after_a_large_array_was_copied(method, lc):
    """The first try copies a large array into a segment, then fails on a lambda; the
    by-value try copies it again: the array arrives whole and nothing is left behind."""
    ctx = smp.get_context(method)
    q = ctx.Queue()
    try:
        big = np.arange(1 << 18, dtype=np.float64)
        q.put([big, lambda: 7, big[1:3]])
        arr, fn, view = q.get(timeout=JOIN)
        assert fn() == 7 and np.array_equal(arr, big) and view.tolist() == [1.0, 2.0]
        del arr, view
    finally:
        q.close()
        q.join_thread()


def test_unpicklable_raises_the_stdlib_error(lc):
    """When neither by reference nor by value works, the error is the stdlib's."""
    import threading
    q = smp.get_context("spawn").SimpleQueue()
    try:
        with pytest.raises(TypeError, match="cannot pickle '_thread.lock' object"):
            q.put(threading.Lock())
        with pytest.raises(TypeError, match="_Unpicklable"):
            q.put([1, _Unpicklable()])
    finally:
        q.close()
