"""Runs a suite of this folder in subprocesses and tells shmtensor's failures from the stdlib's.

``run`` starts ``run_suite.py`` in a session of its own, goes on after a test that hangs or
kills the runner (the test is recorded as ``hang``), and kills whatever the run left in its
session.  ``compare`` is the verdict the tests use: a full run with shmtensor's context,
then the tests that did not pass there are run again, alone, with the stdlib's context
and with shmtensor's.  A test is a **regression** when it passes with the stdlib and fails
with shmtensor both times; **flaky** when it passes with shmtensor on the second try.
So the stdlib's baseline is measured live, on this machine and interpreter, for just the
tests that need it: nothing to keep up to date per Python version.

    python tests/others/driver.py [--python PY] [--full] SUITE METHOD...   # counts, both contexts
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
PASSING = {"pass", "xfail"}
HANG = 120.0  # seconds one test may take before its run is ended
DETAIL = 4  # lines of a failure kept in a report (carets of 3.11+ tracebacks left out)

SUITES = {"cpython": "mp_suite", "futures": "cf_suite"}

# Where shmtensor differs from the stdlib on purpose: id (suffix) -> why.
INTENDED = {
    "WithProcessesTestPoolWorkerErrors.test_unpickleable_result":
        "a task returning a lambda: the stdlib raises MaybeEncodingError, shmtensor sends it "
        "by value with cloudpickle (README: lambdas and closures work)",
}


@dataclass
class Result:
    """One suite run: each test's (outcome, detail), in the order they ran."""
    outcomes: dict[str, tuple[str, str]] = field(default_factory=dict)
    collected: list[str] = field(default_factory=list)
    secs: float = 0.0
    skipped_suite: str | None = None
    left_behind: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        c = {"run": len(self.outcomes)}
        for outcome, _ in self.outcomes.values():
            c[outcome] = c.get(outcome, 0) + 1
        return c

    def not_passing(self) -> list[str]:
        return [i for i, (o, _) in self.outcomes.items() if o not in PASSING]


def _group_members(pid: int) -> list[str]:
    """The processes still in session ``pid`` (the run's), as 'pid cmdline'."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) != pid:
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        except (OSError, ValueError):
            continue
        out.append(f"{entry.name} {cmd}")
    return out


def _end_session(pid: int, grace: float = 10.0) -> list[str]:
    """Wait (bounded) for the run's session to empty; kill what stays; return what stayed.
    Resource trackers go last: they exit by themselves once every process that holds
    their pipe is gone, and unlink the semaphores they track on the way out."""
    deadline = time.monotonic() + grace
    left = _group_members(pid)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _group_members(pid)
    for last in (False, True):
        for line in _group_members(pid):
            if last or "resource_tracker" not in line:
                try:
                    os.kill(int(line.split()[0]), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5.0
        while not last and _group_members(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    return left


def run(suite: str, method: str, context: str, *, python: str = sys.executable,
        select: str | None = None, only: list[str] | None = None, hang: float = HANG,
        budget: float = 1800.0, env: dict | None = None) -> Result:
    """Run ``suite`` (a module of this folder) once; see the module's docstring."""
    res = Result()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shmtensor-suite-") as tmp:
        out, err = Path(tmp, "results.jsonl"), Path(tmp, "stderr")
        base = [python, str(HERE / "run_suite.py"), suite, method, context,
                "--out", str(out), "--hang", str(hang)]
        if select:
            base += ["--select", select]
        if only is not None:
            Path(tmp, "only").write_text("\n".join(only) + "\n")
            base += ["--only", str(Path(tmp, "only"))]
        after = None
        while True:
            cmd = base + (["--after", after] if after else [])
            with open(err, "wb") as errf:
                proc = subprocess.Popen(cmd, cwd=tmp, stdout=errf, stderr=subprocess.STDOUT,
                                        start_new_session=True, env={**os.environ, **(env or {})})
                try:
                    proc.wait(timeout=max(1.0, budget - (time.monotonic() - t0)))
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            started, ended, done = _read(out, res)
            stayed = _end_session(proc.pid)
            if done:  # (a test that hangs leaves processes: it is reported as the hang)
                res.left_behind += stayed
                break
            tail = err.read_bytes().decode(errors="replace").strip().splitlines()
            if started is None and ended is None:
                raise RuntimeError(f"{suite} {method} {context}: the runner exited "
                                   f"{proc.returncode} before any test:\n"
                                   + "\n".join(tail[-40:]))
            # the runner died inside `started`, or in the fixtures after `ended`: record it,
            # go on after it
            where = started or f"fixtures after {ended}"
            res.outcomes[where] = ("hang", f"runner ended (exit {proc.returncode}) here; "
                                   f"its stderr ends:\n" + "\n".join(tail[-40:]))
            after = started or ended
            if time.monotonic() - t0 > budget:
                break
            out.unlink()
    res.secs = time.monotonic() - t0
    return res


def _read(path: Path, res: Result) -> tuple[str | None, str | None, bool]:
    """Fold a results file into ``res``; the test that started and never ended, the last
    that ended, and whether the run finished."""
    started, ended, done = None, None, False
    if not path.exists():
        return None, None, False
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        ev = rec["event"]
        if ev == "skip_suite":
            res.skipped_suite = rec["reason"]
            done = True
        elif ev == "collected":
            if not res.collected:
                res.collected = rec["ids"]
        elif ev == "start":
            started = rec["id"]
        elif ev == "end":
            res.outcomes[rec["id"]] = (rec["outcome"], rec["detail"])
            if rec["id"] == started:
                started, ended = None, rec["id"]
        elif ev == "done":
            done = True
    return started, ended, done


