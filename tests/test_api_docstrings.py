"""Every public name has a docstring (``help()`` and the Sphinx reference show it), and
the examples in the docstrings of the public API run.

Public names: ``__all__`` of shmtensor, shmtensor.futures, shmtensor.testing,
shmtensor.cuda and shmtensor.ray; shmtensor.multiprocessing's own names (not the stdlib
objects it re-exports); and the public methods and properties those classes define."""

import doctest
import importlib
import inspect
import multiprocessing

import pytest

MODULES = ["shmtensor", "shmtensor.multiprocessing", "shmtensor.futures",
           "shmtensor.testing", "shmtensor.cuda", "shmtensor.ray"]

def public_names() -> list[str]:
    names = []
    for modname in MODULES:
        try:
            module = importlib.import_module(modname)
        except ImportError:  # an extra that is not installed (ray)
            continue
        for name in module.__all__:
            obj = getattr(module, name)
            if modname == "shmtensor.multiprocessing" and getattr(multiprocessing, name,
                                                                  None) is obj:
                continue  # the stdlib's own object, documented there
            names.append(f"{modname}.{name}")
            if inspect.isclass(obj) and obj.__module__.startswith("shmtensor"):
                names += [f"{modname}.{name}.{attr}" for attr, value in vars(obj).items()
                          if not attr.startswith("_")
                          and (inspect.isfunction(value) or isinstance(value, property))]
    return sorted(set(names))


def resolve(path: str) -> object:
    for split in range(len(MODULES[0].split(".")) + 2, 0, -1):
        modname = ".".join(path.split(".")[:split])
        if modname in MODULES:
            obj = importlib.import_module(modname)
            for part in path[len(modname) + 1:].split("."):
                obj = inspect.getattr_static(obj, part) if inspect.isclass(obj) else getattr(
                    obj, part)
            return obj
    raise LookupError(path)


@pytest.mark.parametrize("name", public_names())
def test_public_name_has_a_docstring(name):
    obj = resolve(name)
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    doc = obj.__doc__
    if inspect.isclass(obj):  # a class's own docstring, not one inherited from a base
        doc = vars(obj).get("__doc__")
    assert doc and doc.strip(), f"{name} has no docstring"


# modules whose docstring examples run here (the package's own, by the files that define
# the public API)
DOCTESTED = ["shmtensor", "shmtensor._alloc", "shmtensor._strategy", "shmtensor._batch_pool",
             "shmtensor.multiprocessing", "shmtensor.multiprocessing._context",
             "shmtensor.multiprocessing._spawn", "shmtensor.futures", "shmtensor.testing"]


@pytest.mark.parametrize("modname", DOCTESTED)
def test_docstring_examples_run(modname):
    module = importlib.import_module(modname)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [t for t in finder.find(module, modname) if t.examples]
    for t in tests:
        runner.run(t)
    assert runner.failures == 0, f"{runner.failures} docstring example(s) failed in {modname}"
