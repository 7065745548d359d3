"""``_registry.after_import``: the one import hook that adapters (CUDA's event devices,
Ray's CuPy serializer) share.  A lookup runs nothing and keeps the hooks; the import runs
every hook once, before the importer gets the module."""

import json
import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import importlib.util, json, sys
    sys.path.insert(0, sys.argv[1])
    from shmtensor import _registry
    seen = []
    _registry.after_import("fakemod", lambda m: seen.append(("a", m.VALUE)))
    _registry.after_import("fakemod", lambda m: seen.append(("b", m.VALUE)))
    hooks = [type(f).__name__ for f in sys.meta_path].count("_ImportHook")
    looked = importlib.util.find_spec("fakemod") is not None   # a lookup only
    after_lookup = list(seen)
    import fakemod
    first = list(seen)
    _registry.after_import("fakemod", lambda m: seen.append(("late", m.VALUE)))
    print(json.dumps({"hooks": hooks, "looked": looked, "after_lookup": after_lookup,
                      "first": first, "all": seen,
                      "done": "fakemod" not in _registry._on_import,
                      "watched": sorted(_registry._on_import)}))
""")


def test_after_import_runs_each_hook_once_after_the_import(tmp_path):
    (tmp_path / "fakemod.py").write_text("VALUE = 42\n")
    r = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["hooks"] == 1 and out["looked"]
    assert out["after_lookup"] == []
    assert out["first"] == [["a", 42], ["b", 42]]
    assert out["all"] == [["a", 42], ["b", 42], ["late", 42]]  # imported already: at once
    assert out["done"]
    # the finder stays only for what is still watched (CuPy, by shmtensor.cuda)
    assert out["watched"] in ([], ["cupy"])
