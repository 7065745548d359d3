"""The pytest plugin, in a pytester run: off by default, names the leak when asked."""

pytest_plugins = ["pytester"]

LEAKY = """
import os, subprocess, sys
def test_leaks_a_process():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
def test_clean():
    assert True
def test_fixture(shm_leak_checker):
    import shmtensor
    a = shmtensor.zeros(10)
    shm_leak_checker.check_pid(os.getpid())
"""


def test_plugin_inactive_unless_asked(pytester):
    pytester.makepyfile(LEAKY)
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=3)


def test_plugin_fails_the_leaking_test(pytester):
    pytester.makepyfile(LEAKY)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--shmtensor-leak-check",
                                           "--shmtensor-leak-timeout", "0.5")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*shmtensor leak check: 1 leak(s) found:*", "*process pid*"])
    # the leak list is the report: no traceback through the plugin's frames
    assert "pytest_plugin.py" not in result.stdout.str()
    assert "checker.__exit__" not in result.stdout.str()
