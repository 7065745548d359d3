"""CPython's ``test._test_multiprocessing``, "processes" flavour, as a unittest module.

Built the way CPython's own ``test_multiprocessing_<method>`` modules build it
(``install_tests_in_module_dict``), for the start method in ``$SHMTENSOR_SUITE_METHOD``,
with shmtensor swapped in when ``$SHMTENSOR_SUITE_CONTEXT`` is ``shmtensor`` (the stdlib's
own objects when it is ``stdlib``).  The variables, not arguments: a spawned or forkserver
child imports this module again to find the test classes, and must build the same ones.
"""

import os
import unittest

import test._test_multiprocessing as _tmp

METHOD = os.environ["SHMTENSOR_SUITE_METHOD"]
CONTEXT = os.environ["SHMTENSOR_SUITE_CONTEXT"]
FLAVOURS = set(os.environ.get("SHMTENSOR_SUITE_FLAVOURS", "processes").split(","))

if CONTEXT == "shmtensor":
    import swap
    swap.swap_into_test_multiprocessing(_tmp)
elif CONTEXT != "stdlib":
    raise ValueError(f"SHMTENSOR_SUITE_CONTEXT={CONTEXT!r}: use 'stdlib' or 'shmtensor'")

# every flavour, then keep the ones asked for (3.10's function has no only_type argument);
# classes that are no flavour's ("misc": TestSimpleQueue, TestStartMethod ...) go as "misc"
_tmp.install_tests_in_module_dict(globals(), METHOD)
for _name, _obj in list(globals().items()):
    if (isinstance(_obj, type) and issubclass(_obj, unittest.TestCase)
            and getattr(_obj, "TYPE", "misc") not in FLAVOURS):
        del globals()[_name]
del _name, _obj
