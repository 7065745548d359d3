"""Adapters are installed in isolation: one whose registration fails (a module named ``cupy``
that is not CuPy, a broken install) is reported once and disabled; numpy keeps working."""

import logging
import os
import subprocess
import sys
import textwrap
import types

import pytest

from shmtensor import _registry

# Puts numpy arrays (inline and through shared memory) through a Queue to a child and back,
# with a fake ``cupy`` and a fake ``torch`` imported, before and after shmtensor.
PROGRAM = textwrap.dedent("""
    import sys
    if sys.argv[1] == "before":
        import cupy, torch
    import numpy as np
    import shmtensor.multiprocessing as smp
    import cupy, torch

    def echo(inq, outq):
        for _ in range(4):
            outq.put(inq.get(timeout=60))

    if __name__ == "__main__":
        ctx = smp.get_context("spawn")
        inq, outq = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=echo, args=(inq, outq))
        p.start()
        for n in (10, 1 << 16, 10, 1 << 16):
            inq.put(np.arange(n))
            got = outq.get(timeout=60)
            assert (got == np.arange(n)).all(), n
        p.join(60)
        assert p.exitcode == 0, p.exitcode
        print("ok")
""")


@pytest.fixture
def fakes(tmp_path):
    for name in ("cupy", "torch"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"# a package named {name} that is not\n")
    (tmp_path / "prog.py").write_text(PROGRAM)
    return tmp_path


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_fake_cupy_and_torch_leave_numpy_working(fakes, when):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fakes)] + sys.path))
    r = subprocess.run([sys.executable, str(fakes / "prog.py"), when], env=env, cwd=fakes,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ok"], r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    for name, installer in (("cupy", "shmtensor.cuda._install_cupy"),
                            ("torch", "shmtensor._torch._install")):
        # once in each process that pickled: the parent, and the child it sent back from
        lines = [ln for ln in r.stderr.splitlines() if f"adapter for {name} ({installer})" in ln]
        assert len(lines) == 2, r.stderr
        assert "failed and is disabled" in lines[0]
        assert str(fakes / name / "__init__.py") in lines[0]


def test_a_failing_installer_is_taken_back_and_reported_once(caplog, monkeypatch):
    module = types.ModuleType("shmtensor_test_fake_lib")
    monkeypatch.setitem(sys.modules, module.__name__, module)

    class Thing:
        pass

    def install():
        _registry.register(Thing, lambda obj: (Thing, ()))
        raise ImportError("half installed")

    with caplog.at_level(logging.WARNING, logger="shmtensor"):
        _registry.register_lazy(module.__name__, install)  # imported: installs at once
        _registry.install_pending()
    reducers, _ = _registry.tables()
    assert Thing not in reducers
    records = [r for r in caplog.records if module.__name__ in r.getMessage()]
    assert len(records) == 1
    assert "ImportError: half installed" in records[0].getMessage()
    assert records[0].name == "shmtensor" and records[0].levelno == logging.WARNING
