"""Settings are checked where they are given: environment variables when shmtensor is
imported (a bad one raised by the first call that needs a setting), setters when called,
constructors' arguments; each error names what is accepted."""

import os
import subprocess
import sys

import numpy as np
import pytest

import shmtensor
from shmtensor import _strategy


def import_with(**env) -> subprocess.CompletedProcess:
    """``import shmtensor`` in a fresh interpreter with these environment variables; prints
    the strategy and the threshold it ended up with."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("SHMTENSOR_")}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", "import shmtensor as s; print(s.get_sharing_strategy(), "
                               "s.get_inline_threshold(), s.get_receive_spin())"],
        env=full, capture_output=True, text=True, timeout=60)


def last_line(r: subprocess.CompletedProcess) -> str:
    return r.stderr.strip().splitlines()[-1]


def test_bogus_sharing_strategy_is_refused_naming_the_choices():
    r = import_with(SHMTENSOR_SHARING_STRATEGY="bogus")
    assert r.returncode != 0
    line = last_line(r)
    assert line.startswith("ValueError: SHMTENSOR_SHARING_STRATEGY='bogus'")
    for name in shmtensor.get_all_sharing_strategies():
        assert name in line


@pytest.mark.parametrize("strategy", sorted(_strategy._ALL))
def test_valid_sharing_strategy_from_the_environment(strategy):
    r = import_with(SHMTENSOR_SHARING_STRATEGY=strategy)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == strategy


def test_empty_variables_count_as_unset():
    r = import_with(SHMTENSOR_SHARING_STRATEGY="", SHMTENSOR_INLINE_THRESHOLD="",
                    SHMTENSOR_RECEIVE_SPIN_US="")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [sorted(_strategy._ALL)[0],
                                str(_strategy.DEFAULT_INLINE_THRESHOLD),
                                str(_strategy.DEFAULT_RECEIVE_SPIN_US)]


@pytest.mark.parametrize("value, nbytes", [("81920", 81920), ("80k", 80 << 10),
                                           ("80K", 80 << 10), ("80KiB", 80 << 10),
                                           ("1M", 1 << 20), ("2mib", 2 << 20),
                                           ("1G", 1 << 30), ("0", 0), (" 12 ", 12)])
def test_inline_threshold_from_the_environment_takes_binary_suffixes(value, nbytes):
    r = import_with(SHMTENSOR_INLINE_THRESHOLD=value)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[1]) == nbytes


@pytest.mark.parametrize("value", ["-5", "80KB", "80kB", "1.5M", "lots", "0x100", "80 k b"])
def test_bad_inline_threshold_is_refused_naming_the_forms(value):
    r = import_with(SHMTENSOR_INLINE_THRESHOLD=value)
    assert r.returncode != 0
    line = last_line(r)
    assert line.startswith("ValueError: SHMTENSOR_INLINE_THRESHOLD="), r.stderr
    assert "80k" in line and "1024" in line  # the accepted forms, and what k means


def test_huge_inline_threshold_from_the_environment_is_refused():
    r = import_with(SHMTENSOR_INLINE_THRESHOLD=str(2 ** 70))
    assert r.returncode != 0
    assert "out of range" in last_line(r) and "2**48" in last_line(r)


def run_with(code: str, *args: str, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SHMTENSOR_")}
    full.update(env)
    return subprocess.run([sys.executable, *(("-c", code) if code else ()), *args], env=full,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("var, value, refused", [
    ("SHMTENSOR_INLINE_THRESHOLD", "80KB", {"threshold"}),
    ("SHMTENSOR_SHARING_STRATEGY", "bogus", {"strategy", "zeros"}),
    ("SHMTENSOR_RECEIVE_SPIN_US", "abc", {"spin", "queue"})])
def test_a_bad_variable_fails_only_the_calls_that_use_its_setting(var, value, refused):
    # pytest loads the plugin (and so the package) in every run of an environment where
    # shmtensor is installed: a typo in one variable must not break unrelated test runs
    r = run_with("import shmtensor, shmtensor.cli, shmtensor.pytest_plugin; print('ok')",
                 **{var: value})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    r = run_with("", "-m", "shmtensor", "ls", **{var: value})
    assert r.returncode == 0, r.stderr
    # a call that needs the setting says what is wrong, until the program sets it; the
    # calls that do not need it work
    code = ("import shmtensor, shmtensor.multiprocessing as smp\n"
            "calls = {'threshold': shmtensor.get_inline_threshold,\n"
            "         'strategy': shmtensor.get_sharing_strategy,\n"
            "         'spin': shmtensor.get_receive_spin,\n"
            "         'queue': smp.Queue, 'zeros': lambda: shmtensor.zeros(10),\n"
            "         'info': shmtensor.debug_info}\n"
            "for name, call in calls.items():\n"
            "    try:\n"
            "        call()\n"
            "    except ValueError as e:\n"
            "        print('refused', name, e)\n"
            "shmtensor.set_sharing_strategy('file_system')\n"
            "shmtensor.set_inline_threshold(1000)\n"
            "shmtensor.set_receive_spin(0)\n"
            "q = smp.Queue()\n"
            "q.put(shmtensor.full((3,), 2.0))\n"
            "print(float(q.get().sum()))\n")
    r = run_with(code, **{var: value})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == "6.0", r.stdout
    assert {line.split()[1] for line in lines[:-1]} == refused, r.stdout
    for line in lines[:-1]:
        assert line.split(" ", 2)[2].startswith(f"{var}={value!r}"), line


def test_receive_spin_is_on_by_default_only_with_two_cpus_or_more():
    assert _strategy.DEFAULT_RECEIVE_SPIN_US == (100 if len(os.sched_getaffinity(0)) >= 2
                                                 else 0)


@pytest.mark.parametrize("value, us", [("0", 0), ("250", 250), (" 7 ", 7), ("10000", 10000)])
def test_receive_spin_from_the_environment(value, us):
    r = import_with(SHMTENSOR_RECEIVE_SPIN_US=value)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[2]) == us


@pytest.mark.parametrize("value, says", [("-5", "not a number of microseconds"),
                                         ("100us", "not a number of microseconds"),
                                         ("0.5", "not a number of microseconds"),
                                         ("\u00b2", "not a number of microseconds"),
                                         ("10001", "out of range")])
def test_bad_receive_spin_is_refused_naming_the_forms(value, says):
    r = import_with(SHMTENSOR_RECEIVE_SPIN_US=value)
    assert r.returncode != 0
    line = last_line(r)
    assert line.startswith("ValueError: SHMTENSOR_RECEIVE_SPIN_US="), r.stderr
    assert says in line and "10000" in line


@pytest.fixture
def spin():
    prev = shmtensor.get_receive_spin()
    yield
    shmtensor.set_receive_spin(prev)


@pytest.mark.parametrize("bad, error", [(True, TypeError), (1.5, TypeError), ("100", TypeError),
                                        (-1, ValueError), (10_001, ValueError)])
def test_set_receive_spin_checks_its_argument(spin, bad, error):
    prev = shmtensor.get_receive_spin()
    with pytest.raises(error, match="microseconds"):
        shmtensor.set_receive_spin(bad)
    assert shmtensor.get_receive_spin() == prev


def test_set_receive_spin_applies_to_channels_opened_after(spin):
    from shmtensor import multiprocessing as smp
    shmtensor.set_receive_spin(0)
    before = smp.Queue()
    shmtensor.set_receive_spin(np.int64(250))
    after = smp.Queue()
    try:
        assert before._reader._wait is None
        assert after._reader._wait.budget == pytest.approx(250e-6)
        assert shmtensor.get_receive_spin() == 250 and type(shmtensor.get_receive_spin()) is int
    finally:
        for q in (before, after):
            q.close()
            q.join_thread()


@pytest.fixture
def threshold():
    prev = shmtensor.get_inline_threshold()
    yield
    shmtensor.set_inline_threshold(prev)


@pytest.mark.parametrize("bad", [True, False])
def test_set_inline_threshold_refuses_a_bool(threshold, bad):
    with pytest.raises(TypeError, match="not a bool"):
        shmtensor.set_inline_threshold(bad)


@pytest.mark.parametrize("bad", [2 ** 70, 2 ** 48 + 1, -1])
def test_set_inline_threshold_refuses_out_of_range(threshold, bad):
    with pytest.raises(ValueError, match=r"non-negative number of bytes.*2\*\*48"):
        shmtensor.set_inline_threshold(bad)


@pytest.mark.parametrize("bad", [1.5, "80k", None])
def test_set_inline_threshold_refuses_non_ints(threshold, bad):
    with pytest.raises(TypeError, match="int number of bytes"):
        shmtensor.set_inline_threshold(bad)


def test_set_inline_threshold_takes_any_integer_up_to_the_cap(threshold):
    for ok in (0, np.int64(4096), 2 ** 48):
        shmtensor.set_inline_threshold(ok)
        assert shmtensor.get_inline_threshold() == ok and type(
            shmtensor.get_inline_threshold()) is int


@pytest.mark.parametrize("bad", ["bogus", None, 1, "FILE_SYSTEM"])
def test_set_sharing_strategy_names_the_choices(bad):
    prev = shmtensor.get_sharing_strategy()
    with pytest.raises(ValueError, match="file_system"):
        shmtensor.set_sharing_strategy(bad)
    assert shmtensor.get_sharing_strategy() == prev


def test_batch_pool_refuses_object_dtypes():
    with pytest.raises(TypeError, match="Python objects"):
        shmtensor.BatchPool((10,), object)
    with pytest.raises(TypeError, match="Python objects"):
        shmtensor.BatchPool((10,), [("a", "f8"), ("b", "O")])


@pytest.mark.parametrize("slots, error", [(0, ValueError), (True, TypeError),
                                          (2.0, TypeError), ("3", TypeError)])
def test_batch_pool_checks_slots(slots, error):
    with pytest.raises(error, match="slot"):
        shmtensor.BatchPool((10,), np.float32, slots=slots)


def test_batch_pool_checks_order():
    with pytest.raises(ValueError, match="'C' or 'F'"):
        shmtensor.BatchPool((10,), np.float32, order="K")


def test_sizes_are_shown_in_binary_units():
    from shmtensor.cli import _size
    from shmtensor.ipc.posix_shm import _mb
    assert _size(512) == "512 B" and _size(8192) == "8.0 KiB"
    assert _size(3 << 20) == "3.0 MiB" and _size(5 << 30) == "5.0 GiB"
    assert _mb(3 << 20) == "3 MiB" and _mb(1536) == "1.5 KiB"
