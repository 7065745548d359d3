"""The package as users get it: an sdist and a wheel built from a copy of this tree, the
wheel installed (not editable) into a fresh venv and used from outside the repository.

Needs pip to reach an index (setuptools and build for the build, numpy, psutil,
cloudpickle and pytest for the venv).  About half a minute; marked slow.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (ROOT / "pyproject.toml").exists(),
                                 reason="needs the source tree (these tests run apart from it)")]
TIMEOUT = 600  # seconds for one pip or build step (downloads on a cold cache)


def sh(*cmd, cwd=None, env=None) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{r.stdout}\n{r.stderr}"
    return r


def source_modules() -> set[str]:
    """Every module of the package in this tree (through the shmtensor/ipc link)."""
    out = set()
    for folder, dirs, files in os.walk(ROOT / "shmtensor", followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                rel = (Path(folder) / name).relative_to(ROOT).with_suffix("")
                out.add(".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts))
    return out


def public(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if not any(p.startswith("_") for p in m.split(".")[1:]))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(sdist, wheel built from the sdist, wheel built from the tree, the venv's python)."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"  # a copy: building writes egg-info and build/ into the tree it builds
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".venv*", ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
        "bench-results", "*.so"))  # built here: the builds below compile their own
    venv = tmp / "venv"
    sh(sys.executable, "-m", "venv", venv)
    py = venv / "bin" / "python"
    quiet = ("-q", "--disable-pip-version-check")
    sh(py, "-m", "pip", "install", *quiet, "build", "pytest")
    sh(py, "-m", "build", "--outdir", tmp / "dist", src)  # sdist, then a wheel from it
    sdist, = (tmp / "dist").glob("*.tar.gz")
    wheel, = (tmp / "dist").glob("*.whl")
    sh(py, "-m", "pip", "wheel", *quiet, "--no-deps", "-w", tmp / "tree-wheel", src)
    tree_wheel, = (tmp / "tree-wheel").glob("*.whl")
    sh(py, "-m", "pip", "install", *quiet, wheel)
    return sdist, wheel, tree_wheel, py


def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {n for n in z.namelist() if ".dist-info/" not in n}


def test_wheels_carry_every_module_and_nothing_outside_shmtensor(built):
    sdist, wheel, tree_wheel, _ = built
    expected = {m.replace(".", "/") + ("/__init__.py" if (ROOT / m.replace(".", "/")).is_dir()
                                       else ".py") for m in source_modules()}
    for w in (wheel, tree_wheel):
        files = wheel_files(w)
        assert expected <= files, f"{w.name} lacks {sorted(expected - files)}"
        assert all(f.startswith("shmtensor/") for f in files), sorted(files)
        assert "shmtensor/ipc/posix_shm.py" in files  # the ipc link, followed
        assert "shmtensor/py.typed" in files  # PEP 561 marker: mypy reads our annotations
        # the C extension, compiled (this machine has a compiler); its source stays out
        assert [f for f in files if f.startswith("shmtensor/ipc/_cring.")
                and f.endswith(".so")], f"{w.name} lacks the compiled shmtensor.ipc._cring"
        assert not [f for f in files if f.endswith(".c")], sorted(files)
    with tarfile.open(sdist) as t:
        members = {m.name.split("/", 1)[1]: m for m in t.getmembers() if "/" in m.name}
    link = members.get("shmtensor/ipc")
    # the sdist may keep shmtensor/ipc as the link (with ipc/ beside it) or as files
    if link is not None and link.issym():
        assert {"ipc/posix_shm.py", "ipc/_cring.c"} <= set(members)
    else:
        assert {"shmtensor/ipc/posix_shm.py", "shmtensor/ipc/_cring.c"} <= set(members)
    assert "setup.py" in members  # declares the extension
    assert not [n for n in members if n.endswith(".so")]
    # the whole suite, helpers included, the README's examples and the license
    tracked = {str(p.relative_to(ROOT)) for d in ("tests", "examples")
               for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts}
    assert tracked <= set(members), sorted(tracked - set(members))
    assert "LICENSE" in members
    assert not [n for n in members if "__pycache__" in n or n.endswith(".pyc")]


def test_installed_wheel_imports_every_public_module(built, tmp_path):
    *_, py = built
    modules = public(source_modules())
    assert {"shmtensor", "shmtensor.multiprocessing", "shmtensor.cuda", "shmtensor.testing",
            "shmtensor.ipc"} <= set(modules)
    script = textwrap.dedent(f"""
        import importlib, importlib.metadata as md, importlib.util, sys
        for name in {modules!r}:
            module = importlib.import_module(name)
            assert "site-packages" in module.__file__, (name, module.__file__)
        assert importlib.util.find_spec("ipc") is None, "a top-level ipc is installed"
        import shmtensor
        assert md.version("shmtensor") == shmtensor.__version__, md.version("shmtensor")
        files = [str(f) for f in md.files("shmtensor")]
        stray = [f for f in files if not f.startswith(("shmtensor/", "shmtensor-", "../"))]
        assert not stray, stray
        print("ok", len({modules!r}))
    """)
    r = sh(py, "-I", "-c", script, cwd=tmp_path)
    assert r.stdout.strip() == f"ok {len(modules)}"


RING_CHECK = """
from shmtensor.ipc import ring
r = ring.Ring.create(4)
r.put(b"through")
assert r.get() == b"through"
r.close()
print("c" if ring._cput is not None else "python", ring.__file__)
"""


def test_installed_wheel_uses_the_c_extension_unless_told_not_to(built, tmp_path):
    """The installed ring runs on the compiled extension; SHMTENSOR_PURE_PYTHON=1 makes it
    ignore it and run on the Python path."""
    *_, py = built
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPATH" and not k.startswith("SHMTENSOR_")}
    for pure, kind in (("", "c"), ("1", "python")):
        r = sh(py, "-I", "-c", RING_CHECK, cwd=tmp_path,
               env={**env, "SHMTENSOR_PURE_PYTHON": pure})
        assert r.stdout.split()[0] == kind and "site-packages" in r.stdout, (pure, r.stdout)


def test_sdist_without_a_compiler_installs_the_pure_python_package(built, tmp_path):
    """A build from the sdist where the C compiler fails (CC=false) still makes a wheel:
    the package without the extension, whose ring runs on the Python path."""
    sdist, *_, py = built
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMTENSOR_")}
    env["CC"] = "false"
    sh(py, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps", "-w",
       tmp_path / "wheel", sdist, env=env)
    wheel, = (tmp_path / "wheel").glob("*.whl")
    files = wheel_files(wheel)
    assert "shmtensor/ipc/ring.py" in files
    assert not [f for f in files if "_cring" in f], sorted(files)
    target = tmp_path / "target"  # the wheel's files, ahead of the venv's installed copy
    sh(py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
       "--target", target, wheel)
    env.pop("CC")
    r = sh(py, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r}); "
           + RING_CHECK, cwd=tmp_path, env=env)
    assert r.stdout.split() == ["python", str(target / "shmtensor/ipc/ring.py")], r.stdout


def test_installed_console_script_and_pytest_plugin(built, tmp_path):
    *_, py = built
    bindir = py.parent
    r = sh(bindir / "shmtensor", "ls", cwd=tmp_path)
    assert "segment" in r.stdout
    (tmp_path / "test_uses_plugin.py").write_text(textwrap.dedent("""
        def test_fixture(shm_leak_checker):
            import shmtensor
            a = shmtensor.zeros(10)
            del a
    """))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = sh(py, "-m", "pytest", "-p", "no:cacheprovider", "--help", cwd=tmp_path, env=env)
    assert "--shmtensor-leak-check" in r.stdout
    r = sh(py, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--shmtensor-leak-check",
           "test_uses_plugin.py", cwd=tmp_path, env=env)
    assert "1 passed" in r.stdout


QUEUE = """
import sys
import numpy as np
import shmtensor
import shmtensor.multiprocessing as mp

