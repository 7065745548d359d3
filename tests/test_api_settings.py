"""One rule for bad settings: only the calls that use a setting fail.

A bad environment variable is kept, not raised, when shmtensor is imported; each call
raises it only if it uses that setting (a receive spin is used by a channel's reader,
the sharing strategy by making shared memory, the inline threshold by sending an array
that is not shared already).  Each variable runs in a fresh interpreter."""

import json
import os
import subprocess
import sys

import pytest

# every call, in a fresh interpreter: "ok" or the first words of its ValueError
CALLS = r"""
import json, sys
import numpy as np
import shmtensor, shmtensor.multiprocessing as smp

def send(a):
    q = smp.SimpleQueue()  # its reader is made with the spin: make it before the setting
    try:
        q.put(a)
        q.get()
    finally:
        q.close()

calls = {
    "get_sharing_strategy": shmtensor.get_sharing_strategy,
    "get_inline_threshold": shmtensor.get_inline_threshold,
    "get_receive_spin": shmtensor.get_receive_spin,
    "zeros": lambda: shmtensor.zeros(10),
    "BatchPool": lambda: shmtensor.BatchPool((4,), slots=1).close(),
    "Queue": lambda: smp.Queue().close(),
    "Pipe": lambda: [c.close() for c in smp.Pipe()],
}
out = {}
for name, call in calls.items():
    try:
        call()
        out[name] = "ok"
    except ValueError as e:
        out[name] = str(e)
# sending needs a channel, which needs the spin: set that one first when it is the bad one
if out["Queue"] != "ok":
    shmtensor.set_receive_spin(0)
sends = {
    "send shared": lambda: send(np.zeros(10) if out["zeros"] != "ok" else shmtensor.zeros(10)),
    "send small plain": lambda: send(np.arange(10.0)),
    "send large plain": lambda: send(np.ones(1 << 20)),
}
for name, call in sends.items():
    try:
        call()
        out[name] = "ok"
    except ValueError as e:
        out[name] = str(e)
print(json.dumps(out))
"""

# the calls each bad variable fails; every other call works
USES = {
    "SHMTENSOR_SHARING_STRATEGY": {"get_sharing_strategy", "zeros", "BatchPool",
                                   "send large plain"},
    "SHMTENSOR_INLINE_THRESHOLD": {"get_inline_threshold", "send small plain",
                                   "send large plain"},
    "SHMTENSOR_RECEIVE_SPIN_US": {"get_receive_spin", "Queue", "Pipe"},
}
BAD = {"SHMTENSOR_SHARING_STRATEGY": "bogus", "SHMTENSOR_INLINE_THRESHOLD": "80KB",
       "SHMTENSOR_RECEIVE_SPIN_US": "abc"}


def run_with(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SHMTENSOR_")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("var", sorted(USES))
def test_a_bad_variable_fails_only_the_calls_that_use_its_setting(var):
    r = run_with(CALLS, **{var: BAD[var]})
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    # "send shared" sends an array already in shared memory: no setting is read
    for name, result in got.items():
        if name in USES[var]:
            assert result.startswith(f"{var}={BAD[var]!r}"), (name, result)
        else:
            assert result == "ok", (name, result)


SPAWN_CHILD = r"""
import shmtensor, shmtensor.multiprocessing as smp

def child():
    assert float(shmtensor.ones(4).sum()) == 4.0  # uses the strategy, not the bad setting

if __name__ == "__main__":
    p = smp.get_context("spawn").Process(target=child)
    p.start()
    p.join(60)
    if p.is_alive():
        p.kill()
        p.join()
    print("exitcode", p.exitcode)
"""


@pytest.mark.parametrize("var", ["SHMTENSOR_INLINE_THRESHOLD", "SHMTENSOR_RECEIVE_SPIN_US"])
def test_a_spawned_child_starts_under_a_bad_variable_it_does_not_use(var, tmp_path):
    # the parent sends its settings with the child: a bad one stays behind, not raised
    script = tmp_path / "main.py"
    script.write_text(SPAWN_CHILD)
    full = {k: v for k, v in os.environ.items() if not k.startswith("SHMTENSOR_")}
    full[var] = BAD[var]
    r = subprocess.run([sys.executable, str(script)], env=full, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["exitcode", "0"], (r.stdout, r.stderr)
