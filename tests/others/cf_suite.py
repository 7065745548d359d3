"""``test_concurrent_futures``' process-pool tests as a unittest module.

For the start method in ``$SHMTENSOR_SUITE_METHOD``; every ``ProcessPoolExecutor`` gets
``mp_context=shmtensor's context`` when ``$SHMTENSOR_SUITE_CONTEXT`` is ``shmtensor``.
The suite is one module up to 3.11 upstream and a package from 3.12 on; an interpreter
whose ``test`` package has neither raises ``unittest.SkipTest`` at import.
"""

import importlib
import os
import pkgutil
import unittest

METHOD = os.environ["SHMTENSOR_SUITE_METHOD"]
CONTEXT = os.environ["SHMTENSOR_SUITE_CONTEXT"]

try:
    _pkg = importlib.import_module("test.test_concurrent_futures")
except ImportError as exc:
    raise unittest.SkipTest(f"this interpreter's test package has no "
                            f"test_concurrent_futures ({exc})") from None

if hasattr(_pkg, "__path__"):  # 3.12+: a package
    _util = importlib.import_module("test.test_concurrent_futures.util")
    _modules = [importlib.import_module(f"test.test_concurrent_futures.{m.name}")
                for m in pkgutil.iter_modules(_pkg.__path__) if m.name.startswith("test_")]
else:
    _util = _pkg
    _modules = [_pkg]

if CONTEXT == "shmtensor":
    import swap
    swap.swap_into_executor_mixin(_util.ExecutorMixin)
elif CONTEXT != "stdlib":
    raise ValueError(f"SHMTENSOR_SUITE_CONTEXT={CONTEXT!r}: use 'stdlib' or 'shmtensor'")


def load_tests(loader, standard_tests, pattern):
    """The test classes of the process pool for this start method, nothing else."""
    suite = unittest.TestSuite()
    seen = set()
    for mod in _modules:
        for obj in vars(mod).values():
            if (isinstance(obj, type) and issubclass(obj, unittest.TestCase)
                    and getattr(obj, "ctx", None) == METHOD and obj not in seen):
                seen.add(obj)
                suite.addTests(loader.loadTestsFromTestCase(obj))
    return suite

