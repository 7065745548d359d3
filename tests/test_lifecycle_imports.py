"""A spawned worker that never sees an array or a lambda imports neither numpy nor
cloudpickle, as a stdlib worker does not; the first array or lambda imports them."""

import subprocess
import sys
import textwrap

import pytest

from conftest import START_METHODS

# The main module imports only shmtensor.multiprocessing, so a spawned child imports only
# what shmtensor itself needs.
PROGRAM = textwrap.dedent("""
    import sys
    import shmtensor.multiprocessing as smp

    HEAVY = ("numpy", "cloudpickle")


    def heavy():
        return [m for m in HEAVY if m in sys.modules]


    def child(inq, outq):
        outq.put(heavy())           # trivial work first
        a = inq.get(timeout=60)     # then an array: the same memory as the parent's
        a += 1
        outq.put(a[:4] * 2)         # an array back (inline)
        outq.put(heavy())


    def task(x):
        return x + 1, heavy()


    if __name__ == "__main__":
        ctx = smp.get_context(sys.argv[1])
        inq, outq = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=child, args=(inq, outq), daemon=True)
        p.start()
        assert outq.get(timeout=60) == [], "imported by a child that did trivial work"
        import numpy as np
        import shmtensor
        shared = shmtensor.zeros(100_000)
        inq.put(shared)
        assert (outq.get(timeout=60) == 2).all() and (shared == 1).all()
        assert outq.get(timeout=60) == ["numpy"]
        p.join(60)
        assert p.exitcode == 0, p.exitcode
        with ctx.Pool(1) as pool:
            assert pool.apply(task, (1,)) == (2, [])
            assert pool.apply(lambda: heavy()) == ["cloudpickle"]  # by value
            assert (pool.apply(np.negative, (shared,)) == -1).all()
        print("ok")
""")


@pytest.mark.parametrize("method", [m for m in START_METHODS if m != "fork"])
def test_a_spawned_worker_imports_numpy_and_cloudpickle_only_when_used(method, tmp_path):
    (tmp_path / "prog.py").write_text(PROGRAM)
    r = subprocess.run([sys.executable, str(tmp_path / "prog.py"), method], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ok"], r.stdout


@pytest.mark.parametrize("first", ["shmtensor._channel", "shmtensor.cuda._ipc",
                                   "shmtensor.multiprocessing", "shmtensor"])
def test_numpy_imported_first_then_any_module_of_ours_installs_the_numpy_adapter(first):
    # numpy imported before shmtensor installs its adapter at once, in the middle of
    # whichever of our modules is imported first (CuPy imports numpy; shmtensor's CUDA
    # adapter reaches the channel): nothing of that module is looked up before it is whole
    code = textwrap.dedent(f"""
        import numpy
        import {first}
        import shmtensor, shmtensor.multiprocessing as smp
        q = smp.get_context("spawn").SimpleQueue()
        q.put(shmtensor.full(4, 3.0))
        b = q.get()
        print(shmtensor.is_shared(b), float(b.sum()))
        q.close()
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "12.0"], r.stdout
    assert "failed and is disabled" not in r.stderr, r.stderr
