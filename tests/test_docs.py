"""Every python block of the README and the user guides runs, as written, as a program of
its own; blocks that need CuPy with a GPU, or Ray, skip where those are missing."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks() -> list:
    out = []
    for doc in DOCS:
        if not doc.exists():
            continue
        for i, m in enumerate(BLOCK.finditer(doc.read_text())):
            line = doc.read_text()[:m.start()].count("\n") + 1
            out.append(pytest.param(m.group(1), id=f"{doc.relative_to(ROOT)}:{line}"))
    return out


def _gpu() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    import shmtensor.cuda
    return shmtensor.cuda.is_available()


def test_every_guide_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    for guide in (ROOT / "docs" / "guide").glob("*.md"):
        assert f"docs/guide/{guide.name}" in readme, f"README does not link {guide.name}"


@pytest.mark.parametrize("code", blocks())
def test_doc_block_runs(code, tmp_path):
    if re.search(r"^import cupy|^from cupy", code, re.M) and not _gpu():
        pytest.skip("needs CuPy and a CUDA device")
    if re.search(r"^import ray|^from ray", code, re.M) and not importlib.util.find_spec("ray"):
        pytest.skip("needs Ray (pip install '.[ray]')")
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMTENSOR_")}
    # under leak-check: it exits 97 when the block's processes leave files or processes
    r = subprocess.run([sys.executable, "-m", "shmtensor", "leak-check", "--", sys.executable,
                        str(script)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=240, env=env)
    assert r.returncode == 0, f"the block failed:\n{code}\n--- output:\n{r.stdout}{r.stderr}"


def test_the_reference_and_guides_build_without_a_warning(tmp_path):
    """Sphinx (autodoc of the public modules, the guides through MyST) with warnings as
    errors: a broken reference, a bad docstring or a guide left out of the index fails."""
    if not (importlib.util.find_spec("sphinx") and importlib.util.find_spec("myst_parser")):
        pytest.skip("needs sphinx and myst-parser (the test extra)")
    r = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                        str(ROOT / "docs"), str(tmp_path / "html")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    api = (tmp_path / "html" / "api.html").read_text()
    for name in ("shmtensor.zeros", "shmtensor.multiprocessing.get_context",
                 "shmtensor.futures.ProcessPoolExecutor", "shmtensor.testing.leak_checker"):
        assert f'id="{name}"' in api, f"{name} is missing from the API reference"
