"""The package type-checks: ``mypy`` with pyproject.toml's configuration (``--strict``
on every module of ``shmtensor/``, issue 28), as a user's checker sees it through
``py.typed``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_package_passes_mypy_strict(tmp_path):
    pytest.importorskip("mypy", reason="mypy comes with the test extra (pip install -e .[test])")
    # shmtensor/_torch.py is checked against torch's own annotations (and its ignores are
    # for them): without torch installed, mypy finds other errors there
    pytest.importorskip("torch", reason="the torch adapter is type-checked against torch")
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"mypy --strict found errors:\n{run.stdout}{run.stderr}"
    assert "Success: no issues found" in run.stdout


def test_a_user_program_checks_against_the_public_api(tmp_path):
    """A first program of this field, checked strict against the installed annotations:
    a misuse is caught, a correct use passes."""
    pytest.importorskip("mypy", reason="mypy comes with the test extra (pip install -e .[test])")
    good = tmp_path / "good.py"
    good.write_text(
        "import numpy as np\n"
        "import shmtensor\n"
        "import shmtensor.multiprocessing as mp\n\n"
        "def main() -> None:\n"
        "    a = shmtensor.zeros((4, 4), dtype=np.float32)\n"
        "    q = mp.get_context('spawn').Queue()\n"
        "    q.put(a)\n"
        "    shmtensor.empty_cache()\n")
    bad = tmp_path / "bad.py"
    bad.write_text("import shmtensor\n\nshmtensor.zeros((4, 4), order='Z')\n")
    cmd = [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache")]
    env = dict(os.environ, PYTHONPATH=ROOT)
    ok = subprocess.run(cmd + [str(good)], cwd=tmp_path, capture_output=True, text=True,
                        timeout=600, env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    wrong = subprocess.run(cmd + [str(bad)], cwd=tmp_path, capture_output=True, text=True,
                           timeout=600, env=env)
    assert wrong.returncode == 1 and "order" in wrong.stdout, wrong.stdout + wrong.stderr