def _ids_of(ids: list[str], collected: list[str]) -> list[str]:
    """Test ids to run again for ``ids``; a fixture ('setUpClass (mod.Class)') stands for
    its class's or module's tests, a hang in the fixtures after a test for its module's."""
    out = []
    for i in ids:
        m = (re.match(r"\w+ \(([\w.]+)\)$", i)
             or re.match(r"fixtures after ([\w.]+)\.\w+\.\w+$", i))
        if m:
            out += [c for c in collected if c.startswith(m.group(1) + ".")]
        else:
            out.append(i)
    return list(dict.fromkeys(out))


def _passes(test_id: str, outcomes: dict, collected: list[str]) -> bool:
    """Whether a run passed ``test_id``; a fixture id passes when it is not reported and
    every test it stands for passed."""
    if test_id in outcomes:
        return outcomes[test_id][0] in PASSING
    members = [m for m in _ids_of([test_id], collected) if m != test_id]
    return bool(members) and all(outcomes.get(m, ("-",))[0] in PASSING for m in members)


def intended(test_id: str) -> str | None:
    return next((why for k, why in INTENDED.items() if test_id.endswith(k)), None)


@dataclass
class Verdict:
    shm: Result
    stdlib_again: Result | None = None
    shm_again: Result | None = None
    regressions: dict[str, str] = field(default_factory=dict)  # id -> detail
    flaky: dict[str, str] = field(default_factory=dict)
    intended: dict[str, str] = field(default_factory=dict)

    def report(self, title: str) -> str:
        c = self.shm.counts()
        lines = [f"{title}: shmtensor ran {c.pop('run')} tests in {self.shm.secs:.0f}s: "
                 + ", ".join(f"{v} {k}" for k, v in sorted(c.items()))]
        if self.stdlib_again is not None:
            lines.append(f"  the {len(self.stdlib_again.outcomes)} that did not pass, again: "
                         f"stdlib {_fmt(self.stdlib_again)}; shmtensor "
                         f"{_fmt(self.shm_again) if self.shm_again else '-'}")
        if self.shm.left_behind:
            lines.append("  processes left in the run's session (killed): "
                         + "; ".join(self.shm.left_behind[:5]))
        for name, group in (("FAILS ONLY WITH SHMTENSOR", self.regressions),
                            ("flaky with shmtensor (failed once, passed alone)", self.flaky),
                            ("differs on purpose", self.intended)):
            for tid, detail in group.items():
                kept = [ln for ln in detail.strip().splitlines() if ln.strip(" ^~")]
                short = "\n      ".join(kept[-DETAIL:])
                lines.append(f"  {name}: {tid}\n      {short}")
        return "\n".join(lines)


def _fmt(res: Result) -> str:
    c = res.counts()
    c.pop("run")
    return ", ".join(f"{v} {k}" for k, v in sorted(c.items())) or "nothing run"


def compare(suite: str, method: str, *, python: str = sys.executable,
            select: str | None = None, env: dict | None = None,
            shm: Result | None = None, **run_kw) -> Verdict:
    """shmtensor's run (``shm`` when already made), then the stdlib's and shmtensor's on the
    tests that did not pass; see the module's docstring."""
    if shm is None:
        shm = run(suite, method, "shmtensor", python=python, select=select, env=env,
                  **run_kw)
    v = Verdict(shm)
    suspects = shm.not_passing()
    if shm.skipped_suite or not suspects:
        return v
    ids = _ids_of(suspects, shm.collected)
    v.stdlib_again = run(suite, method, "stdlib", python=python, only=ids, env=env, **run_kw)
    failing = [i for i in suspects if _passes(i, v.stdlib_again.outcomes, ids)]
    v.intended = {i: intended(i) for i in failing if intended(i)}
    failing = [i for i in failing if i not in v.intended]
    if failing:
        v.shm_again = run(suite, method, "shmtensor", python=python,
                          only=_ids_of(failing, shm.collected), env=env, **run_kw)
    for i in failing:
        detail = shm.outcomes[i][1]
        if shm.outcomes[i][0] == "skip":
            detail = f"skipped with shmtensor, runs with the stdlib: {detail}"
        if _passes(i, v.shm_again.outcomes, ids):
            v.flaky[i] = detail
        else:
            v.regressions[i] = detail
    return v


def main() -> int:
    ap = argparse.ArgumentParser(description="Counts of a suite with both contexts.")
    ap.add_argument("suite", choices=sorted(SUITES))
    ap.add_argument("methods", nargs="+")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--select")
    ap.add_argument("--flavours", default="processes",
                    help="of CPython's suite: processes, misc, manager (comma-separated)")
    args = ap.parse_args()
    env = {"SHMTENSOR_SUITE_FLAVOURS": args.flavours}
    for method in args.methods:
        for context in ("stdlib", "shmtensor"):
            res = run(SUITES[args.suite], method, context, python=args.python,
                      select=args.select, env=env)
            if res.skipped_suite:
                print(f"{args.suite} {method} {context}: skipped: {res.skipped_suite}")
                continue
            print(f"{args.suite} {method} {context}: {res.counts()} in {res.secs:.0f}s"
                  + (f"; left behind: {res.left_behind}" if res.left_behind else ""))
            for tid, (o, d) in res.outcomes.items():
                if o not in PASSING:
                    last = d.strip().splitlines()[-1:] or [""]
                    print(f"    {o}: {tid}: {last[0][:150]}")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
