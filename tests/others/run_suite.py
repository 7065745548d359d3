"""Runs one of the suites of this folder and writes each test's outcome as a JSON line.

    python run_suite.py SUITE METHOD CONTEXT --out FILE [--select REGEX] [--only IDS_FILE]
        [--after ID] [--hang SECONDS]

SUITE is a module of this folder (``mp_suite``, ``cf_suite``), METHOD a start method,
CONTEXT ``stdlib`` or ``shmtensor``.  Each test writes a ``start`` line, then an ``end``
line with its outcome (pass, fail, error, skip, xfail, xpass) and the first lines of its
error or skip reason; so when a test hangs (``faulthandler`` ends the process after
``--hang`` seconds, its traceback on stderr) the caller knows which one, and goes on with
``--after`` it; the same for fixtures that hang between two tests.  Module and class
fixtures that fail are reported as ``error`` under the id unittest gives them.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import sys
import time
import traceback
import unittest

DETAIL_LINES = 12


def _iter_tests(suite):
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            yield from _iter_tests(t)
        else:
            yield t


def _detail(text: str) -> str:
    return "\n".join(text.strip().splitlines()[-DETAIL_LINES:])


class JsonResult(unittest.TextTestResult):
    """Writes each outcome as it happens; re-arms the hang timer at each test."""

    def __init__(self, stream, descriptions, verbosity, *, out, hang):
        super().__init__(stream, descriptions, verbosity)
        self._out, self._hang = out, hang
        self._outcome: dict[str, tuple[str, str]] = {}
        self._t0 = 0.0

    def _write(self, **record) -> None:
        self._out.write(json.dumps(record) + "\n")
        self._out.flush()

    def startTest(self, test):
        super().startTest(test)
        self._t0 = time.monotonic()
        faulthandler.dump_traceback_later(self._hang, exit=True)
        self._write(event="start", id=test.id())

    def stopTest(self, test):
        # re-armed, not cancelled: class and module fixtures run between tests
        faulthandler.dump_traceback_later(self._hang, exit=True)
        outcome, detail = self._outcome.pop(test.id(), ("pass", ""))
        self._write(event="end", id=test.id(), outcome=outcome, detail=detail,
                    secs=round(time.monotonic() - self._t0, 2))
        super().stopTest(test)

    def _set(self, test, outcome: str, detail: str) -> None:
        if isinstance(test, unittest.TestCase) and hasattr(test, "_testMethodName"):
            # a failed subtest fails its test; the first failure's text is kept
            prev = self._outcome.get(test.id())
            if prev is None or prev[0] in ("pass", "skip"):
                self._outcome[test.id()] = (outcome, detail)
        else:  # a fixture (setUpModule, setUpClass ...): no startTest/stopTest around it
            self._write(event="end", id=str(test), outcome=outcome, detail=detail, secs=0)

    def _err_text(self, err) -> str:
        exctype, value, tb = err
        return _detail("".join(traceback.format_exception(exctype, value, tb)))

    def addError(self, test, err):
        super().addError(test, err)
        self._set(test, "error", self._err_text(err))

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._set(test, "fail", self._err_text(err))

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            kind = "fail" if issubclass(err[0], test.failureException) else "error"
            self._set(test, kind, f"{subtest.id()}:\n" + self._err_text(err))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._set(test, "skip", str(reason))

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._set(test, "xfail", "")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._set(test, "xpass", "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suite")
    ap.add_argument("method")
    ap.add_argument("context", choices=("stdlib", "shmtensor"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--after", help="run only the tests after this id (suite order)")
    ap.add_argument("--select", help="run only the tests whose id this regex matches")
    ap.add_argument("--only", help="a file of test ids, one a line: run only these")
    ap.add_argument("--hang", type=float, default=120.0,
                    help="seconds one test may take before the run is ended")
    args = ap.parse_args()

    # the suite modules read these at import, in this process and in every child
    os.environ["SHMTENSOR_SUITE_METHOD"] = args.method
    os.environ["SHMTENSOR_SUITE_CONTEXT"] = args.context
    loader = unittest.TestLoader()
    with open(args.out, "a", encoding="utf-8") as out:
        try:
            tests = list(_iter_tests(loader.loadTestsFromName(args.suite)))
        except unittest.SkipTest as exc:
            out.write(json.dumps({"event": "skip_suite", "reason": str(exc)}) + "\n")
            return 0
        if args.select:
            tests = [t for t in tests if re.search(args.select, t.id())]
        if args.only:
            with open(args.only, encoding="utf-8") as f:
                wanted = {line.strip() for line in f if line.strip()}
            tests = [t for t in tests if t.id() in wanted]
        if args.after:
            ids = [t.id() for t in tests]
            tests = tests[ids.index(args.after) + 1:] if args.after in ids else []
        out.write(json.dumps({"event": "collected", "ids": [t.id() for t in tests]}) + "\n")
        out.flush()
        runner = unittest.TextTestRunner(
            stream=sys.stderr, verbosity=1,
            resultclass=lambda *a: JsonResult(*a, out=out, hang=args.hang))
        result = runner.run(unittest.TestSuite(tests))
        faulthandler.cancel_dump_traceback_later()
        out.write(json.dumps({"event": "done", "run": result.testsRun}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
