"""pytest plugin: ``--shmtensor-leak-check`` fails any test that leaks segments, fds or
processes (naming the leak); the ``shm_leak_checker`` fixture checks a single test.

Registered through the ``pytest11`` entry point and inactive unless asked: it imports
nothing heavy until a test uses it.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pluggy import Result

    from shmtensor.testing import leak_checker


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shmtensor")
    group.addoption("--shmtensor-leak-check", action="store_true", default=False,
                    help="fail every test that leaves shmtensor segments, fds or child "
                         "processes behind")
    group.addoption("--shmtensor-leak-timeout", type=float, default=5.0,
                    help="seconds to wait for asynchronous releases before calling it a leak")


@pytest.fixture
def shm_leak_checker(request: pytest.FixtureRequest) -> Iterator[leak_checker]:
    """A :class:`shmtensor.testing.leak_checker` around this test; ``.check_pid(pid)`` adds
    processes to check."""
    from shmtensor.testing import leak_checker
    with leak_checker(timeout=request.config.getoption("--shmtensor-leak-timeout")) as lc:
        yield lc


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Result[None], None]:
    if not item.config.getoption("--shmtensor-leak-check"):
        yield
        return
    from shmtensor.testing import LeakError, leak_checker
    checker = leak_checker(timeout=item.config.getoption("--shmtensor-leak-timeout"))
    checker.__enter__()
    outcome = yield
    if outcome.excinfo is not None:
        return
    try:
        checker.__exit__(None, None, None)
    except LeakError as e:
        # the leak list is the whole report: the plugin's own frames say nothing useful
        failure = pytest.fail.Exception(f"shmtensor leak check: {e}", pytrace=False)
        if hasattr(outcome, "force_exception"):
            outcome.force_exception(failure)
        else:  # pluggy < 1.4
            raise failure from None