def child(q, out):
    big, shared = q.get(), q.get()
    shared *= 2                      # the parent sees it: the same memory
    out.put(float(big.sum()))

if __name__ == "__main__":
    assert "site-packages" in shmtensor.__file__, shmtensor.__file__
    for method in mp.get_all_start_methods():
        ctx = mp.get_context(method)
        q, out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=child, args=(q, out))
        p.start()
        shared = shmtensor.ones(1000)
        q.put(np.arange(100_000.0))  # over the inline threshold: through a segment
        q.put(shared)
        total = out.get(timeout=60)
        p.join(60)
        assert p.exitcode == 0, (method, p.exitcode)
        assert total == 100_000 * 99_999 / 2 and (shared == 2).all(), method
        print(method, "ok")
"""


def test_installed_wheel_sends_arrays_between_processes(built, tmp_path):
    *_, py = built
    (tmp_path / "queue_check.py").write_text(QUEUE)
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPATH" and not k.startswith("SHMTENSOR_")}
    r = sh(py, "-I", "queue_check.py", cwd=tmp_path, env=env)
    assert "spawn ok" in r.stdout and "fork ok" in r.stdout, r.stdout


def readme_install_commands() -> list[str]:
    """The commands of the README's Install section, comments stripped."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Install", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines()
            if line.split("#", 1)[0].strip()]


def test_readme_install_commands_work(built, tmp_path):
    """Every command of the README's Install section, run as written from a copy of the
    tree in a fresh venv: `pip install .` for real, the extras resolved (`--dry-run`: CuPy
    and Ray are large downloads that a machine without a GPU cannot use), the build."""
    *_, py = built
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".venv*", ".git", "build", "dist", "*.egg-info", "__pycache__", "bench-results",
        "*.so"))
    venv = tmp_path / "venv"
    sh(py, "-m", "venv", venv)
    pip = [venv / "bin" / "python", "-m", "pip", "--disable-pip-version-check"]
    commands = readme_install_commands()
    assert "pip install ." in commands and "python -m build" in commands, commands
    for command in commands:
        words = command.replace("'", "").split()
        if words[:2] == ["pip", "install"]:
            extra = "[" in words[2]  # `pip install .[x]`: resolved, not downloaded
            sh(*pip, "install", "-q", *(["--dry-run"] if extra else []), *words[2:], cwd=src)
        elif words[:3] == ["python", "-m", "build"]:
            sh(venv / "bin" / "python", "-m", "build", *words[3:], cwd=src)
            assert list((src / "dist").glob("shmtensor-*.whl"))
        else:
            raise AssertionError(f"the README's Install section has a command this test "
                                 f"does not know how to try: {command!r}")
    r = sh(venv / "bin" / "python", "-I", "-c",
           "import shmtensor, shmtensor.multiprocessing; print(shmtensor.zeros(3).sum())",
           cwd=tmp_path)
    assert r.stdout.strip() == "0.0"
